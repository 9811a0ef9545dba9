"""Several ranks: the processes (torchrun), data parallelism within a step, a rank's session of a host's store
(embedded or a service's), several hosts kept in step, and a rank's part of a checkpoint."""
