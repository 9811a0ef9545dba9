"""`tiermem-train CONFIG --preview N`: the first N processed training examples, as LLaMA-Factory shows
them (the ids and the decoded text of the input and of the part that is trained), or with `--ids` one JSON
line of ids per example (`{"input_ids": [...], "labels": [...]}`), for scripts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tiermem.errors import printable
from trainer.config import TrainConfig
from trainer.data.prepare import load_rows

LINES = "\n\t"  # the control characters dataset text keeps: its lines and tabs


def preview(cfg: TrainConfig, n: int, ids_only: bool = False, out=print) -> None:
    from trainer.run.job import model_config

    model_dir = Path(cfg.model_name_or_path)
    mcfg = model_config(model_dir, cfg)
    rows = load_rows(cfg.dataset, cfg, mcfg, model_dir, note=lambda line: print(line, file=sys.stderr))
    examples = [(ids, ids if labels is None else labels) for ids, labels in zip(rows.input_ids, rows.labels)][:n]
    if ids_only:
        for ids, labels in examples:
            out(json.dumps({"input_ids": ids, "labels": labels}))
        return
    decode = _decoder(model_dir)
    for i, (ids, labels) in enumerate(examples):
        trained = [t for t in labels if t != -100]
        out(f"example {i + 1}\ninput_ids:\n{ids}\ninputs:\n{printable(decode(ids), LINES)}\nlabel_ids:\n"
            f"{labels}\nlabels:\n{printable(decode(trained), LINES)}")


def _decoder(model_dir: Path):
    if not (model_dir / "tokenizer.json").is_file():
        return lambda ids: "(no tokenizer.json in the model directory: ids only)"
    from trainer.data.tokenizer import load_tokenizer

    return load_tokenizer(model_dir).decode
