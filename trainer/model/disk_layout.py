"""A generic-path model's weights as its checkpoint stores them and as the model computes with them, by
transformers' own conversion rules for the model class.

transformers 5 keeps some weights in memory otherwise than its checkpoints store them: a mixture-of-experts
layer's experts fused into ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]
where the checkpoint holds one tensor per expert and projection (``mlp.experts.7.gate_proj.weight``), renamed
modules, prefixes. ``from_pretrained`` converts on load by the model class's conversion mapping
(``transformers.conversion_mapping``: ``WeightRenaming`` and ``WeightConverter`` entries), and
``save_pretrained`` writes the checkpoint's layout back by the same mapping reversed
(``revert_weight_conversion``). The store holds what the model computes with (the fused tensors): the planner,
the store and tiermem's checkpoints see those.

A ``DiskLayout`` is that mapping applied to one checkpoint's tensor names and shapes (its files' headers), or,
for a model started from config.json alone, to the layout ``save_pretrained`` would write. It is made of
units: on-disk tensors that load as a set of in-memory ones (one per expert and projection -> the fused
tensor; one tensor renamed), each converted by transformers' own code when it is loaded (``convert``) and
reverted by transformers' own ``revert_weight_conversion`` when it is written (``revert``). Every unit's
reverse is checked on meta tensors when the layout is made (names and shapes back to the checkpoint's): a
model whose conversion transformers cannot write back is refused in one line before anything is loaded.
Tensors the model class ignores on load (``_keys_to_ignore_on_load_unexpected``: DeepSeek-V3's multi-token
prediction layer, a stale ``rotary_emb.inv_freq``) are left out, as ``from_pretrained`` leaves them.
"""

from __future__ import annotations

import copy
import functools
import re
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from trainer.model.config import ModelConfigError

_LOCK = threading.Lock()  # (the reverse reads the conversions off the model: one layout at a time)
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


@dataclass
class Unit:
    """On-disk tensors (``sources``, in the checkpoint's order) that load as the in-memory ``targets``."""

    sources: list[str]
    targets: list[str] = field(default_factory=list)
    converter: object = None  # transformers' WeightConverter (copied for each use); None: a renaming
    keys: list[tuple[str, str, str]] = field(default_factory=list)  # (source, renamed, source pattern)

    @property
    def identity(self) -> bool:
        return self.converter is None and self.sources == self.targets


class DiskLayout:
    """The on-disk tensors of a model (``disk``: name -> shape, in the checkpoint's order) as ``units``."""

    def __init__(self, model, disk: dict[str, tuple[int, ...]], units: list[Unit], ignored: list[str],
                 conversions: list):
        self.model, self.disk, self.units, self.ignored = model, disk, units, ignored
        self.where: dict[str, str] = {}  # on-disk name -> its file
        self.conversions = conversions  # the transforms the checkpoint's names used (save_pretrained reverts them)
        self.unit_of: dict[str, Unit] = {}  # in-memory name -> its unit (once converted: _check)

    def convert(self, unit: Unit, read) -> dict[str, torch.Tensor]:
        """The in-memory tensors of ``unit`` from its on-disk ones (``read(name)``), by transformers' converter."""
        if unit.converter is None:
            from transformers.core_model_loading import WeightRenaming

            mapping = WeightRenaming(unit.keys[0][0], unit.keys[0][1])
        else:
            mapping = copy.deepcopy(unit.converter)
        for source, renamed, pattern in unit.keys:
            mapping.add_tensor(renamed, source, pattern, functools.partial(read, source))
        out = mapping.convert(unit.keys[0][1], model=self.model, config=self.model.config)
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}

    def revert(self, unit: Unit, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The on-disk tensors of ``unit`` from its in-memory ones, by transformers' ``revert_weight_conversion``."""
        if unit.identity:
            return dict(tensors)
        from transformers.core_model_loading import revert_weight_conversion

        with _LOCK:
            self.model._weight_conversions = self.conversions
            return revert_weight_conversion(self.model, dict(tensors))


class Exporter:
    """The checkpoint's on-disk tensors from the in-memory ones handed over one at a time in ``order`` (the
    store's weights, forward order); ``fixed``: the others, known from the start (persistent buffers). ``items``:
    the on-disk names and shapes in the order ``feed`` gives them: a unit's as soon as its last in-memory tensor
    has come (its own fixed tensors' units first). An in-memory tensor of no unit that comes (a tied weight) is
    not written, as ``save_pretrained`` leaves it out."""

    def __init__(self, layout: DiskLayout, order: list[str], fixed: dict[str, torch.Tensor]):
        self.layout, self.order, self.fixed = layout, order, fixed
        self._pending = {id(u): set(u.targets) - set(fixed) for u in layout.units}
        self._first = [u for u in layout.units if not self._pending[id(u)]]
        units, seen, left = list(self._first), {id(u) for u in self._first}, copy.deepcopy(self._pending)
        for name in order:
            unit = layout.unit_of.get(name)
            if unit is None:
                raise ValueError(f"{name} is not a weight of the checkpoint's layout")
            left[id(unit)].discard(name)
            if not left[id(unit)] and id(unit) not in seen:
                units.append(unit)
                seen.add(id(unit))
        self.items = [(k, layout.disk[k]) for u in units for k in u.sources]
        self._held: dict[str, torch.Tensor] = {}
        self._next = 0

    def feed(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if self._next >= len(self.order) or self.order[self._next] != name:
            want = self.order[self._next] if self._next < len(self.order) else "nothing"
            raise ValueError(f"expected {want} next, got {name}")
        out = [] if self._next else [kv for u in self._first for kv in self._ready(u)]
        self._next += 1
        unit = self.layout.unit_of[name]
        self._held[name] = t
        self._pending[id(unit)].discard(name)
        if not self._pending[id(unit)]:
            out += self._ready(unit)
        return out

    def _ready(self, unit: Unit) -> list[tuple[str, torch.Tensor]]:
        tensors = {k: self._held.pop(k) if k in self._held else self.fixed[k] for k in unit.targets}
        back = self.layout.revert(unit, tensors)
        return [(k, back[k]) for k in unit.sources]


def _transforms(model):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model)
    return (mapping, [m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def _ignored(model) -> list[re.Pattern]:
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    return [re.compile(p) for p in patterns + [r"rotary_emb\.inv_freq$"]]


def read_layout(model, disk: dict[str, tuple[tuple[int, ...], str, str]], whole: str) -> DiskLayout:
    """The layout of a checkpoint whose tensors are ``disk`` (name -> (shape, safetensors dtype, its file for
    messages; ``whole``: the checkpoint, for what it lacks)), as
    ``from_pretrained`` reads it into ``model`` (a skeleton on the meta device), or one line naming what does not
    fit: a tensor the model has no place for, one of another shape, one missing."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    mapping, renamings, converters = _transforms(model)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict()
    prefix = model.base_model_prefix
    ignore = _ignored(model)
    units: dict[str, Unit] = {}
    ignored = []
    for key in sorted(disk, key=dot_natural_key):  # (experts in order: the fused tensor stacks them so)
        shape, dtype, where = disk[key]
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # (as from_pretrained: a key that should not have been renamed)
            renamed, pattern = rename_source_key(key, [], [], prefix, meta)
        if renamed not in meta:
            if any(p.search(key) for p in ignore):
                ignored.append(key)
                continue
            raise ModelConfigError(f"{where}: unexpected tensor {key} (does config.json match the weights?)")
        if dtype not in _DTYPES:
            raise ModelConfigError(f"{where}: {key} is {dtype}; the model's weights must be floating point")
        unit = units.get(renamed)
        if unit is None:
            unit = units[renamed] = Unit([], converter=by_pattern[pattern] if pattern is not None else None)
        elif unit.converter is None:
            raise ModelConfigError(f"{where}: {unit.sources[0]} and {key} both load as {renamed}")
        unit.sources.append(key)
        unit.keys.append((key, renamed, pattern if pattern is not None else key))
    used = [m for m in mapping if m.was_used()]  # (what save_pretrained reverts)
    layout = DiskLayout(model, {k: disk[k][0] for k in disk if k not in ignored}, list(units.values()), ignored,
                        used)
    layout.where = {k: disk[k][2] for k in layout.disk}
    _check(layout, meta, {k: (s, _DTYPES.get(d, torch.float32), w) for k, (s, d, w) in disk.items()}, whole)
    return layout


def saved_layout(model, where: str) -> DiskLayout:
    """The layout ``save_pretrained`` writes for ``model`` made from its config alone (transformers' default
    conversion mapping reverted), read back as a checkpoint of it (the round trip checked)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in model.state_dict().items()}
    with _LOCK:
        model.__dict__.pop("_weight_conversions", None)
        disk = revert_weight_conversion(model, state)
    return read_layout(model, {k: (tuple(t.shape), "F32", where) for k, t in disk.items()}, where)


def _meta(spec) -> torch.Tensor:
    shape, dtype, _ = spec
    return torch.empty(shape, dtype=dtype, device="meta")


def _check(layout: DiskLayout, meta: dict, disk: dict, whole: str) -> None:
    """Each unit converted on meta tensors: its targets are the model's, of their shapes; every tensor of the model
    comes from one; reverted, each gives back its on-disk names and shapes."""
    seen = set()
    for unit in layout.units:
        where = disk[unit.sources[0]][2]
        try:
            got = layout.convert(unit, lambda k: _meta(disk[k]))
        except Exception as e:  # noqa: BLE001 - transformers' ops refuse shapes they cannot stack or join
            counts = Counter(pattern for _, _, pattern in unit.keys)  # (an expert missing, or one too many)
            what = ", ".join(f"{n} of {p}" for p, n in counts.items())
            raise ModelConfigError(f"{where}: {unit.sources[0]} and the rest of its set ({what}) cannot be converted "
                                   f"as transformers loads it ({_one_line(e)})") from None
        for name, t in got.items():
            if name not in meta:
                raise ModelConfigError(f"{where}: {unit.sources[0]} converts to {name}, which the model lacks")
            if tuple(t.shape) != tuple(meta[name].shape):
                what = unit.sources[0] if len(unit.sources) == 1 else f"{unit.sources[0]} and the rest of its set"
                raise ModelConfigError(f"{where}: {what} has shape {list(t.shape)} as {name}, config.json implies "
                                       f"{list(meta[name].shape)}")
        unit.targets = list(got)
        seen.update(got)
        if unit.identity:
            continue
        try:
            back = layout.revert(unit, {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in got.items()})
        except Exception as e:  # noqa: BLE001 - a conversion transformers cannot reverse
            back = {"?": e}
        if sorted(back) != sorted(unit.sources) or any(tuple(back[k].shape) != disk[k][0] for k in back):
            raise ModelConfigError(f"{where}: not supported yet: transformers cannot write {unit.sources[0]} back "
                                   f"as the checkpoint stores it (its conversion to {unit.targets[0]} has no exact "
                                   "reverse)")
    layout.unit_of = {t: u for u in layout.units for t in u.targets}
    missing = [n for n in meta if n not in seen and not _derived(layout.model, n)]
    if missing:
        raise ModelConfigError(f"{whole}: weights lack {missing[0]}" + (f" and {len(missing) - 1} more"
                                                                         if len(missing) > 1 else ""))


def _derived(model, name: str) -> bool:
    """A state-dict entry that needs no tensor of its own: a tied weight (the LM head of a tied embedding)."""
    try:
        owner, _, leaf = name.rpartition(".")
        t = getattr(model.get_submodule(owner), leaf)
    except AttributeError:
        return False
    params = dict(model.named_parameters())  # (shared parameters listed once, under their first name)
    return name not in params and any(p is t for p in params.values())


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]
