"""Bad input through ``tiermem-train``, as a hostile user tries it: each gets one line on stderr, exit code
2, and output_dir untouched (or, where a run already saved something, nothing saved is damaged)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from tests.tiny_models import save_tiny_model, write_tokenized_dataset
from trainer.cli import main


@pytest.fixture
def setup(tmp_path):
    model_dir = save_tiny_model("llama", tmp_path / "model")
    data_dir = tmp_path / "data"
    name = write_tokenized_dataset(data_dir)
    cfg = {"model_name_or_path": str(model_dir), "dataset": name, "dataset_dir": str(data_dir),
           "output_dir": str(tmp_path / "out"), "max_steps": 2, "per_device_train_batch_size": 2,
           "logging_steps": 1, "tiermem": {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}}
    return tmp_path, model_dir, cfg


def run(tmp_path, cfg, *overrides, raw: bytes | None = None) -> int:
    path = tmp_path / "train.yaml"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(yaml.safe_dump(cfg))
    return main([str(path), *overrides])


def expect_one_line(capsys, rc, *needles, out: Path | None = None):
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("tiermem-train: error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err
    if out is not None:
        assert not out.exists(), f"output_dir was written: {sorted(p.name for p in out.iterdir())}"


BAD_VALUES = [
    ("num_train_epochs=.nan", "num_train_epochs"),
    (f"seed={2 ** 70}", "seed"),
    ("learning_rate=.nan", "learning_rate"),
    ("learning_rate=.inf", "learning_rate"),
    ("adam_beta1=2.0", "adam_beta1"),
    ("adam_beta2=-0.5", "adam_beta2"),
    ("adam_epsilon=-1", "adam_epsilon"),
    ("adam_epsilon=0", "adam_epsilon"),
    ("adam_epsilon=1e-50", "adam_epsilon"),
    ("learning_rate=1e39", "learning_rate"),
    ("weight_decay=1e39", "weight_decay"),
    ("warmup_steps=-5", "warmup_steps"),
    ("weight_decay=.nan", "weight_decay"),
    ("max_grad_norm=.inf", "max_grad_norm"),
    ("tiermem.tiers.gpu.slots=0", "tiers.gpu.slots"),
    ("tiermem.tiers.gpu.device=tpu:9", "tiers.gpu.device"),
    ("tiermem_keep_activations=-1", "tiermem_keep_activations"),
    ("tiermem_keep_activations=true", "tiermem_keep_activations"),
    ("tiermem_keep_activations=all", "tiermem_keep_activations"),
    ("tiermem_keep_activations=1.5", "tiermem_keep_activations"),
    ("torch_compile=maybe", "torch_compile"),
    ("torch_compile_mode=reduce-overhead", "torch_compile_mode"),
    ("torch_compile_backend=cudagraphs", "torch_compile_backend"),
    ("torch_compile_backend=nonesuch", "torch_compile_backend"),
]


@pytest.mark.parametrize("override,needle", BAD_VALUES)
def test_bad_config_values(setup, capsys, override, needle):
    tmp, _, cfg = setup
    expect_one_line(capsys, run(tmp, cfg, override), needle, out=tmp / "out")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused(setup, capsys):
    tmp, _, cfg = setup
    expect_one_line(capsys, run(tmp, cfg, "tiermem.tiers.gpu.device=cuda"), "tiers.gpu.device", "CUDA",
                    out=tmp / "out")


def test_a_yaml_of_random_bytes(setup, capsys):
    tmp, _, cfg = setup
    raw = bytes(random.Random(0).randrange(256) for _ in range(400))
    expect_one_line(capsys, run(tmp, cfg, raw=raw), "train.yaml", out=tmp / "out")


def _cut(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garble_header(p: Path):
    b = bytearray(p.read_bytes())
    b[8:40] = b"\xff" * 32
    p.write_bytes(bytes(b))


def _huge_header(p: Path):
    b = p.read_bytes()
    p.write_bytes(struct.pack("<Q", 1 << 60) + b[8:])


def _empty(p: Path):
    p.write_bytes(b"")


def _int32(p: Path):
    t = load_file(p)
    k = "model.layers.0.mlp.up_proj.weight"
    t[k] = (t[k] * 100).to(torch.int32)
    save_file(t, p)


@pytest.mark.parametrize("damage", [_cut, _garble_header, _huge_header, _empty, _int32])
def test_bad_weight_files(setup, capsys, damage):
    tmp, model_dir, cfg = setup
    damage(model_dir / "model.safetensors")
    expect_one_line(capsys, run(tmp, cfg), "model.safetensors", out=tmp / "out")


CONFIGS = [
    ("random bytes", None),
    ("a list", [1, 2]),
    ("hidden_size abc", {"hidden_size": "abc"}),
    ("no heads", {"num_attention_heads": 0}),
    ("negative layers", {"num_hidden_layers": -1}),
    ("fractional layers", {"num_hidden_layers": 2.5}),
    ("nan eps", {"rms_norm_eps": math.nan}),
]


@pytest.mark.parametrize("what,change", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_bad_config_json(setup, capsys, what, change):
    tmp, model_dir, cfg = setup
    path = model_dir / "config.json"
    if change is None:
        path.write_bytes(bytes(random.Random(1).randrange(256) for _ in range(300)))
    elif isinstance(change, list):
        path.write_text(json.dumps(change))
    else:
        path.write_text(json.dumps(dict(json.loads(path.read_text()), **change)))
    expect_one_line(capsys, run(tmp, cfg), "config.json", out=tmp / "out")


def test_a_vocabulary_beyond_any_budget_is_refused_before_allocating(setup, capsys):
    tmp, model_dir, cfg = setup
    path = model_dir / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), vocab_size=10**10)))
    cfg = dict(cfg, tiermem_init="random", tiermem={"tiers": {"gpu": {"device": "cpu"}}})
    expect_one_line(capsys, run(tmp, cfg), out=tmp / "out")


def test_a_tokenizer_that_is_not_json(setup, capsys):
    tmp, model_dir, cfg = setup
    (model_dir / "tokenizer.json").write_text("{not json")
    expect_one_line(capsys, run(tmp, cfg), "tokenizer.json", out=tmp / "out")


def test_output_dir_under_a_regular_file(setup, capsys):
    tmp, _, cfg = setup
    (tmp / "afile").write_text("x")
    expect_one_line(capsys, run(tmp, dict(cfg, output_dir=str(tmp / "afile" / "out"))), "afile")


def test_disk_full_during_the_export_leaves_no_temp_files(setup, capsys, monkeypatch):
    import errno

    import trainer.weights_io as weights_io

    tmp, _, cfg = setup

    def full(self, t):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(weights_io._ShardWriter, "write", full)
    expect_one_line(capsys, run(tmp, cfg), "No space left")
    assert not list((tmp / "out").rglob("*.tmp")), sorted(p.name for p in (tmp / "out").rglob("*"))


@pytest.mark.parametrize("damage", ["trainer_state", "rng", "zarr_meta"])
def test_damaged_checkpoint_files_are_refused_before_resuming(setup, capsys, damage):
    tmp, _, cfg = setup
    assert run(tmp, dict(cfg, save_steps=1, max_steps=1)) == 0
    ck = tmp / "out" / "checkpoint-1"
    if damage == "trainer_state":
        (ck / "trainer_state.json").write_text("{garbled")
    elif damage == "rng":
        st = json.loads((ck / "tiermem_state.json").read_text())
        st["rng"] = {"torch": "not a state"}
        (ck / "tiermem_state.json").write_text(json.dumps(st))
    else:
        (ck / "state.zarr" / "master" / "zarr.json").write_text("{garbled")
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    capsys.readouterr()
    expect_one_line(capsys, run(tmp, dict(cfg, save_steps=1, max_steps=2)), "checkpoint-1")
    assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == before


def test_every_flipped_byte_in_a_checkpoint_is_refused_before_training(setup, capsys):
    """16 bytes flipped at a random place of each file of a checkpoint (the state's chunk files and zarr
    metadata, the model's safetensors, config and tokenizer files, trainer_state.json, the manifest): the
    resume stops with one line naming the checkpoint, exit 2, and no step is trained from it."""
    import shutil

    tmp, _, cfg = setup
    assert run(tmp, dict(cfg, save_steps=1, max_steps=1)) == 0
    good = tmp / "good"
    shutil.move(tmp / "out" / "checkpoint-1", good)
    files = sorted(p.relative_to(good) for p in good.rglob("*") if p.is_file())
    assert any(str(f).startswith("state.zarr/master/c") for f in files) and Path("model.safetensors") in files
    rng = random.Random(5)
    for rel in files:
        ck = tmp / "flip"
        shutil.rmtree(ck, ignore_errors=True)
        shutil.copytree(good, ck)
        f = ck / rel
        data = bytearray(f.read_bytes())
        at = rng.randrange(max(len(data) - 16, 1))
        for i in range(at, min(at + 16, len(data))):
            data[i] ^= 0xFF
        f.write_bytes(bytes(data))
        out = tmp / "resumed"
        shutil.rmtree(out, ignore_errors=True)
        capsys.readouterr()
        rc = run(tmp, dict(cfg, resume_from_checkpoint=str(ck), output_dir=str(out), max_steps=2))
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and str(ck) in err, f"{rel} flipped at {at}: rc {rc}: {err}"
        assert not (out / "trainer_log.jsonl").exists(), f"{rel} flipped at {at}: a step was trained"


def test_a_flipped_model_shard_checked_in_the_background_stops_the_resume_before_any_step(setup, capsys,
                                                                                          monkeypatch):
    """Files above ``SMALL`` (a real model's shards) are checked on a thread from the moment the checkpoint is
    picked, while the run tokenizes, opens the store and plans: a flip there still stops the resume with one
    line before a step, and an intact checkpoint resumes through the same path."""
    import shutil

    from trainer import checkpoint as ckpt

    tmp, _, cfg = setup
    assert run(tmp, dict(cfg, save_steps=1, max_steps=1)) == 0
    ck = tmp / "out" / "checkpoint-1"
    monkeypatch.setattr(ckpt, "SMALL", 0)  # every file counts as large here
    started = []  # whether the large files' check was under way when the load began
    real = ckpt.load
    monkeypatch.setattr(ckpt, "load", lambda store, path, *a: started.append(Path(path).resolve() in ckpt._checks)
                        or real(store, path, *a))
    out = tmp / "resumed"
    assert run(tmp, dict(cfg, resume_from_checkpoint=str(ck), output_dir=str(out), max_steps=2)) == 0
    assert started == [True] and not ckpt._checks  # started by the check, taken by the load
    shard = ck / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    shutil.rmtree(out)
    capsys.readouterr()
    rc = run(tmp, dict(cfg, resume_from_checkpoint=str(ck), output_dir=str(out), max_steps=2))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "model.safetensors does not match its checksum" in err, err
    assert not (out / "trainer_log.jsonl").exists()


def _files(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


@pytest.mark.parametrize("where", ["same", "inside", "containing", "symlink", "relative"])
def test_an_output_dir_that_overlaps_the_model_is_refused_before_anything_is_written(setup, capsys, monkeypatch,
                                                                                      where):
    """The export once overwrote the input model and removed its shards: output_dir equal to, inside or containing
    model_name_or_path (symlinks and relative paths resolved) is one line, and the model is untouched."""
    tmp, model_dir, cfg = setup
    before = _files(model_dir)
    if where == "symlink":
        (tmp / "link").symlink_to(model_dir)
    monkeypatch.chdir(tmp)
    out = {"same": str(model_dir), "inside": str(model_dir / "out"), "containing": str(tmp),
           "symlink": str(tmp / "link"), "relative": "model/../model"}[where]
    expect_one_line(capsys, run(tmp, dict(cfg, output_dir=out, overwrite_output_dir=True)), "output_dir",
                    "model")
    assert _files(model_dir) == before and not (model_dir / "out").exists()


def test_an_output_dir_in_the_checkpoint_it_resumes_is_refused(setup, capsys):
    """Resuming checkpoint-1 with output_dir checkpoint-1 would export over the checkpoint's own model files."""
    tmp, _, cfg = setup
    assert run(tmp, dict(cfg, save_steps=1, max_steps=1)) == 0
    ck = tmp / "out" / "checkpoint-1"
    before = _files(ck)
    for out in (ck, ck / "sub"):
        capsys.readouterr()
        expect_one_line(capsys, run(tmp, dict(cfg, resume_from_checkpoint=str(ck), output_dir=str(out),
                                              overwrite_output_dir=True)), "resume_from_checkpoint")
    assert _files(ck) == before


@pytest.mark.parametrize("key", ["output_dir", "model_name_or_path", "dataset_dir", "logging_dir", "tiermem_cache_dir",
                                 "resume_from_checkpoint", "tiermem.tiers.dram.path"])
def test_an_empty_path_is_refused(setup, capsys, monkeypatch, key):
    """output_dir: "" trained into the working directory: every path key refuses an empty value in one line."""
    tmp, _, cfg = setup
    monkeypatch.chdir(tmp)
    expect_one_line(capsys, run(tmp, cfg, f"{key}=''"), key.removeprefix("tiermem."), "empty path", out=tmp / "out")
    assert sorted(p.name for p in tmp.iterdir()) == ["data", "model", "train.yaml"]


def test_a_tilde_in_a_path_is_the_home_directory(setup, monkeypatch):
    """`output_dir: ~/x` became a folder named `~`: every path key expands it, the tiermem config's paths too."""
    from trainer.config import load_train_config

    tmp, model_dir, cfg = setup
    monkeypatch.setenv("HOME", str(tmp))
    (tmp / "shm").mkdir()
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump(dict(cfg, model_name_or_path="~/model", output_dir="~/x", dataset_dir="~/data",
                                        logging_dir="~/logs", tiermem_cache_dir="~/cache",
                                        tiermem={"tiers": {"gpu": {"device": "cpu"},
                                                           "dram": {"path": "~/shm", "budget": "64MiB"},
                                                           "nvme": {"path": "~/nvme", "budget": "64MiB"}},
                                                 "probe": "~/probe.json"})))
    c = load_train_config(path)
    assert (c.model_name_or_path, c.output_dir, c.dataset_dir, c.logging_dir, c.tiermem_cache_dir) == \
        tuple(str(tmp / n) for n in ("model", "x", "data", "logs", "cache"))
    from trainer.state import store_config

    s = store_config(c.tiermem)
    assert (s.tiers.dram.path, s.tiers.nvme.path, s.probe) == (str(tmp / "shm"), str(tmp / "nvme"),
                                                                str(tmp / "probe.json"))


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_run_on_the_same_output_dir_is_refused_and_touches_nothing(setup, capsys):
    """Two trainers on one output_dir: the second's start had deleted the first's in-flight save. The lock of the
    first (held here, as a run in flight holds it) refuses the second in one line naming the first's pid; nothing
    of the first's is read, written or removed."""
    from trainer.output_dir import OutputLock

    tmp, _, cfg = setup
    out = tmp / "out"
    out.mkdir()
    first = OutputLock.take(out, print)
    try:
        (out / "training_args.yaml").write_text("first: run\n")
        saving = out / f".checkpoint-4.tmp-{os.getpid()}"
        saving.mkdir()
        (saving / "model.safetensors").write_bytes(b"half")
        before = _files(out)
        for overrides in ((), ("overwrite_output_dir=true",)):
            capsys.readouterr()
            expect_one_line(capsys, run(tmp, cfg, *overrides), f"output_dir {out} is in use", f"pid {os.getpid()}")
            assert _files(out) == before
    finally:
        first.release(finished=False)


def test_a_dead_runs_lock_is_taken_over_with_a_note_and_a_finished_run_removes_it(setup, capsys):
    tmp, _, cfg = setup
    out = tmp / "out"
    out.mkdir()
    dead = _dead_pid()
    (out / ".tiermem-train.lock").write_text(json.dumps({"tool": "tiermem-train", "pid": dead, "started": 0}))
    (out / "trainer_log.jsonl").write_text('{"current_steps": 1}\n')  # (what it left before its first checkpoint)
    assert run(tmp, cfg) == 0
    said = capsys.readouterr().out
    assert f"locked by tiermem-train pid {dead}, which is gone" in said and "starts from step 0" in said, said
    assert not (out / ".tiermem-train.lock").exists() and (out / "model.safetensors").is_file()
    expect_one_line(capsys, run(tmp, cfg), "is not empty")  # a finished run's model is kept from a new run


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_runs_again_but_a_users_files_are_kept(setup, capsys, monkeypatch):
    """A run stopped (here Ctrl-C) before its first checkpoint left its records and its lock file: the same command
    runs again from step 0 instead of "output_dir ... is not empty". A file of the user's beside them still makes
    a run refuse the directory."""
    from trainer import executor

    tmp, _, cfg = setup
    out = tmp / "out"
    real = executor.Executor.step

    def interrupted(self, batches, step, lr):
        if step == 1:
            raise KeyboardInterrupt
        return real(self, batches, step, lr)

    monkeypatch.setattr(executor.Executor, "step", interrupted)
    assert run(tmp, dict(cfg, save_steps=2)) == 130
    monkeypatch.setattr(executor.Executor, "step", real)
    left = sorted(p.name for p in out.iterdir())
    assert ".tiermem-train.lock" in left and "trainer_log.jsonl" in left and not list(out.glob("checkpoint-*")), left
    (out / "notes.txt").write_text("mine\n")
    capsys.readouterr()
    expect_one_line(capsys, run(tmp, dict(cfg, save_steps=2)), "is not empty")
    assert (out / "notes.txt").read_text() == "mine\n"
    (out / "notes.txt").unlink()
    assert run(tmp, dict(cfg, save_steps=2)) == 0
    assert "starts from step 0" in capsys.readouterr().out
    assert [json.loads(x)["current_steps"] for x in (out / "trainer_log.jsonl").read_text().splitlines()] == [1, 2]


def test_a_format_1_checkpoint_is_refused_unless_trusted(setup, capsys):
    """A manifest downgraded to format 1 (sizes only) beside a flipped byte resumed: format 1 is refused unless
    tiermem_trust_old_checkpoints says to resume from it as it is."""
    tmp, _, cfg = setup
    assert run(tmp, dict(cfg, save_steps=1, max_steps=1)) == 0
    ck = tmp / "out" / "checkpoint-1"
    manifest = json.loads((ck / "checkpoint.json").read_text())
    manifest = dict({k: v for k, v in manifest.items() if k != "crc32c"}, format=1,
                    files={rel: {"size": rec["size"]} for rel, rec in manifest["files"].items()})
    (ck / "checkpoint.json").write_text(json.dumps(manifest))
    shard = ck / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    resumed = dict(cfg, resume_from_checkpoint=str(ck), output_dir=str(tmp / "resumed"))
    expect_one_line(capsys, run(tmp, resumed), "format-1", "tiermem_trust_old_checkpoints", out=tmp / "resumed")
    assert run(tmp, dict(resumed, tiermem_trust_old_checkpoints=True)) == 0
    assert f"resumed from {ck}" in capsys.readouterr().out


@pytest.mark.slow
def test_a_rerun_with_another_config_says_what_changed_and_goes_on(setup, capsys):
    """A rerun with a changed config resumed the old checkpoint silently: one note per key that differs, old and
    new value; the run goes on with the new ones. (Another model or tokenizer is refused: test_checkpoint.py.)"""
    tmp, _, cfg = setup
    assert run(tmp, dict(cfg, save_steps=1, max_steps=1)) == 0
    capsys.readouterr()
    assert run(tmp, dict(cfg, save_steps=1, max_steps=2, learning_rate=1e-3)) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: ")]
    assert said == ["note: learning_rate was 5e-05 in the run that saved checkpoint-1, 0.001 now: this run goes on "
                    "with 0.001",
                    "note: max_steps was 1 in the run that saved checkpoint-1, 2 now: this run goes on with 2"], said
    state = json.loads((tmp / "out" / "checkpoint-2" / "tiermem_state.json").read_text())
    assert state["config"]["learning_rate"] == 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gpu worker, streamed", "gpu worker, in hbm", "cpu worker, saved",
                                  "cpu worker, exported", "cpu worker, next step"])
def test_an_update_that_makes_weights_non_finite_stops_the_run_before_it_is_saved_or_exported(setup, capsys, case):
    """adam_epsilon: 0 had exported NaN weights with exit code 0 (now refused: test_bad_config_values). A learning
    rate of 1e38 the config cannot refuse still overflows the update: the run stops in one line before the step is
    checkpointed or exported. The optimizer's GPU worker checks what it writes; the CPU worker's groups are checked
    where a checkpoint or the export writes them, and by the next step when its loss is not finite."""
    tmp, _, cfg = setup
    out = tmp / "out"
    gpu = case.startswith("gpu")  # (the stand-in's: its tensors on the CPU, checked as a GPU's would be)
    over = {"cpu worker, saved": dict(max_steps=1, save_steps=1), "cpu worker, exported": dict(max_steps=1),
            "cpu worker, next step": dict(max_steps=2, save_steps=2)}.get(case, dict(max_steps=1, save_steps=1))
    needle = {"cpu worker, saved": "checkpoint-1 is not written",
              "cpu worker, exported": "the model is not written"}.get(case, "update 1 made weights of group")
    tiermem = dict(cfg["tiermem"], optimizer={"gpu_share": 1.0 if gpu else 0.0})
    tiermem["placement"] = dict.fromkeys(("param", "grad", "master", "exp_avg", "exp_avg_sq"),
                                         "gpu" if case == "gpu worker, in hbm" else "dram")
    for bf16 in (False, True) if case == "gpu worker, streamed" else (False,):  # (bf16: the compute copy's path)
        shutil.rmtree(out, ignore_errors=True)
        capsys.readouterr()
        expect_one_line(capsys, run(tmp, dict(cfg, learning_rate=1e38, bf16=bf16, tiermem=tiermem, **over)), needle,
                        "inf or NaN")
        assert not (out / "model.safetensors").exists() and not list(out.glob("checkpoint-*")), list(out.iterdir())
