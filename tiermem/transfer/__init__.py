"""Moving bytes between tiers: the mover (asynchronous copies on CUDA streams and I/O threads, futures)
and each link's accounting."""
