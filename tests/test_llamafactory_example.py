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
    has = "the names it has: demo_alpaca, demo_pt, demo_sharegpt"
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
