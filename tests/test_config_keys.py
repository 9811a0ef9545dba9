"""Every LLaMA-Factory / Hugging Face key gets one of three answers (taken, no effect with a note, refused
with a reason); every problem of a config is reported in one run, before anything is printed or written;
the commands' --version, --help and --keys."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import yaml

from tests.procs import ROOT, child_env
from trainer.cli import main
from trainer.config import TrainConfig, load_train_config
from trainer.config_keys import KEYS

TAKEN = {f.name for f in dataclasses.fields(TrainConfig)}


def test_every_hugging_face_training_argument_has_an_answer():
    import transformers

    for cls in (transformers.TrainingArguments, transformers.Seq2SeqTrainingArguments):
        unknown = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in TAKEN | set(KEYS)]
        assert not unknown, unknown
    assert not TAKEN & set(KEYS), "a key is either taken or answered, never both"


def _write(tmp_path, **keys):
    """A config over a model directory and a dataset that are there (what the config's check reads of them)."""
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "dataset_info.json").write_text('{"d": {"file_name": "d.json"}}')
    (tmp_path / "data" / "d.json").write_text("[]")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": str(tmp_path / "m"), "dataset": "d",
                                    "dataset_dir": str(tmp_path / "data"), "output_dir": str(tmp_path / "out"),
                                    **keys}))
    return path


def test_keys_of_the_full_sft_examples_each_get_an_answer(tmp_path):
    cfg = load_train_config(_write(tmp_path, trust_remote_code=True, ddp_timeout=180000000, dataloader_num_workers=4,
                                   gradient_checkpointing=True, flash_attn="fa2", attn="sdpa",
                                   enable_liger_kernel=True, save_only_model=False, deepspeed=None, fp16=False,
                                   lora_rank=8, report_to="tensorboard", save_strategy="epoch"))
    notes = "\n".join(cfg.notes)
    for key in ("trust_remote_code", "ddp_timeout", "dataloader_num_workers", "gradient_checkpointing", "flash_attn",
                "attn", "enable_liger_kernel", "lora_rank"):
        assert f"note: {key} has no effect here: " in notes, key
    assert len(cfg.notes) == 8, "deepspeed: null and fp16: false ask for nothing: no note"
    assert "recomputes each layer" in notes and "tiermem_dist_timeout" in notes
    assert cfg.save_only_model is False and cfg.report_to == "tensorboard" and cfg.save_strategy == "epoch"


def test_every_problem_is_reported_in_one_run(tmp_path, capsys):
    path = _write(tmp_path, pure_bf16=True, rope_scaling="ntk", report_to="slack", deepspeed="ds_z3.json",
                  gradient_checkpionting=True, learning_rate="fast", stage="ppo", cutoff_len=0,
                  tiermem={"tiers": {"dram": {"budget": "lots"}}}, trust_remote_code=True)
    assert main([str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "", "nothing is printed before the config is whole"
    lines = err.splitlines()
    assert all(line.startswith("tiermem-train: error: ") for line in lines), err
    for needle in ("pure_bf16: true is refused: pure bf16", "rope_scaling: 'ntk' is not one of linear",
                   "report_to: slack is not supported",
                   "runs offline", "deepspeed: ds_z3.json is refused", "did you mean 'gradient_checkpointing'",
                   "learning_rate: expected a number", "stage: ppo is not supported", "cutoff_len must be positive",
                   "tiers.dram.budget: cannot read 'lots' as a size"):
        assert sum(needle in line for line in lines) == 1, (needle, err)
    assert len(lines) == 9, err
    assert not (tmp_path / "out").exists()


def test_a_dram_budget_beyond_the_machine_is_refused(tmp_path):
    with pytest.raises(Exception, match=r"tiers.dram.budget 1024.0 TiB is larger than this machine's memory"):
        load_train_config(_write(tmp_path, tiermem={"tiers": {"dram": {"budget": "1024TiB"}}}))


def test_train_from_scratch_and_do_eval_are_taken(tmp_path):
    cfg = load_train_config(_write(tmp_path, train_from_scratch=True, val_size=2, eval_strategy="epoch"))
    assert cfg.tiermem_init == "random" and cfg.do_eval is True
    with pytest.raises(Exception, match="do_eval: true needs evaluation data"):
        load_train_config(_write(tmp_path, do_eval=True))


def test_keys_lists_every_answer(capsys):
    assert main(["--keys"]) == 0
    out = capsys.readouterr().out
    assert "  learning_rate: number, default 5e-05" in out and "  model_name_or_path: string, required" in out
    assert "  gradient_checkpointing: no effect: the step always recomputes" in out
    assert "  deepspeed: refused: tiermem replaces DeepSpeed" in out
    lines = out.splitlines()
    for key in (*TAKEN, *KEYS):
        assert sum(line.startswith(f"  {key}: ") for line in lines) == 1, key


@pytest.mark.parametrize("cmd", [["trainer.cli"], ["tiermem.cli"]])
def test_version_and_help(cmd):
    import argparse

    from tiermem.cli.main import build_parser as tiermem_parser
    from trainer.cli import build_parser as train_parser

    run = lambda *a: subprocess.run([sys.executable, "-m", *cmd, *a], capture_output=True, text=True, cwd=ROOT,
                                    env=child_env())
    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip().endswith("0.1.0"), version
    helps = [run("--help").stdout]
    parsers = [train_parser() if cmd == ["trainer.cli"] else tiermem_parser()]
    if cmd == ["tiermem.cli"]:
        helps += [run(sub, "--help").stdout for sub in ("probe", "arenas", "serve", "top", "stats")]
        sub = next(a for a in parsers[0]._actions if isinstance(a, argparse._SubParsersAction))
        parsers += list(sub.choices.values())
    for text in helps:
        assert "``" not in text and "usage:" in text, text
    for parser in parsers:
        for action in parser._actions:
            assert action.help, (parser.prog, action.dest)
    if cmd == ["trainer.cli"]:
        assert "--keys" in helps[0] and "[key=value ...]" in helps[0] and "[config]" in helps[0]
