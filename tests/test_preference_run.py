"""Stage dpo as a run: LLaMA-Factory's DPO example YAML runs as it is (the model and data local), a resume reads
the reference's log-probabilities back from the checkpoint (bit-identical to the straight run), and what is not
supported is refused in one line."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.torch import load_file

from tests.procs import ROOT
from tests.test_preference_parity import write_pairs
from tests.tiny_models import save_tiny_model
from trainer.cli import main


@pytest.mark.slow
def test_llama3_full_dpo_runs_unchanged(tmp_path, monkeypatch, capsys):
    from transformers import TrainerState

    for d in ("data", "models"):
        (tmp_path / d).symlink_to(ROOT / d)
    monkeypatch.chdir(tmp_path)
    assert main([str(ROOT / "configs" / "quickstart.yaml"), "max_steps=1", "eval_strategy=no", "plot_loss=false"]) == 0
    capsys.readouterr()
    assert main([str(ROOT / "configs" / "llamafactory" / "llama3_full_dpo.yaml")]) == 0  # no overrides
    printed = capsys.readouterr().out
    assert "stage dpo: DPO (sigmoid), pref_beta 0.1; reference: the starting model" in printed, printed
    for key in ("trust_remote_code", "ddp_timeout"):
        assert f"note: {key} has no effect here" in printed, printed
    out = tmp_path / "saves" / "llama3-8b" / "full" / "dpo"
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    # 16 pairs, 1 x 8 pairs a step: 2 steps an epoch, 3 epochs; a line at the end
    assert [r["current_steps"] for r in log] == [6] and log[-1]["epoch"] == 3.0
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"} <= set(log[-1])
    state = TrainerState.load_from_json(str(out / "trainer_state.json"))
    assert state.global_step == 6 and "rewards/margins" in state.log_history[0]
    for f in ("model.safetensors", "tokenizer.json", "training_loss.png", "training_args.yaml"):
        assert (out / f).is_file(), f


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A tiny Llama and 12 tokenized pairs, made once for the module."""
    d = tmp_path_factory.mktemp("shared")
    save_tiny_model("llama", d / "model")
    write_pairs(d / "data", n_pairs=12)
    return d


def _config(tmp_path, shared, name: str, **over) -> str:
    cfg = dict(model_name_or_path=str(shared / "model"), stage="dpo", dataset="pairs", dataset_dir=str(shared / "data"),
               output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
               max_steps=6, learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1,
               pref_beta=0.5, tiermem={"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}, **over)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
def test_resume_reads_the_reference_back(tmp_path, shared):
    """A run resumed from checkpoint-3 takes the reference's figures from it (computed from the weights the run
    started with, not from checkpoint-3's): its weights and figures are the straight run's, bit for bit."""
    assert main([_config(tmp_path, shared, "straight")]) == 0
    assert main([_config(tmp_path, shared, "saved", save_steps=3)]) == 0
    ckpt = tmp_path / "saved" / "checkpoint-3"
    ref = json.loads((ckpt / "tiermem_reference.json").read_text())
    assert len(ref["sums"]) == 24 and ref["source"] == "the starting model"
    assert main([_config(tmp_path, shared, "resumed", resume_from_checkpoint=str(ckpt))]) == 0
    straight, resumed = (load_file(tmp_path / d / "model.safetensors") for d in ("straight", "resumed"))
    for n in straight:
        assert (resumed[n] == straight[n]).all(), n
    logs = [[json.loads(line) for line in (tmp_path / d / "trainer_log.jsonl").read_text().splitlines()]
            for d in ("straight", "resumed")]
    assert [r["rewards/margins"] for r in logs[1]][-3:] == [r["rewards/margins"] for r in logs[0]][-3:]


@pytest.mark.parametrize("over,words", [
    ({"pref_bco_weight": 0.5}, "pref_bco_weight: BCO's running reward baseline is not supported yet"),
    ({"pref_loss": "kto_pair"}, "pref_loss: kto_pair is not supported"),
    ({"ld_alpha": 0.5}, "ld_alpha: 0.5 is refused"),
    ({"val_size": 2}, "stage dpo: evaluation is not supported yet"),
    ({"tiermem_physical_batch_size": 3}, "tiermem_physical_batch_size must be even in stage dpo"),
    ({"dpo_label_smoothing": 0.1, "pref_loss": "ipo"}, "dpo_label_smoothing applies to pref_loss: sigmoid only"),
    ({"ref_model": "OTHER"}, "its weights' names and shapes differ from the model's"),
])
def test_what_is_not_supported_is_refused_in_one_line(tmp_path, shared, capsys, over, words):
    if over.get("ref_model") == "OTHER":  # (a model of another shape)
        over = {"ref_model": str(save_tiny_model("qwen3", tmp_path / "other"))}
    cfg = _config(tmp_path, shared, "out", **over)
    capsys.readouterr()
    assert main([cfg]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
