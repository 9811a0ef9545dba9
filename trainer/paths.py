"""The training config's paths: ``~`` expanded in every key that names a file or directory, an empty one
refused, and ``output_dir`` kept apart from what the run reads and must not overwrite.

An ``output_dir`` that is, lies inside, or contains ``model_name_or_path`` (symlinks resolved) is refused: the
export writes ``model*.safetensors`` and removes the shards it did not write, and checkpoints are pruned there.
An ``output_dir`` that is or lies inside ``resume_from_checkpoint`` is refused too: the export would overwrite
the checkpoint's own files (a checkpoint inside ``output_dir`` is the usual case, and fine).
"""

from __future__ import annotations

import os
from pathlib import Path

# the TrainConfig keys that name a file, a directory or a socket
PATH_KEYS = ("model_name_or_path", "output_dir", "dataset_dir", "logging_dir", "tiermem_cache_dir",
             "resume_from_checkpoint", "tiermem_server", "ref_model")


def expand(value: str) -> str:
    """``value`` with a leading ``~`` (or ``~user``) expanded, as a shell does."""
    return os.path.expanduser(value)


def expand_paths(c, bad) -> None:
    """Expand ``~`` in every path key of ``c`` (and in ``tiermem`` when it names a file); an empty path is one
    problem each (``bad``)."""
    for key in PATH_KEYS + ("tiermem",):
        value = getattr(c, key)
        if not isinstance(value, str):
            continue
        if not value.strip():
            bad(f"{key} is an empty path: name the " + ("directory" if key != "tiermem" else "file") + " (or leave "
                "the key out" + (")" if key not in ("model_name_or_path", "output_dir") else ": it is required)"))
            continue
        setattr(c, key, expand(value))


def _real(path: str) -> Path:
    return Path(path).resolve()


def _named(given: str, real: Path) -> str:
    """A path as the user gave it, and where it leads when that is elsewhere (a symlink, a relative path)."""
    return given if str(real) == given else f"{given} (= {real})"


def check_output_dir(c, bad) -> None:
    """``output_dir`` apart from the model it reads and the checkpoint it resumes (one problem each)."""
    if not (isinstance(c.output_dir, str) and c.output_dir.strip()):
        return
    out = _real(c.output_dir)
    said = _named(c.output_dir, out)
    if isinstance(c.model_name_or_path, str) and c.model_name_or_path.strip():
        model = _real(c.model_name_or_path)
        if out == model:
            bad(f"output_dir {said} is the model's directory (model_name_or_path): the export would overwrite the "
                "model it reads; choose another output_dir")
        elif out.is_relative_to(model):
            bad(f"output_dir {said} is inside the model's directory {_named(c.model_name_or_path, model)}: the "
                "run would write among the model's files; choose an output_dir outside it")
        elif model.is_relative_to(out):
            bad(f"output_dir {said} contains the model's directory {_named(c.model_name_or_path, model)}: saving, "
                "pruning and exporting there could overwrite or remove it; choose an output_dir that does not hold "
                "the model")
    ck = c.resume_from_checkpoint
    if isinstance(ck, str) and ck.strip() and out.is_relative_to(_real(ck)):
        where = "is" if out == _real(ck) else "is inside"
        bad(f"output_dir {said} {where} resume_from_checkpoint {_named(ck, _real(ck))}: the run would overwrite "
            "the checkpoint's files; choose another output_dir")
