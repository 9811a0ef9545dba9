"""The store: tensors by name in their tiers (``store.Store``), what it knows of them (``catalog``), where
they live as JSON (``layout``), the prefetcher that follows the trainer's schedule (``prefetch``), its
stats snapshot (``stats``) and its state on disk (``checkpoint``).

Import the modules (``from tiermem.store.store import Store``): this package imports nothing itself, so
the optimizer can use the catalog without loading the store. (The specs the store shares with the planner
are a basic module, ``tiermem.specs``.)"""
