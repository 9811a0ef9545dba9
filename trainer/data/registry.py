"""``dataset_dir/dataset_info.json`` as LLaMA-Factory defines it, and reading a dataset's rows.

Each entry names a ``file_name`` (json, jsonl or txt; a folder of them) and a ``formatting``. This
trainer reads ``tokenized`` (ours: rows with ``input_ids`` and optional ``labels``) and, for
``stage: pt``, the text column of an ``alpaca``-formatted entry (``columns: {prompt: text}``, the
default column being ``text``). Other formattings come with the full data system (issue 4).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tiermem.errors import ConfigError, nearest

READABLE = (".json", ".jsonl", ".txt")


class DataError(ConfigError):
    """A dataset file or row is unusable."""


@dataclass
class DatasetEntry:
    name: str
    files: list[Path]
    formatting: str = "alpaca"
    columns: dict = field(default_factory=dict)


def load_registry(dataset_dir: str | Path) -> dict:
    path = Path(dataset_dir) / "dataset_info.json"
    if not path.is_file():
        raise DataError(f"dataset_dir: {dataset_dir} has no dataset_info.json")
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(info, dict):
        raise DataError(f"{path}: expected a mapping of dataset names to entries")
    return info


def resolve(names: str, dataset_dir: str | Path) -> list[DatasetEntry]:
    info = load_registry(dataset_dir)
    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name not in info:
            raise DataError(f"dataset '{name}' is not in {Path(dataset_dir) / 'dataset_info.json'}"
                            f"{nearest(name, list(info))}")
        entry = info[name]
        if not isinstance(entry, dict):
            raise DataError(f"dataset_info.json: entry '{name}' must be a mapping")
        for hub in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name"):
            if hub in entry and "file_name" not in entry:
                raise DataError(f"dataset '{name}' is fetched from a hub ({hub}), which tiermem cannot do offline; "
                                "download the data and point 'file_name' at it")
        if "file_name" not in entry:
            raise DataError(f"dataset_info.json: entry '{name}' has no file_name")
        out.append(DatasetEntry(name, _files(Path(dataset_dir) / entry["file_name"], name),
                                entry.get("formatting", "alpaca"), dict(entry.get("columns") or {})))
    if not out:
        raise DataError("dataset: no dataset named")
    return out


def _files(path: Path, name: str) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in READABLE)
        if not files:
            raise DataError(f"dataset '{name}': folder {path} holds no {'/'.join(READABLE)} files")
        return files
    if not path.is_file():
        raise DataError(f"dataset '{name}': file not found: {path}")
    if path.suffix not in READABLE:
        raise DataError(f"dataset '{name}': {path.suffix} files are not supported yet (json, jsonl, txt)")
    return [path]


def read_rows(path: Path):
    """Yield (row number, row) from a json (list of objects), jsonl or txt (one ``{"text": line}`` each) file."""
    try:
        if path.suffix == ".txt":
            with path.open(encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if line.strip():
                        yield i, {"text": line.rstrip("\n")}
            return
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield i, json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}: line {i} is not valid JSON: {e.msg}") from None
            return
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of rows")
        yield from enumerate(rows, 1)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
