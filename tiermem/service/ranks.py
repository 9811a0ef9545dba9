"""Several ranks of one host attached to one service: which rank owns which group, checked, and the part of the
service's HBM each rank maps.

Rank 0 creates the run and says every group's owner (``owners``, as ``trainer.parallel.dp.owners`` balances them);
the plan keeps a group's state in HBM on its owner's GPU (``tiermem.service.planning``), in the service's block
there (``tiermem.tiers.hbm_parts``). The others say which groups they own (``owns``), which must be those; a run
that keeps state in HBM is rejoined by as many ranks as it was made for, each group owned as before.

    owners = owners_of(msg, groups, world)       # rank 0's hello of a new run
    check_rejoin(record, world, owners)          # rank 0's hello of a run the service holds
    check_owns(record, rank, owns)               # another rank's hello
    desc = hbm_of(store, section, rank)          # what the rank maps (None: it keeps nothing in HBM)
"""

from __future__ import annotations

from tiermem.service.requests import RequestError, is_key
from tiermem.store.layout import shared_description


def owners_of(msg: dict, groups: list, world: int) -> dict:
    """Rank 0's ``owners`` ([[group, rank], ...]: every group once, each rank below ``world``) as a dict."""
    pairs = msg.get("owners")
    if not (isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 and is_key(p[0]) and type(p[1]) is int
                                            and 0 <= p[1] < world for p in pairs)):
        raise RequestError("rank 0 of several must say every group's owner ('owners': a list of [group, rank])")
    owners = {g: r for g, r in pairs}
    if len(owners) != len(pairs) or set(owners) != set(groups):
        raise RequestError("'owners' must name every group of the run once")
    mine = msg.get("owns")
    if isinstance(mine, list) and set(mine) != {g for g, r in owners.items() if r == 0}:
        raise RequestError("rank 0's 'owns' are not the groups 'owners' gives it")
    return owners


def recorded_owners(record: dict) -> dict | None:
    """The owners a run keeping state in several ranks' HBM was made with (None: one rank's, or none in HBM)."""
    pairs = record.get("owners")
    return None if pairs is None else {g: r for g, r in pairs}


def check_rejoin(record: dict, world: int, msg: dict) -> None:
    """Rank 0 attaches to a run the service holds: one keeping state in HBM takes as many ranks as it was made for,
    each group owned by the same one (each rank's state lives on its own GPU)."""
    was = record.get("world", 1)
    if record.get("hbm_capacity") and world != was:
        held = "its trainer's GPU" if was == 1 else f"the GPU of each of its {was} ranks"
        raise RequestError(f"the service's run keeps state in HBM on {held}; attach it with {was} "
                           f"rank{'s' if was > 1 else ''} (this trainer has {world}), or restart the service with "
                           "--fresh to discard it")
    owners = recorded_owners(record)
    if owners is None:
        return
    if owners_of(msg, list(owners), world) != owners:
        raise RequestError("the service's run has its groups owned by other ranks than this trainer's; restart the "
                           "service with --fresh to discard it")


def check_owns(record: dict, rank: int, owns: list) -> None:
    """Another rank attaches: the groups it owns are those the run was made with."""
    owners = recorded_owners(record)
    if owners is not None and set(owns) != {g for g, r in owners.items() if r == rank}:
        raise RequestError(f"rank {rank} owns other groups than the service's run gives it (its state in HBM lives on "
                           "each owner's GPU); restart the service with --fresh to discard the run")


def hbm_of(store, section, rank: int) -> dict | None:
    """What rank ``rank``'s trainer maps of the service's HBM: its part of a parted tier, or the one block."""
    dev = store.tiers.device
    if hasattr(dev, "describe_part"):
        return dev.describe_part(rank)
    return shared_description(dev, section) if rank == 0 else None
