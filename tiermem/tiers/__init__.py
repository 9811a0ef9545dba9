"""The tiers: ``gpu`` (slot pool in HBM), ``dram`` (shared-memory arena), ``nvme`` (files).

Each tier hands out extents of its own address space; none knows of the others, the catalog, the
server, the cost model or the optimizer.
"""
