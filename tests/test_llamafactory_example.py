"""LLaMA-Factory's own examples/train_full/llama3_full_sft.yaml (configs/llamafactory/: the model pointed at
the quickstart's, the bundled datasets, the deepspeed line removed) runs as it is, from a directory laid
out as LLaMA-Factory's (data/, saves/), and leaves what LLaMA-Factory leaves."""

from __future__ import annotations

import json

import pytest

from tests.procs import ROOT
from trainer.cli import main


@pytest.mark.slow
def test_llama3_full_sft_runs_unchanged(tmp_path, monkeypatch, capsys):
    from transformers import TrainerState

    for d in ("data", "models"):
        (tmp_path / d).symlink_to(ROOT / d)
    monkeypatch.chdir(tmp_path)
    assert main([str(ROOT / "configs" / "quickstart.yaml"), "max_steps=1", "eval_strategy=no", "plot_loss=false"]) == 0
    capsys.readouterr()
    assert main([str(ROOT / "configs" / "llamafactory" / "llama3_full_sft.yaml")]) == 0  # no overrides
    printed = capsys.readouterr().out
    for key in ("trust_remote_code", "dataloader_num_workers", "ddp_timeout"):
        assert f"note: {key} has no effect here" in printed, printed
    out = tmp_path / "saves" / "llama3-8b" / "full" / "sft"
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    # 32 rows, 1 x 2 rows a step: 16 steps an epoch, 3 epochs; a line every 10 steps and at the end
    assert [r["current_steps"] for r in log] == [10, 20, 30, 40, 48] and log[-1]["epoch"] == 3.0
    state = TrainerState.load_from_json(str(out / "trainer_state.json"))
    assert state.global_step == 48 and state.log_history[-1]["train_loss"] > 0
    results = json.loads((out / "all_results.json").read_text())
    assert results == json.loads((out / "train_results.json").read_text()) and results["epoch"] == 3.0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for f in ("model.safetensors", "tokenizer.json", "training_loss.png", "training_args.yaml"):
        assert (out / f).is_file(), f
    assert not list(out.glob("checkpoint-*")), "save_steps 500 > 48 steps"
