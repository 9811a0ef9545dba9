"""``tf32`` as Hugging Face's TrainingArguments means it, through the command line: ``true`` turns on TF32 for
CUDA's fp32 matmuls and cuDNN for the run, ``false`` turns it off, unset leaves torch's defaults; the flags are put
back at the run's end, the run records the setting (training_args.yaml) and notes where it changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from trainer.cli import main
from trainer.run import stepping

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("value,during", [("true", (True, True)), ("false", (False, False)), (None, None)])
def test_tf32_sets_the_flags_for_the_run(tmp_path, capsys, monkeypatch, value, during):
    monkeypatch.chdir(ROOT)
    seen = []
    real = stepping.Steps.take

    def take(self, step, saving):
        seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        return real(self, step, saving)

    monkeypatch.setattr(stepping.Steps, "take", take)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    out = tmp_path / "qs"
    args = ["configs/quickstart.yaml", f"output_dir={out}", "max_steps=1", "eval_strategy=no", "plot_loss=false"]
    assert main(args + ([f"tf32={value}"] if value else [])) == 0
    assert seen == [during or before]  # (unset: torch's own)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before  # put back
    assert yaml.safe_load((out / "training_args.yaml").read_text())["tf32"] is {"true": True, "false": False}.get(
        value)
    printed = capsys.readouterr().out
    assert "tf32 has no effect here" not in printed  # (no longer a key accepted without effect)
    noted = "note: tf32: true has no effect here: there is no CUDA" in printed
    assert noted == (value == "true" and not torch.cuda.is_available()), printed
