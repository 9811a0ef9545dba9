"""The trainer through its command line: the quickstart end to end, and bad input (one line on stderr,
exit code 2, nothing written to output_dir)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.tiny_models import save_tiny_model, write_tokenized_dataset
from trainer.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_trains_and_saves(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "qs"
    assert main(["configs/quickstart.yaml", f"output_dir={out}", "max_steps=40", "logging_steps=5"]) == 0
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["current_steps"] for r in log if "loss" in r] == list(range(5, 41, 5))
    assert [r["current_steps"] for r in log if "eval_loss" in r] == [40]  # do_eval: the final evaluation
    train = [r for r in log if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, "the loss should fall"
    assert all(r["gc_seconds"] >= 0 for r in train)  # the garbage collector's pauses, a step
    assert gc.get_freeze_count() == 0  # (what the run froze after its first step went back to the collector)
    for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "training_args.yaml",
              "training_loss.png", "train_results.json", "eval_results.json", "all_results.json",
              "trainer_state.json"):
        assert (out / f).is_file(), f
    args = yaml.safe_load((out / "training_args.yaml").read_text())
    assert args["max_steps"] == 40 and args["tiermem"]["tiers"]["dram"]["path"] == "anonymous"
    printed = capsys.readouterr().out
    assert "step 40/40 | loss" in printed and "tok/s" in printed and "wait transfer" in printed
    assert printed.startswith("training data: ") and "\n\n\n" not in printed  # (no progress bars' empty lines)
    # the run's plan, as `tiermem plan --json` gives it: planned again from the step it measured, the same
    ran = json.loads((out / "tiermem_plan.json").read_text())
    assert ran["run"]["compute_factor"] > 0 and ran["run"]["predicted_step_seconds"] > 0  # (what the run measured)
    from trainer.plan_cli import main as plan_main

    assert plan_main(["configs/quickstart.yaml", f"output_dir={out}", "--json", "--workload",
                      str(out / "tiermem_plan.json")]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["workload"] == ran["workload"]
    assert {t: (v["kinds"], v["need"]) for t, v in again["tiers"].items()} == \
        {t: (v["kinds"], v["need"]) for t, v in ran["tiers"].items()}
    assert again["prediction"] == ran["prediction"] and again["machine"]["h2d"] == ran["machine"]["h2d"]
    assert ran["advice"] is None and "plan: advice" not in printed  # (the tiny model's step is compute-bound)


def test_a_run_prints_the_advice_its_plan_gives(tmp_path, capsys, monkeypatch):
    """What `tiermem plan` would advise (more tokens a step, more DRAM, a faster disk) is told at the run's start
    too, as written in its tiermem_plan.json."""
    from trainer.planning import run_plan

    real = run_plan.report

    def report(plan, ga):
        return dict(real(plan, ga), advice="raise gradient_accumulation_steps to 9: 1 tokens/s (+50%)")

    monkeypatch.setattr(run_plan, "report", report)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "qs"
    assert main(["configs/quickstart.yaml", f"output_dir={out}", "max_steps=2", "do_eval=false"]) == 0
    assert "plan: advice: raise gradient_accumulation_steps to 9: 1 tokens/s (+50%)" in capsys.readouterr().out
    assert json.loads((out / "tiermem_plan.json").read_text())["advice"].startswith("raise gradient_accumulation")


@pytest.mark.slow
def test_console_script_reports_a_user_error_in_one_line(tmp_path):
    exe = shutil.which("tiermem-train", path=os.path.dirname(sys.executable)) or shutil.which("tiermem-train")
    cmd = [exe] if exe else [sys.executable, "-m", "trainer.cli"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: /nonexistent\ndataset: demo_alpaca\noutput_dir: " + str(tmp_path / "o") + "\n")
    r = subprocess.run(cmd + [str(cfg)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tiermem-train: error: ") and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.fixture
def good(tmp_path):
    """A valid config (tiny Llama, tokenized data) as a dict, and a writer that runs it."""
    model_dir = save_tiny_model("llama", tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    cfg = {"model_name_or_path": str(model_dir), "dataset": name, "dataset_dir": str(data_dir),
           "output_dir": str(tmp_path / "out"), "max_steps": 2, "per_device_train_batch_size": 2,
           "tiermem": {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}}

    def run(cfg, *overrides, raw: str | None = None):
        path = tmp_path / "train.yaml"
        path.write_text(raw if raw is not None else yaml.safe_dump(cfg))
        return main([str(path), *overrides])

    return cfg, run, tmp_path


def _expect_error(capsys, tmp_path, rc, *needles):
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("tiermem-train: error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err
    assert not (tmp_path / "out").exists(), "nothing may be written to output_dir"


def test_missing_model_directory(good, capsys):
    cfg, run, tmp = good
    _expect_error(capsys, tmp, run(dict(cfg, model_name_or_path=str(tmp / "nope"))), "is not a directory")


@pytest.mark.parametrize("arch,why", [("T5ForConditionalGeneration", "not one of transformers' causal language models"),
                                      ("NoSuchForCausalLM", "has no class NoSuchForCausalLM")])
def test_unsupported_architecture_says_what_is_missing(good, capsys, arch, why):
    """An architecture neither the template nor the generic path takes: one line naming what is missing and
    listing the template's own."""
    cfg, run, tmp = good
    conf = Path(cfg["model_name_or_path"]) / "config.json"
    raw = json.loads(conf.read_text())
    conf.write_text(json.dumps(dict(raw, architectures=[arch])))
    _expect_error(capsys, tmp, run(cfg), f"{arch} is not supported", why, "LlamaForCausalLM", "MixtralForCausalLM")


def test_a_generic_model_with_dropout_is_refused(good, capsys):
    cfg, run, tmp = good
    conf = Path(cfg["model_name_or_path"]) / "config.json"
    raw = {k: v for k, v in json.loads(conf.read_text()).items() if not k.startswith("rope")}
    conf.write_text(json.dumps(dict(raw, architectures=["Phi3ForCausalLM"], model_type="phi3", resid_pdrop=0.1)))
    _expect_error(capsys, tmp, run(cfg), "resid_pdrop 0.1 is not supported", "set it to 0")


def test_a_model_whose_layers_are_not_one_list_is_refused(good, capsys):
    """The generic path streams one list of decoder layers: XLM keeps its layers' parts in four parallel lists
    (attentions, norms, feed-forwards, norms), and tiermem-train refuses it in one line naming why."""
    cfg, run, tmp = good
    conf = Path(cfg["model_name_or_path"]) / "config.json"
    conf.write_text(json.dumps({"architectures": ["XLMWithLMHeadModel"], "model_type": "xlm", "n_layers": 2,
                                "emb_dim": 32, "n_heads": 4, "vocab_size": 96, "dropout": 0.0,
                                "attention_dropout": 0.0, "causal": True}))
    _expect_error(capsys, tmp, run(cfg), "XLMWithLMHeadModel is not supported",
                  "its decoder layers do not form one list of num_hidden_layers=2 modules")


def test_malformed_yaml(good, capsys):
    cfg, run, tmp = good
    _expect_error(capsys, tmp, run(cfg, raw="model_name_or_path: [unclosed\n"), "not valid YAML")


def test_bad_override(good, capsys):
    cfg, run, tmp = good
    _expect_error(capsys, tmp, run(cfg, "learning_rate"), "bad override", "key=value")
    _expect_error(capsys, tmp, run(cfg, "learning_rate=fast"), "learning_rate", "expected a number")


def test_unknown_key_names_the_nearest(good, capsys):
    cfg, run, tmp = good
    _expect_error(capsys, tmp, run(dict(cfg, lerning_rate=1e-4)), "lerning_rate", "did you mean 'learning_rate'")


def test_lora_is_refused(good, capsys):
    cfg, run, tmp = good
    _expect_error(capsys, tmp, run(dict(cfg, finetuning_type="lora")), "finetuning_type: lora is not supported")


def test_row_without_input_ids(good, capsys):
    cfg, run, tmp = good
    data = Path(cfg["dataset_dir"]) / f"{cfg['dataset']}.jsonl"
    data.write_text(data.read_text() + json.dumps({"labels": [1, 2]}) + "\n")
    _expect_error(capsys, tmp, run(cfg), f"{data}: row 15", "input_ids")


def test_placement_over_budget(good, capsys):
    cfg, run, tmp = good
    cfg = dict(cfg, tiermem={"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "100KiB"}},
                             "placement": {k: "dram" for k in ("param", "grad", "exp_avg", "exp_avg_sq")}})
    rc = run(cfg)
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "placement does not fit" in err and "raise tiers.dram.budget" in err
    assert out == "", "the placement is checked before any data is read or anything printed"
    assert not (tmp / "out").exists()


def test_not_yet_supported_keys_say_so(good, capsys):
    cfg, run, tmp = good
    _expect_error(capsys, tmp, run(dict(cfg, fp16=True)), "fp16", "not supported")
    # (a tiermem key beside tiermem_server, as in the quickstart attached to a service: one note, then the attach)
    rc = run(dict(cfg, tiermem_server=str(tmp / "none.sock")))
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "no tiermem service at" in err, err
    assert out.count("note: tiermem has no effect with tiermem_server: the service's store config") == 1, out
    _expect_error(capsys, tmp, run(dict(cfg, tiermem=None, tiermem_server=str(tmp / "none.sock"))),
                  "no tiermem service at", "tiermem serve")
    _expect_error(capsys, tmp, run(dict(cfg, deepspeed="ds.json")), "deepspeed")


def test_existing_output_dir_is_not_overwritten_unless_asked(good, capsys):
    cfg, run, tmp = good
    out = tmp / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert run(cfg) == 2
    assert "overwrite_output_dir" in capsys.readouterr().err
    assert run(dict(cfg, overwrite_output_dir=True)) == 0
    assert (out / "keep.txt").read_text() == "mine" and (out / "model.safetensors").is_file()


def test_eval_strategy_no_as_yaml_writes_it(good, capsys):
    """`eval_strategy: no` in a file and `eval_strategy=no` as an override: YAML reads both as false."""
    cfg, run, tmp = good
    assert run(cfg, raw=yaml.safe_dump(cfg) + "eval_strategy: no\n") == 0
    assert run(dict(cfg, overwrite_output_dir=True), "eval_strategy=no") == 0
    assert yaml.safe_load((tmp / "out" / "training_args.yaml").read_text())["eval_strategy"] == "no"


def test_a_non_finite_step_is_not_applied(good, capsys):
    """An absurd learning rate sends step 2's loss to inf/nan: the run stops there with one line and exit 2
    before the optimizer takes the step; the last checkpoint holds step 1's weights (those a 1-step run
    ends with: its save finishes although the run stops) and nothing of step 2 is saved."""
    from safetensors.torch import load_file

    cfg, run, tmp = good
    cfg = dict(cfg, learning_rate=1e35, lr_scheduler_type="constant", max_steps=4, save_steps=1, logging_steps=1)
    rc = run(cfg)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("tiermem-train: error: step 2: gradient norm is ") and err.count("\n") == 2, err
    assert "the step was not applied" in err and "lower learning_rate" in err
    out = tmp / "out"  # (the second line: where the run got to and the command that continues)
    stop = err.splitlines()[1]
    assert stop.startswith(f"tiermem-train: stopped at step 1 of 4; newest checkpoint {out}/checkpoint-1"), stop
    assert (out / "checkpoint-1").is_dir() and not (out / "checkpoint-2").exists()
    assert not (out / "model.safetensors").exists()
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["current_steps"] for r in log] == [1]
    assert run(dict(cfg, max_steps=1, save_steps=None, output_dir=str(tmp / "one"))) == 0
    want = load_file(tmp / "one" / "model.safetensors")
    got = load_file(out / "checkpoint-1" / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
