"""The tiers: what a tier is (``base``: the ``Tier`` protocol and its roles), the tiers by name (``registry``),
and one module per tier: ``gpu`` (HBM: resident tensors and a pool of streaming slots), ``dram`` (the
shared-memory arena), ``nvme`` (files), with the extent allocator they share (``extents``).

Each tier hands out extents of its own address space; none knows of the others, the catalog, the server, the
cost model or the optimizer.
"""
