"""``dataset_dir/dataset_info.json`` as LLaMA-Factory defines it, and reading a dataset's rows.

An entry names a ``file_name`` (json, jsonl, csv, parquet or txt; or a folder of them), a
``formatting`` (``alpaca``, ``sharegpt``, or ours: ``tokenized``), optional ``columns`` (prompt, query,
response, history, system, tools / messages, system, tools; chosen, rejected), ``ranking`` (a preference dataset,
for stage dpo: ``trainer.data.pairs``) and, for sharegpt, ``tags`` (role_tag,
content_tag, user_tag, assistant_tag, observation_tag, function_tag, system_tag). Hub entries
(``hf_hub_url`` ...) cannot be fetched offline and are refused with what to do instead.
"""

from __future__ import annotations

import csv
import difflib
import json
from dataclasses import dataclass
from pathlib import Path

from tiermem.errors import ConfigError, ConfigProblems, nearest
from tiermem.files import is_regular, read_json

READABLE = (".json", ".jsonl", ".csv", ".parquet", ".txt")
FORMATTINGS = ("alpaca", "sharegpt", "tokenized")
ENTRY_KEYS = ("file_name", "formatting", "columns", "tags", "ranking", "split", "num_samples", "subset", "folder",
              "hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name", "revision", "file_sha1")


class DataError(ConfigError):
    """A dataset file or row is unusable."""


class DataProblems(ConfigProblems, DataError):
    """Several datasets' problems, found in one pass: one line each."""


@dataclass
class DatasetEntry:
    name: str
    files: list[Path]
    formatting: str = "alpaca"
    columns: dict | None = None  # None: LLaMA-Factory's defaults
    tags: dict | None = None
    ranking: bool = False  # a preference dataset: each row a prompt with a chosen and a rejected response


def load_registry(dataset_dir: str | Path) -> dict:
    path = Path(dataset_dir) / "dataset_info.json"
    if not is_regular(path, "dataset_info.json"):
        raise DataError(f"dataset_dir: {dataset_dir} has no dataset_info.json")
    info = read_json(path, "dataset_info.json")
    if not isinstance(info, dict):
        raise DataError(f"{path}: expected a mapping of dataset names to entries")
    return info


def resolve(names: str, dataset_dir: str | Path) -> list[DatasetEntry]:
    """The entries of the comma-separated dataset ``names``; every problem of them found in one pass (unknown names
    with the names ``dataset_info.json`` has, unusable entries, missing files), raised as one line each."""
    entries, found = _entries(names, dataset_dir)
    if found:
        raise DataError(found[0]) if len(found) == 1 else DataProblems(found)
    return entries


def problems(names: str, dataset_dir: str | Path) -> list[str]:
    """What is wrong with the comma-separated dataset ``names`` in ``dataset_dir``, one line each ([]: nothing):
    the config's check, before anything is read."""
    return _entries(names, dataset_dir)[1]


def _entries(names: str, dataset_dir: str | Path) -> tuple[list[DatasetEntry], list[str]]:
    try:
        info = load_registry(dataset_dir)
    except DataError as e:
        return [], [str(e)]
    where = Path(dataset_dir) / "dataset_info.json"
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if not wanted:
        return [], ["dataset: no dataset named"]
    out, found = [], []
    for name in wanted:
        if name not in info:
            found.append(f"dataset '{name}' is not in {where}; {_names_it_has(name, list(info))}")
            continue
        try:
            out.append(_entry(name, info[name], where, Path(dataset_dir)))
        except DataError as e:
            found.append(str(e))
    return out, found


# how many of dataset_info.json's names an unknown dataset's line lists (the closest first where it has more)
LISTED = 12


def _names_it_has(name: str, names: list[str]) -> str:
    """The names of ``dataset_info.json`` for an unknown dataset's line: all of them, or the closest first."""
    if not names:
        return "it names no dataset"
    if len(names) <= LISTED:
        return "the names it has: " + ", ".join(sorted(names))
    close = difflib.get_close_matches(name, names, n=LISTED, cutoff=0.0)
    return f"it has {len(names)} names, the closest: {', '.join(close)} and {len(names) - len(close)} more"


def _entry(name: str, entry, where: Path, dataset_dir: Path) -> DatasetEntry:
    """The entry ``name`` of ``where`` checked, its files found."""
    if not isinstance(entry, dict):
        raise DataError(f"{where}: entry '{name}' must be a mapping")
    for key in entry:
        if key not in ENTRY_KEYS:
            raise DataError(f"{where}: entry '{name}' has unknown key '{key}'{nearest(key, ENTRY_KEYS)}")
    if "file_name" not in entry:
        hub = next((k for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
                    if k in entry), None)
        if hub:
            raise DataError(f"dataset '{name}' is fetched from a hub ({hub}), which tiermem cannot do offline; "
                            "download the data and point 'file_name' at it")
        raise DataError(f"{where}: entry '{name}' has no file_name")
    if not isinstance(entry.get("ranking", False), bool):
        raise DataError(f"dataset '{name}': 'ranking' must be true or false")
    if entry.get("num_samples") is not None or entry.get("split", "train") != "train":
        raise DataError(f"dataset '{name}': 'num_samples' and 'split' are not supported yet; use max_samples")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise DataError(f"dataset '{name}': formatting '{formatting}' is not supported"
                        f"{nearest(str(formatting), FORMATTINGS)}; formattings are {', '.join(FORMATTINGS)}")
    for key in ("columns", "tags"):
        if key in entry and not isinstance(entry[key], dict):
            raise DataError(f"dataset '{name}': '{key}' must be a mapping")
    return DatasetEntry(name, _files(dataset_dir / entry["file_name"], name), formatting, entry.get("columns"),
                        entry.get("tags"), entry.get("ranking", False))


def _files(path: Path, name: str) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in READABLE)
        if not files:
            raise DataError(f"dataset '{name}': folder {path} holds no {'/'.join(READABLE)} files")
        for f in files:
            is_regular(f, f"dataset '{name}': file")
        return files
    if not is_regular(path, f"dataset '{name}': file"):
        raise DataError(f"dataset '{name}': file not found: {path}")
    if path.suffix not in READABLE:
        raise DataError(f"dataset '{name}': {path.suffix} files are not supported ({', '.join(READABLE)})")
    return [path]


# the longest line of a .txt or .jsonl file read as a row: 64 Mi characters, tens of millions of tokens (a row is
# cut at cutoff_len; a document packed by stage pt is a book at most); a 2 GB line had been read whole first
MAX_LINE = 64 << 20


def _lines(f, path: Path, limit: int | None = None):
    """(line number, line) of the text file ``f``, each read with a bound: a line longer than ``limit``
    characters stops with one line naming the file and the line, after reading at most that much of it."""
    limit = limit or MAX_LINE
    i = 0
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        i += 1
        if len(line) > limit and not (len(line) == limit + 1 and line.endswith("\n")):
            raise DataError(f"{path}: line {i} is longer than {limit:,} characters; a row is at most that long "
                            "(split the text into lines, or rows)")
        yield i, line


def read_rows(path: Path):
    """Yield (row number, row) from a json (a list of objects), jsonl, csv, parquet or txt (one
    ``{"text": line}`` per non-empty line) file."""
    try:
        if path.suffix == ".txt":
            with path.open(encoding="utf-8") as f:
                for i, line in _lines(f, path):
                    if line.strip():
                        yield i, {"text": line.rstrip("\n")}
        elif path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for i, line in _lines(f, path):
                    if not line.strip():
                        continue
                    try:
                        yield i, json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}: line {i} is not valid JSON: {e.msg}") from None
        elif path.suffix == ".csv":
            with path.open(encoding="utf-8", newline="") as f:
                yield from enumerate(csv.DictReader(f), 1)
        elif path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
            yield from enumerate(pq.read_table(path).to_pylist(), 1)
        else:
            try:
                rows = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON: {e}") from None
            if not isinstance(rows, list):
                raise DataError(f"{path}: expected a JSON list of rows")
            yield from enumerate(rows, 1)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    except Exception as e:  # a corrupt parquet or csv file
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: cannot read: {e}") from None
