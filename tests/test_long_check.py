"""tools/long_check.py and tools/gpu_long_check.sh (issue 39): the Qwen3-8B shape with yarn trains LLaMA-Factory's
qwen3_full_sft_256k.yaml one row of cutoff_len tokens a step; here its CPU mode (--tiny), its checks, and the
shape and chat rows tools/make_shape_run.py makes for it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.procs import ROOT, child_env

sys.path.insert(0, str(ROOT / "tools"))
import long_check  # noqa: E402
import make_shape_run  # noqa: E402


def test_the_qwen3_8b_shape_is_qwen3_8b():
    from trainer.model.config import model_config_from_dict

    cfg = model_config_from_dict(make_shape_run.SHAPES["qwen3-8b"])
    assert cfg.family == "qwen3" and cfg.qk_norm and not cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4096, 36, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.sliding_window) == (12288, 151936, None)
    assert round(cfg.num_params() / 1e9, 2) == 8.19  # (Qwen3-8B's 8.2 B)


def test_chat_rows_are_cut_to_exactly_cutoff_len_after_the_template(tmp_path):
    """--format sharegpt: a tokenizer with Qwen's chat tokens (eos <|im_end|>) and rows the qwen template makes
    longer than --seq, so cutoff_len cuts each to exactly --seq tokens."""
    from trainer.data.sft import encode_example
    from trainer.data.templates import eos_id, get_template
    from trainer.data.tokenizer import load_tokenizer

    args = make_shape_run.parse(["--shape", "qwen3-8b", "--dir", str(tmp_path), "--format", "sharegpt", "--seq", "300",
                                 "--accum", "1", "--steps", "2"])
    shape = dict(make_shape_run.shape_of(args), **long_check.TINY)
    make_shape_run.write_run(tmp_path, shape, args)
    tok, template = load_tokenizer(tmp_path / "model"), get_template("qwen")
    assert tok.backend.id_to_token(eos_id(template, tok)) == "<|im_end|>" == tok.backend.id_to_token(tok.eos_id)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["eos_token_id"] == tok.eos_id
    rows = json.loads((tmp_path / "data" / "chat.json").read_text())
    assert len(rows) == 2
    for row in rows:
        messages = [{"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]}
                    for m in row["conversations"]]
        assert len(encode_example(template, tok, messages, "", 10**6)[0]) > 300
        assert len(encode_example(template, tok, messages, "", 300)[0]) == 300


def test_a_step_not_finite_or_not_one_row_fails_loudly():
    ok = {"rope_type": "yarn", "factor": 5.0, "original_max_position_embeddings": 40960}
    exported = {"rope_scaling": ok, "max_position_embeddings": 204800}
    good = [{"current_steps": 1, "loss": 12.0, "grad_norm": 3.0, "total_tokens": 204800},
            {"current_steps": 2, "loss": 11.9, "grad_norm": 2.5, "total_tokens": 409600}]
    assert long_check.problems(0, good, exported, 204800, 2, 40960) == []
    bad = [dict(good[0], loss=math.nan), dict(good[1], grad_norm=math.inf, total_tokens=409599)]
    said = long_check.problems(0, bad, exported, 204800, 2, 40960)
    assert said == ["step 1: loss nan is not finite", "step 2: grad_norm inf is not finite",
                    "step 2 took 204799 tokens, not one row of 204800"], said
    said = long_check.problems(1, good[:1], None, 204800, 2, 40960)
    assert said == ["tiermem-train exited with code 1", "1 step lines in trainer_log.jsonl, not 2"], said
    said = long_check.problems(0, good, dict(exported, rope_scaling=None), 204800, 2, 40960)
    assert len(said) == 1 and said[0].startswith("the exported config.json has RoPE (None, 204800), not"), said


def test_the_tiny_check_trains_the_256k_example_with_yarn(tmp_path, capsys):
    """--tiny: the example YAML as it is, but for the overrides the tool names, at 2,048-token rows over 512
    positions (yarn factor 4): every step one row, the table and OK last."""
    assert long_check.main(["--tiny", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    cmd = next(line for line in out.splitlines() if line.startswith("tiermem-train "))
    keys = [kv.split("=", 1)[0] for kv in cmd.split()[2:]]
    assert cmd.split()[1] == str(ROOT / "configs" / "llamafactory" / "qwen3_full_sft_256k.yaml")
    assert keys == ["model_name_or_path", "tiermem_init", "dataset", "dataset_dir", "output_dir", "max_steps",
                    "logging_steps", "save_strategy", "report_to", "gradient_accumulation_steps", "cutoff_len"], keys
    assert "note: rope_scaling: yarn with factor 4 for cutoff_len 2048" in out
    assert "training data: 2 rows from chat" in out and "example input (2048 tokens)" in out
    lines = out.splitlines()
    top = max(i for i, line in enumerate(lines) if line.startswith("Qwen3-8B shape (2 layers), yarn, one row of "
                                                                 "2,048 tokens a step"))
    assert [line.split()[0] for line in lines[top + 2: top + 4]] == ["1", "2"], lines[top:]
    assert lines[-1].startswith("OK: every step one row"), lines[top:]
    assert not list((tmp_path / "out").glob("checkpoint-*"))


@pytest.mark.slow
def test_the_gpu_script_runs_its_tiny_mode(tmp_path):
    env = dict(child_env(), OUT=str(tmp_path / "out"), DIR=str(tmp_path / "run"))
    run = subprocess.run(["bash", "tools/gpu_long_check.sh", "--tiny"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.splitlines()[-1].startswith("OK: ") and max(map(len, run.stdout.splitlines())) < 400
    assert (tmp_path / "out" / "trainer_log.jsonl").is_file() and not (tmp_path / "run" / "out").exists()
    assert "example input (2048 tokens)" in (tmp_path / "out" / "long_check.txt").read_text()
