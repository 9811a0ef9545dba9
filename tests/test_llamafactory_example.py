"""LLaMA-Factory's own examples/train_full/llama3_full_sft.yaml, qwen3_full_sft.yaml and qwen3_full_sft_256k.yaml
(configs/llamafactory/: the model pointed at the quickstart's, the bundled datasets, the deepspeed line removed)
run as they are, from a directory laid out as LLaMA-Factory's (data/, saves/), and leave what LLaMA-Factory
leaves."""

from __future__ import annotations

import json

import pytest

from tests.procs import ROOT
from trainer.cli import main
from trainer.config import load_train_config

LF = ROOT / "configs" / "llamafactory"
# the keys of the Qwen3 examples that change nothing here, each noted
QWEN3_NOTED = ("trust_remote_code", "enable_liger_kernel", "dataloader_num_workers", "gradient_checkpointing",
               "ddp_timeout", "report_to: wandb")
SEQUENCE_PARALLEL = ("sequence_parallel_size", "sequence_parallel_mode")


def _laid_out(tmp_path, monkeypatch):
    """``tmp_path`` as LLaMA-Factory's working directory (data/, models/), the current one."""
    for d in ("data", "models"):
        (tmp_path / d).symlink_to(ROOT / d)
    monkeypatch.chdir(tmp_path)


@pytest.mark.slow
def test_llama3_full_sft_runs_unchanged(tmp_path, monkeypatch, capsys):
    from transformers import TrainerState

    _laid_out(tmp_path, monkeypatch)
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


@pytest.mark.parametrize("name, attn", [("qwen3_full_sft", "attn"), ("qwen3_full_sft_256k", "flash_attn")])
def test_the_qwen3_long_context_examples_are_taken_with_notes(tmp_path, monkeypatch, name, attn):
    """Every key of LLaMA-Factory's Qwen3 long-context examples is taken or noted (none refused): report_to:
    wandb sends nothing, sequence parallelism is noted (one GPU holds the whole row), rope_scaling is taken."""
    _laid_out(tmp_path, monkeypatch)
    (tmp_path / "saves" / "quickstart").mkdir(parents=True)  # (the quickstart's model, as the config's check sees it)
    (tmp_path / "saves" / "quickstart" / "config.json").write_text("{}")
    cfg = load_train_config(LF / f"{name}.yaml")
    notes = "\n".join(cfg.notes)
    for key in (*QWEN3_NOTED, attn):
        assert f"note: {key} has no effect here: " in notes, (key, notes)
    many = name.endswith("256k")
    for key in SEQUENCE_PARALLEL:
        assert (f"note: {key} has no effect here: one GPU holds the whole row" in notes) == many, notes
    assert len(cfg.notes) == len(QWEN3_NOTED) + 1 + 2 * many, notes
    assert cfg.rope_scaling == "yarn" and cfg.report_to == "none" and cfg.template == "qwen"
    assert cfg.cutoff_len == (204800 if many else 131072)


@pytest.mark.slow
def test_the_qwen3_long_context_examples_run_unchanged(tmp_path, monkeypatch, capsys):
    """Both Qwen3 examples train as they are (rows as long as the demo data's, cutoff_len as written) and export
    config.json with RoPE scaled by yarn as LLaMA-Factory scales it."""
    _laid_out(tmp_path, monkeypatch)
    assert main([str(ROOT / "configs" / "quickstart.yaml"), "max_steps=1", "eval_strategy=no", "plot_loss=false"]) == 0
    capsys.readouterr()
    for name, out, cutoff, steps in (("qwen3_full_sft", "qwen3_8b_tbench_traces_sharegptv1_yarn_ds", 131072, 30),
                                     ("qwen3_full_sft_256k", "qwen3_8b_tbench_traces_200k_ulysses_ds", 204800, 9)):
        assert main([str(LF / f"{name}.yaml")]) == 0  # no overrides
        printed = capsys.readouterr().out
        assert f"note: rope_scaling: yarn with factor {cutoff // 256} for cutoff_len {cutoff}" in printed, printed
        out = tmp_path / "output" / out
        log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
        assert log[-1]["current_steps"] == steps, log  # 12 rows, 1 x 2 (1 x 4) rows a step, 5 (3) epochs
        exported = json.loads((out / "config.json").read_text())
        assert exported["max_position_embeddings"] == cutoff
        assert exported["rope_scaling"] == {"rope_type": "yarn", "factor": cutoff / 256,
                                            "original_max_position_embeddings": 256}
        assert not list(out.glob("checkpoint-*")), "save_steps 50 > the steps"


# LLaMA-Factory's examples/train_full/llama3_full_sft.yaml as it ships: a model from the hub, its own datasets and
# a DeepSpeed config (of those, only the names are here: what a user copying it meets first)
STOCK = """\
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true
stage: sft
do_train: true
finetuning_type: full
deepspeed: examples/deepspeed/ds_z3_config.json
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4
output_dir: saves/llama3-8b/full/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none
per_device_train_batch_size: 1
gradient_accumulation_steps: 2
learning_rate: 1.0e-5
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
"""


def test_the_stock_yaml_gets_every_problem_in_one_run(tmp_path, monkeypatch, capsys):
    """Every problem of LLaMA-Factory's stock YAML in the first run, one line each: the DeepSpeed line, the model
    that is not a local directory, and each dataset dataset_info.json lacks, with the names it has."""
    (tmp_path / "data").symlink_to(ROOT / "data")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama3_full_sft.yaml").write_text(STOCK)
    assert main(["llama3_full_sft.yaml"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert all(line.startswith("tiermem-train: error: ") for line in err), err
    has = "the names it has: demo_alpaca, demo_dpo_alpaca, demo_pt, demo_sharegpt, dpo_en_demo"
    assert f"tiermem-train: error: dataset 'identity' is not in data/dataset_info.json; {has}" in err, err
    assert f"tiermem-train: error: dataset 'alpaca_en_demo' is not in data/dataset_info.json; {has}" in err, err
    assert any("deepspeed" in line for line in err) and any("model_name_or_path" in line for line in err), err
    assert len(err) == 4, err
    assert not (tmp_path / "saves").exists()


def test_an_unknown_dataset_among_many_names_the_closest_first(tmp_path, monkeypatch, capsys):
    info = {f"set_{i:02d}": {"file_name": "demo_alpaca.json"} for i in range(30)}
    info["alpaca_en"] = {"file_name": "demo_alpaca.json"}
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps(info))
    (data / "demo_alpaca.json").symlink_to(ROOT / "data" / "demo_alpaca.json")
    monkeypatch.chdir(ROOT)
    assert main(["configs/quickstart.yaml", f"dataset_dir={data}", "dataset=alpaca_en_demo,set_7,set_01",
                 f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith(f"tiermem-train: error: dataset 'alpaca_en_demo' is not in {data}/dataset_info.json; "
                             "it has 31 names, the closest: alpaca_en, "), err
    assert err[0].endswith(" and 19 more"), err
    assert err[1].startswith("tiermem-train: error: dataset 'set_7' is not in"), err
