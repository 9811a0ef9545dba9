"""The config reference, written from the configs' fields: ``tiermem-train --keys`` and docs/config.md.

    python -m trainer.config_doc > docs/config.md

Every key's type, default and meaning come from its field (``tiermem.schema.setting``): the training YAML's
(``trainer.config_fields.TrainConfig``), the tiermem config's (``tiermem.config.StoreConfig``, each registered
tier's section), and the answers to every other LLaMA-Factory and Hugging Face key (``trainer.config_keys``).
tests/test_config_doc.py checks that the committed docs/config.md is this module's output.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Iterator

from trainer.config_fields import GROUPS, TrainConfig
from trainer.config_keys import KEYS

WORDS = {str: "string", int: "integer", float: "number", bool: "true | false", type(None): "null", dict: "mapping"}


def type_text(tp) -> str:
    """A field's type as the YAML writes it: ``integer | auto | null``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_text(typing.get_args(tp)[0])}s"
    if origin is dict:
        return "mapping"
    return WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def default_text(f: dataclasses.Field) -> str:
    """A field's default as the docs show it."""
    if "shown" in f.metadata:
        return f.metadata["shown"]
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@dataclasses.dataclass(frozen=True)
class Key:
    """One key of a config: its dotted name, type, default and meaning."""

    name: str
    type: str
    default: str
    help: str


def keys_of(cls: type, prefix: str = "") -> list[Key]:
    """The keys of the config dataclass ``cls`` (``prefix`` before each name), in field order."""
    hints = typing.get_type_hints(cls)
    return [Key(prefix + f.name, f.metadata.get("yaml_type") or type_text(hints[f.name]), default_text(f),
                f.metadata["help"]) for f in dataclasses.fields(cls)]


def train_groups() -> Iterator[tuple[str, list[Key]]]:
    """The training YAML's keys under their groups' headings."""
    keys = keys_of(TrainConfig)
    group = {f.name: f.metadata["group"] for f in dataclasses.fields(TrainConfig)}
    for name, heading in GROUPS.items():
        yield heading, [k for k in keys if group[k.name] == name]


def store_sections() -> Iterator[tuple[str, str, list[Key]]]:
    """The tiermem config's sections: (heading, what it is, its keys): each registered tier's, the optimizer's,
    and the top level's."""
    from tiermem.config import OptimizerConfig, StoreConfig
    from tiermem.tiers import registry

    for name in registry.names():
        cls = registry.tier_type(name).Config
        yield f"tiers.{name}", _doc(cls), keys_of(cls, f"tiers.{name}.")
    yield "optimizer", _doc(OptimizerConfig), keys_of(OptimizerConfig, "optimizer.")
    sections = {"tiers", "optimizer"}
    yield "the top level", "", [k for k in keys_of(StoreConfig) if k.name not in sections]


def answers() -> Iterator[tuple[str, str, list[str], tuple]]:
    """The other keys grouped by their answer: (kind, reason, keys, values accepted without a word)."""
    seen: dict[tuple, tuple[tuple, list[str]]] = {}
    for key, a in KEYS.items():  # (the values may be lists or mappings: grouped by how they read)
        seen.setdefault((a.kind, a.reason, repr(a.ok)), (a.ok, []))[1].append(key)
    for (kind, reason, _), (ok, keys) in seen.items():
        yield kind, reason, keys, ok


def _wrapped(text: str) -> str:
    return textwrap.fill(text, width=116, initial_indent="      ", subsequent_indent="      ", break_on_hyphens=False)


def keys_text() -> Iterator[str]:
    """``tiermem-train --keys``: every key with its type, default and meaning, then every other key's answer."""
    from trainer.config_keys import describe

    yield "The training YAML's keys (LLaMA-Factory's and Hugging Face's meanings; docs/config.md has them as tables):"
    for heading, keys in train_groups():
        yield f"\n{heading}"
        for k in keys:
            yield f"  {k.name}: {k.type}, default {k.default}" if k.default != "required" else \
                f"  {k.name}: {k.type}, required"
            yield _wrapped(k.help)
    yield "\nThe tiermem config (the tiermem key inline, or its file; `tiermem serve --config`):"
    for heading, _, keys in store_sections():
        yield f"\n{heading}"
        for k in keys:
            yield f"  {k.name}: {k.type}, default {k.default}"
            yield _wrapped(k.help)
    yield "\nEvery other key LLaMA-Factory or Hugging Face knows, with the answer tiermem gives it:"
    for key in sorted(KEYS):
        yield f"  {key}: {describe(key)}"


def _cell(text: str) -> str:
    """``text`` in a Markdown table cell: its bars escaped, and its angle brackets (``<name>.arena``), which a
    renderer would take for HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _doc(cls: type) -> str:
    """A config section's docstring as Markdown (one paragraph, single backticks)."""
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split()).replace("``", "`")


def _table(keys: list[Key]) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    return rows + [f"| `{k.name}` | {_cell(k.type)} | {_cell(k.default)} | {_cell(k.help)} |" for k in keys]


def _shown(values: tuple) -> str:
    return ", ".join("`" + ("''" if v == "" else str(v).lower() if isinstance(v, bool) else str(v)) + "`"
                     for v in values)


def markdown() -> str:
    """docs/config.md."""
    out = ["# Config reference", "",
           "<!-- generated by `python -m trainer.config_doc > docs/config.md` from the configs' fields; "
           "tests/test_config_doc.py checks it is current -->", "",
           "Every key `tiermem-train` and `tiermem serve` read, with its type, default and meaning "
           "(`tiermem-train --keys` prints the same). Sizes take `GiB`/`GB`/`MiB`/`MB`/`KiB`/`KB`/`TiB` strings or "
           "integers (bytes); every path expands `~` as a shell does.", "",
           "## The training YAML", "",
           "LLaMA-Factory's keys with LLaMA-Factory's (the Hugging Face Trainer's) meanings, and tiermem's own. "
           "`key=value` arguments override them (values read as YAML; dotted keys reach into an inline `tiermem` "
           "mapping).", ""]
    for heading, keys in train_groups():
        out += [f"### {heading}", "", *_table(keys), ""]
    out += ["## The tiermem config", "",
            "Read by the store: inline under a training YAML's `tiermem:` key or from the file it names, and by "
            "`tiermem serve --config`. Every `auto` is decided at start (`tiermem/plan/resolve.py`) and "
            "`output_dir/training_args.yaml` records the decided values.", ""]
    for heading, what, keys in store_sections():
        out += [f"### {heading}", ""] + ([_cell(what), ""] if what else []) + [*_table(keys), ""]
    out += ["## Every other key", "",
            "Every other key of LLaMA-Factory's arguments and of Hugging Face's `TrainingArguments` gets an answer "
            "(`trainer/config_keys.py`): accepted without effect, with one `note:` line at start saying why, or "
            "refused with the reason, only where running without it would train something other than what the "
            "config asks for. A value that asks for nothing beyond what tiermem does (null, and the values "
            "listed) is accepted without a word. An unknown key is an error naming the nearest known one.", ""]
    for kind, title in (("noop", "Accepted without effect"), ("refuse", "Refused")):
        out += [f"### {title}", "", "| keys | why | accepted without a word |", "|---|---|---|"]
        out += [f"| {', '.join(f'`{k}`' for k in keys)} | {_cell(reason)} | {_cell(_shown(ok))} |"
                for k_, reason, keys, ok in answers() if k_ == kind]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
