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


def expect_one_line(capsys, rc, *needles, out: Path | None = None, after_steps: bool = False):
    """One line of error, exit code 2 (``after_steps``: the run had begun its steps, and a second line says where
    it stopped and the command that continues)."""
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("tiermem-train: error: ") and err.count("\n") == 1 + after_steps, err
    if after_steps:
        assert err.splitlines()[1].startswith("tiermem-train: stopped at step "), err
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

    import trainer.outputs.weights_io as weights_io

    tmp, _, cfg = setup

    def full(self, t):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(weights_io._ShardWriter, "write", full)
    expect_one_line(capsys, run(tmp, cfg), "No space left", after_steps=True)
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

    from trainer.outputs import checkpoint as ckpt

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
    from trainer.outputs.output_dir import OutputLock

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
    from trainer.run import executor

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
                        "inf or NaN", after_steps=True)
        assert not (out / "model.safetensors").exists() and not list(out.glob("checkpoint-*")), list(out.iterdir())

# -- config files: the one YAML loader (tiermem.yamlfile) --------------------------------------------------------

@pytest.fixture
def bare(tmp_path):
    """A config whose problems are found before any model or data is read (what the config's check reads is all
    there is: the model's config.json, the dataset's entry and its file)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text('{"toy": {"file_name": "toy.json"}}')
    (tmp_path / "data" / "toy.json").write_text("[]")
    cfg = {"model_name_or_path": str(tmp_path / "model"), "dataset": "toy", "dataset_dir": str(tmp_path / "data"),
           "output_dir": str(tmp_path / "out"), "max_steps": 2,
           "tiermem": {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}}
    return tmp_path, cfg


LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


def test_a_billion_laughs_is_refused_as_it_is_read(bare, capsys):
    """Nine aliases of nine: a billion strings once expanded (what writes or prints the config walks them all)."""
    tmp, cfg = bare
    raw = (yaml.safe_dump(cfg) + LAUGHS.replace("a: &a", "lora_a: &a")).encode()
    expect_one_line(capsys, run(tmp, cfg, raw=raw), "train.yaml", "aliases expanded", out=tmp / "out")


def test_a_billion_laughs_in_an_override_and_a_recursive_alias(bare, capsys):
    tmp, cfg = bare
    expect_one_line(capsys, run(tmp, cfg, "template=" + _nested_bomb()), "bad override 'template=[&l0",
                    "aliases expanded", out=tmp / "out")
    expect_one_line(capsys, run(tmp, cfg, "template=&r [*r]"), "recursive", out=tmp / "out")
    expect_one_line(capsys, run(tmp, cfg, "template=" + "[" * 200 + "]" * 200), "nested more than", out=tmp / "out")


def _nested_bomb() -> str:
    """A flow-style billion laughs: each level a list of nine aliases of the one before."""
    text = "[&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"
    for i in range(1, 10):
        text += f", &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]"
    return text + "]"


def test_a_key_given_twice_is_refused_naming_both_lines(bare, capsys):
    tmp, cfg = bare
    raw = (yaml.safe_dump(cfg) + "learning_rate: 1e-5\nseed: 1\nlearning_rate: 2e-5\n").encode()
    text = raw.decode().splitlines()
    first, second = [i + 1 for i, line in enumerate(text) if line.startswith("learning_rate")]
    expect_one_line(capsys, run(tmp, cfg, raw=raw), "'learning_rate' is given twice", f"lines {first} and {second}",
                    out=tmp / "out")


def test_a_key_given_twice_in_a_tiermem_config_file(bare, capsys):
    tmp, cfg = bare
    (tmp / "store.yaml").write_text("tiers:\n  dram: {budget: 64MiB}\n  dram: {budget: 1GiB}\n")
    expect_one_line(capsys, run(tmp, dict(cfg, tiermem=str(tmp / "store.yaml"))), "store.yaml", "'dram' is given twice",
                    out=tmp / "out")


def test_a_merge_key_overridden_is_no_duplicate(bare):
    from trainer.config import load_train_config

    tmp, cfg = bare
    raw = yaml.safe_dump({k: v for k, v in cfg.items() if k != "tiermem"}) + (
        "tiermem:\n  tiers:\n    dram: {budget: 64MiB}\n"
        "    gpu:\n      <<: {device: cuda, slots: 2}\n      device: cpu\n")
    (tmp / "train.yaml").write_text(raw)
    cfg = load_train_config(tmp / "train.yaml")
    assert cfg.tiermem["tiers"]["gpu"] == {"device": "cpu", "slots": 2}


def test_a_fifo_as_the_config_file_is_refused_without_waiting(bare, capsys):
    tmp, _ = bare
    os.mkfifo(tmp / "train.yaml")
    expect_one_line(capsys, main([str(tmp / "train.yaml")]), "train.yaml", "not a regular file")
    expect_one_line(capsys, main(["/dev/zero"]), "/dev/zero", "not a regular file")


# -- the generator: every key of the config table with hostile values ---------------------------------------------

HOSTILE = ["null", "true", "''", "abc", '"a\\0b"', "../x", "[]", "[dram]", "{}", "{a: 1}", "0", "-1", "-1.5", "0.5",
           "1.0e+30", str(2 ** 64), "1.0e+308", ".nan", ".inf", "-.inf"]


def _key_table() -> list[str]:
    """Every key tiermem-train takes: TrainConfig's fields, and the store config's as ``tiermem.`` overrides (the
    mappings on the way to them too)."""
    import dataclasses
    import typing

    from tiermem.config import StoreConfig
    from trainer.config import TrainConfig

    keys = [f.name for f in dataclasses.fields(TrainConfig)]

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            keys.append(f"{prefix}.{f.name}")
            inner = [t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if dataclasses.is_dataclass(t)]
            for t in inner:
                walk(t, f"{prefix}.{f.name}")

    walk(StoreConfig, "tiermem")
    return keys


def _plan_the_steps(c) -> None:
    """What a run computes of its steps from the config before its first one (over 14 rows): the steps, the
    warmup, the first and last learning rates, the first step's rows, the ETA's text."""
    from tiermem.sizes import format_duration
    from trainer.data.batches import StepPlan
    from trainer.run.schedule import lr_factor, warmup_steps

    plan = StepPlan(14, c.per_device_train_batch_size, c.gradient_accumulation_steps, c.seed)
    total = plan.total_steps(c.num_train_epochs, c.max_steps)
    warmup = warmup_steps(total, c.warmup_steps, c.warmup_ratio)
    for step in (0, total - 1):
        c.learning_rate * lr_factor(c.lr_scheduler_type, step, total, warmup)
    plan.rows_of_step(0)
    format_duration(total * 1.5)


def test_every_config_key_answers_hostile_values_in_one_line(bare, monkeypatch):
    """Each key of the table with each of HOSTILE (wrong types, NaN and infinities, negatives, huge values, empty
    strings, NUL, a path out of its directory): the config layer refuses it in one line, or takes it and then the
    placement check (the last check before any data is read) passes or refuses it in one line, and the steps are
    planned from it (the schedule a run computes before its first step): never another exception, never a hang
    (an alarm is the safety net)."""
    import copy
    import signal
    import traceback

    import trainer.config as train_config
    from tiermem.errors import UserError
    from trainer.model.config import model_config_from_dict
    from trainer.planning.placing import check_placement

    tmp, cfg = bare
    (tmp / "train.yaml").write_text(yaml.safe_dump(cfg))
    base = train_config.read_yaml(tmp / "train.yaml")
    monkeypatch.setattr(train_config, "read_yaml", lambda path, what="": copy.deepcopy(base))  # (read once)
    mcfg = model_config_from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
                                   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4})

    class Hang(Exception):
        pass

    def alarm(*_):
        raise Hang

    old = signal.signal(signal.SIGALRM, alarm)
    failures, answered = [], 0
    try:
        for key in _key_table():
            for text in HOSTILE:
                signal.alarm(20)  # (a safety net far above a case's milliseconds)
                try:
                    c = train_config.load_train_config(tmp / "train.yaml", [f"{key}={text}"])
                    if not c.tiermem_server:
                        check_placement(c, mcfg, torch.bfloat16 if c.bf16 else torch.float32)
                    _plan_the_steps(c)
                except UserError as e:
                    lines = getattr(e, "problems", None) or [str(e)]
                    if not all(line.strip() and "\n" not in line for line in lines):
                        failures.append(f"{key}={text}: not one line each: {lines!r}")
                except Hang:
                    failures.append(f"{key}={text}: still running after 20 s")
                except Exception as e:  # noqa: BLE001 - what the test looks for
                    where = traceback.extract_tb(e.__traceback__)[-1]
                    failures.append(f"{key}={text}: {type(e).__name__}: {str(e)[:100]} ({where.filename}:"
                                    f"{where.lineno})")
                finally:
                    signal.alarm(0)
                answered += 1
    finally:
        signal.signal(signal.SIGALRM, old)
    assert answered > 1000
    assert not failures, f"{len(failures)} of {answered}:\n" + "\n".join(failures)


STORE_VALUES = [
    ("tiermem.tiers.dram.budget=.inf", "tiers.dram.budget"),
    ("tiermem.tiers.dram.budget=.nan", "tiers.dram.budget"),
    ("tiermem.tiers.gpu.budget=-.inf", "tiers.gpu.budget"),
    ("tiermem.tiers=5", "tiers: expected a mapping"),
    ("tiermem.tiers=[dram]", "tiers: expected a mapping"),
    ("tiermem.tiers.dram=[64MiB]", "tiers.dram: expected a mapping"),
    ('tiermem.name="a\\0b"', "name"),
    ("tiermem.name=../x", "not a plain file name"),
    ("tiermem.name=a/b", "not a plain file name"),
    ("tiermem.name=..", "not a plain file name"),
    ("tiermem.name=" + "n" * 300, "at most 200 bytes"),
    ("tiermem.tiers.nvme={path: /tmp, threads: 0}", "tiers.nvme.threads"),
    ("tiermem.tiers.nvme={path: /tmp, io_chunk: 0}", "tiers.nvme.io_chunk"),
    ('tiermem.tiers.dram.path="/dev/shm\\0x"', "NUL"),
    ("tiermem.tiers.dram.path=''", "tiers.dram.path"),
    ('output_dir="out\\0x"', "output_dir"),
    ("gradient_accumulation_steps=1000000000000", "gradient_accumulation_steps must be at most"),
    ("tiermem_dist_timeout=1.0e+300", "tiermem_dist_timeout"),
    ("num_train_epochs=1.0e+308", "num_train_epochs must be at most 1e9"),
]


@pytest.mark.parametrize("override,needle", STORE_VALUES)
def test_bad_store_config_values(bare, capsys, override, needle):
    tmp, cfg = bare
    expect_one_line(capsys, run(tmp, cfg, override), needle, out=tmp / "out")


def test_a_service_name_with_a_slash_is_refused(tmp_path, capsys):
    from tiermem.cli import main as tiermem_main

    (tmp_path / "svc.yaml").write_text(f"name: ../escaped\ntiers:\n  dram: {{budget: 64MiB, path: {tmp_path}}}\n"
                                       f"  gpu: {{device: cpu}}\n")
    assert tiermem_main(["serve", "--config", str(tmp_path / "svc.yaml"), "--socket", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiermem: error: ") and err.count("\n") == 1 and "not a plain file name" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["svc.yaml"]
    assert not (tmp_path.parent / "escaped.arena").exists()


@pytest.mark.parametrize("where", ["under a file", "a file"])
def test_an_unwritable_logging_dir_is_refused_before_anything_is_written(setup, capsys, where):
    tmp, _, cfg = setup
    (tmp / "afile").write_text("x")
    logs = tmp / "afile" / "logs" if where == "under a file" else tmp / "afile"
    expect_one_line(capsys, run(tmp, dict(cfg, report_to="tensorboard", logging_dir=str(logs))), "logging_dir",
                    str(tmp / "afile"), out=tmp / "out")


# -- the model directory: config.json, tokenizer files, the weights' index --------------------------------------

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def text_model(tmp_path):
    """The quickstart's tiny Llama (a real tokenizer; random weights) and a few lines of text to pretrain on."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(ROOT / "models" / "tiny-llama", model)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(ROOT / "data" / "demo_pt.txt", data / "pt.txt")
    (data / "dataset_info.json").write_text(json.dumps({"pt": {"file_name": "pt.txt", "columns": {"prompt": "text"}}}))
    cfg = {"model_name_or_path": str(model), "dataset": "pt", "dataset_dir": str(data), "stage": "pt",
           "cutoff_len": 32, "output_dir": str(tmp_path / "out"), "max_steps": 1, "per_device_train_batch_size": 2,
           "tiermem_init": "random", "tiermem_cache_dir": str(tmp_path / "cache"),
           "tiermem": {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}}
    return tmp_path, model, cfg


def _change_json(path: Path, **changes):
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is _DROP:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


_DROP = object()
MODEL_CHANGES = [  # (what, config.json changes, tokenizer_config.json changes, needle)
    ("vocab below the tokenizer's", {"vocab_size": 100}, {}, "outside the model's vocabulary"),
    ("eos past the vocabulary", {"eos_token_id": 10 ** 6}, {"eos_token": _DROP}, "outside the model's vocabulary"),
    ("eos_token_id []", {"eos_token_id": []}, {"eos_token": _DROP}, "no eos token"),
    ("eos_token_id a string", {"eos_token_id": "2"}, {"eos_token": _DROP}, "eos_token_id"),
    ("pad past the vocabulary", {"pad_token_id": 512}, {}, "pad_token_id"),
    ("odd head_dim", {"head_dim": 33}, {}, "head_dim 33 is odd"),
    ("string numbers", {"hidden_size": "128"}, {}, "hidden_size"),
    ("a string for a bool", {"tie_word_embeddings": "false"}, {}, "tie_word_embeddings"),
    ("max_position_embeddings null", {"max_position_embeddings": None}, {}, "max_position_embeddings"),
    ("rope_theta a word", {"rope_theta": "abc"}, {}, "rope_theta"),
    ("sliding_window a word", {"architectures": ["MistralForCausalLM"], "sliding_window": "abc"}, {}, "sliding_window"),
    ("10 million layers", {"num_hidden_layers": 10 ** 7}, {}, "num_hidden_layers 10,000,000"),
    ("a vast hidden size", {"hidden_size": 10 ** 9}, {}, "2**35"),
    ("a million experts", {"architectures": ["MixtralForCausalLM"], "num_local_experts": 10 ** 6}, {}, "weights"),
]


@pytest.mark.parametrize("what,config,tok_config,needle", MODEL_CHANGES, ids=[c[0] for c in MODEL_CHANGES])
def test_bad_model_settings_are_refused_in_one_line(text_model, capsys, what, config, tok_config, needle):
    tmp, model, cfg = text_model
    _change_json(model / "config.json", **config)
    _change_json(model / "tokenizer_config.json", **tok_config)
    expect_one_line(capsys, run(tmp, cfg), needle, out=tmp / "out")


def test_a_generic_config_of_10_million_layers_is_refused_at_once(text_model, capsys):
    """transformers' config class of Gemma 2 lists its layers' kinds (45 s for 10 million, before the model)."""
    tmp, model, cfg = text_model
    _change_json(model / "config.json", architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                 num_hidden_layers=10 ** 7)
    expect_one_line(capsys, run(tmp, cfg), "num_hidden_layers 10,000,000", out=tmp / "out")


def test_tiermem_plan_of_10_million_layers_answers_at_once(text_model, capsys):
    from tiermem.cli import main as tiermem_main

    tmp, model, cfg = text_model
    _change_json(model / "config.json", num_hidden_layers=10 ** 7)
    (tmp / "train.yaml").write_text(yaml.safe_dump(cfg))
    assert tiermem_main(["plan", str(tmp / "train.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_hidden_layers 10,000,000" in err, err


def test_a_tokenizer_config_that_is_not_json(text_model, capsys):
    tmp, model, cfg = text_model
    (model / "tokenizer_config.json").write_text("{not json")
    expect_one_line(capsys, run(tmp, cfg), "tokenizer_config.json", "not valid JSON", out=tmp / "out")
    (model / "tokenizer_config.json").write_text("[1, 2]")
    expect_one_line(capsys, run(tmp, cfg), "tokenizer_config.json", "JSON object", out=tmp / "out")


@pytest.mark.parametrize("weight_map", [[1, 2], {"model.embed_tokens.weight": 5}, "abc", None])
def test_a_weight_map_of_the_wrong_shape(text_model, capsys, weight_map):
    tmp, model, cfg = text_model
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expect_one_line(capsys, run(tmp, dict(cfg, tiermem_init="pretrained")), "model.safetensors.index.json",
                    "weight_map", out=tmp / "out")


# -- data files ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["dataset file", "in a dataset folder", "dataset_info.json", "config.json",
                                   "tokenizer.json", "tokenizer_config.json"])
def test_a_fifo_is_refused_without_waiting_for_a_writer(text_model, capsys, where):
    tmp, model, cfg = text_model
    data = tmp / "data"
    if where == "dataset file":
        (data / "pt.txt").unlink()
        os.mkfifo(data / "pt.txt")
    elif where == "in a dataset folder":
        (data / "folder").mkdir()
        os.replace(data / "pt.txt", data / "folder" / "a.txt")
        os.mkfifo(data / "folder" / "b.txt")
        (data / "dataset_info.json").write_text(json.dumps({"pt": {"file_name": "folder",
                                                                   "columns": {"prompt": "text"}}}))
    else:
        path = (data if where == "dataset_info.json" else model) / where
        path.unlink()
        os.mkfifo(path)
    named = {"dataset file": "pt.txt", "in a dataset folder": "b.txt"}.get(where, where)
    expect_one_line(capsys, run(tmp, cfg), named, "not a regular file", out=tmp / "out")


def test_a_device_as_a_dataset_file_is_refused(text_model, capsys):
    tmp, _, cfg = text_model
    (tmp / "data" / "pt.txt").unlink()
    (tmp / "data" / "pt.txt").symlink_to("/dev/zero")
    expect_one_line(capsys, run(tmp, cfg), "a device, not a regular file", out=tmp / "out")


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_line_too_long_is_refused_naming_the_file_and_line(text_model, capsys, monkeypatch, suffix):
    """A 2 GB line had been read whole; the bound (64 Mi characters) is lowered here to keep the file small."""
    import trainer.data.registry as registry

    monkeypatch.setattr(registry, "MAX_LINE", 1000)
    tmp, _, cfg = text_model
    text = (tmp / "data" / "pt.txt").read_text().splitlines()
    lines = [json.dumps({"text": t}) for t in text] if suffix == ".jsonl" else text
    lines[2] = lines[2][:-2] + "x" * 5000 + lines[2][-2:]
    (tmp / "data" / "pt.txt").unlink()
    (tmp / "data" / f"pt{suffix}").write_text("\n".join(lines) + "\n")
    (tmp / "data" / "dataset_info.json").write_text(json.dumps({"pt": {"file_name": f"pt{suffix}",
                                                                       "columns": {"prompt": "text"}}}))
    expect_one_line(capsys, run(tmp, cfg), f"pt{suffix}: line 3 is longer than 1,000 characters", out=tmp / "out")
    lines[2] = lines[2][:998 - len(lines[2])] if suffix == ".txt" else lines[3]  # (at the bound: read)
    (tmp / "data" / f"pt{suffix}").write_text("\n".join(lines) + "\n")
    assert run(tmp, cfg, "--preview", "1") == 0


def _rows_of(tmp: Path, model: Path, cfg: dict):
    """The run's config and model config, and a way to load its rows through the cache with the notes kept."""
    from trainer.config import load_train_config
    from trainer.data.prepare import load_rows
    from trainer.run.job import model_config

    (tmp / "train.yaml").write_text(yaml.safe_dump(cfg))
    c = load_train_config(tmp / "train.yaml")
    mcfg = model_config(model, c)
    notes: list[str] = []
    return lambda: load_rows(c.dataset, c, mcfg, model, note=notes.append), notes


@pytest.mark.parametrize("damage", ["garbage", "cut short", "ids past the vocabulary", "a directory"])
def test_a_damaged_tokenized_data_cache_is_rebuilt_with_a_note(text_model, damage):
    import numpy as np

    tmp, model, cfg = text_model
    load, notes = _rows_of(tmp, model, cfg)
    first = load()
    (cached,) = (tmp / "cache" / "datasets").glob("*.npz")
    good = cached.read_bytes()
    assert load().from_cache and not notes
    if damage == "garbage":
        cached.write_bytes(bytes(random.Random(3).randrange(256) for _ in range(2000)))
    elif damage == "cut short":
        cached.write_bytes(good[: len(good) // 2])
    elif damage == "ids past the vocabulary":
        with np.load(cached) as z:
            arrays = dict(z)
        arrays["ids"] = arrays["ids"] + 10 ** 6
        np.savez(cached.with_suffix(""), **arrays)
    else:
        cached.unlink()
        cached.mkdir()
    again = load()
    assert not again.from_cache and again.input_ids == first.input_ids and again.labels == first.labels
    assert len(notes) == 1 and f"the tokenized-data cache {cached} is damaged" in notes[0], notes
    if damage != "a directory":
        assert cached.read_bytes() == good and not list(cached.parent.glob("*.tmp*"))


def test_the_note_of_a_damaged_cache_reaches_the_user(text_model, capsys):
    tmp, model, cfg = text_model
    _rows_of(tmp, model, cfg)[0]()
    (cached,) = (tmp / "cache" / "datasets").glob("*.npz")
    cached.write_bytes(b"PK\x03\x04 not a whole zip")
    assert run(tmp, cfg, "--preview", "1") == 0
    assert "is damaged" in capsys.readouterr().err


def test_the_cache_is_fsynced_before_it_takes_its_name(tmp_path, monkeypatch):
    from trainer.data import prepare

    order = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: order.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: order.append("replace") or real_replace(a, b))
    prepare._save(tmp_path / "c.npz", prepare.Rows([[1, 2, 3]], [None], sources=["x"]))
    assert order == ["fsync", "replace"]
    assert prepare._load(tmp_path / "c.npz", 10).input_ids == [[1, 2, 3]]


# -- dataset text on the user's terminal -------------------------------------------------------------------------

HOSTILE_TEXT = "title\x1b]0;pwned\x07 bell\x07 back\rover [/nonsense] [bold red]red[/] :smile: \u202etxt.exe\x9b2J"


def _hostile_dataset(tmp: Path, cfg: dict) -> dict:
    """The text as JSON lines (a .txt file's lines end at a carriage return), the hostile one first."""
    lines = (tmp / "data" / "pt.txt").read_text().splitlines()
    (tmp / "data" / "pt.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                   for t in [HOSTILE_TEXT + " " + lines[0], *lines[1:]]))
    (tmp / "data" / "dataset_info.json").write_text(json.dumps({"pt": {"file_name": "pt.jsonl",
                                                                       "columns": {"prompt": "text"}}}))
    return dict(cfg, cutoff_len=128)


def _clean(text: str) -> None:
    for c in ("\x1b", "\x07", "\r", "\u202e", "\x9b"):
        assert c not in text, repr(text)
    for escaped in ("\\x1b]0;pwned\\x07", "back\\rover", "\\u202etxt.exe", "\\x9b2J"):
        assert escaped in text, text
    assert "[/nonsense] [bold red]red[/] :smile:" in text, text  # (as written: not rich markup, not emoji)


def test_the_example_shown_at_start_escapes_control_characters(text_model):
    """What a run prints at start (trainer.run.job.show_example through the run's rich console)."""
    import io

    from rich.console import Console

    from trainer.run.job import show_example

    tmp, model, cfg = text_model
    load, _ = _rows_of(tmp, model, _hostile_dataset(tmp, cfg))
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    show_example(load(), model, lambda text: console.print(text, soft_wrap=True, highlight=False))
    assert "example input" in out.getvalue()
    _clean(out.getvalue())


def test_preview_escapes_control_characters(text_model, capsys):
    tmp, _, cfg = text_model
    cfg = _hostile_dataset(tmp, cfg)
    assert run(tmp, cfg, "--preview", "1") == 0
    _clean(capsys.readouterr().out)


def test_an_error_naming_a_path_of_control_characters_stays_one_line(bare, capsys):
    tmp, cfg = bare
    rc = run(tmp, dict(cfg, tiermem="store\n.yaml\x1b[2J\r"))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "\x1b" not in err and "\r" not in err, repr(err)
    assert "store\\n.yaml\\x1b[2J\\r" in err, err


# -- tiermem's commands: service frames, stats files, arguments ---------------------------------------------------

def test_a_progress_frame_with_strings_where_numbers_go_is_refused(tmp_path):
    """The service had stored a trainer's progress as it came: a string for a number then broke `stats
    --prometheus` and `top` for everyone watching. The request parser refuses it; a good frame is kept and shown."""
    from tests.test_service import _unit_service, ok
    from tiermem.cli.metrics import prometheus
    from tiermem.cli.top import render

    svc, client, _, theirs, hello, err = _unit_service(tmp_path, 0)
    try:
        ok(svc.dispatch(client, hello))
        frame = {"op": "progress", "id": 2, "run": "r1"}
        for live, store, needle in [({"loss": "abc"}, {}, "live.loss"), ({"total_steps": [1]}, {}, "total_steps"),
                                    ({"optimizer": {"last_update_s": "x"}}, {}, "live.optimizer.last_update_s"),
                                    ({"split": {"compute": "1"}}, {}, "live.split"),
                                    ({"eta_s": 10 ** 400}, {}, "eta_s"),
                                    ({"plan": {"busy": {"cpu": "x"}}}, {}, "live.plan.busy"),
                                    ({}, {"tiers": {"gpu": {"capacity": "big"}}}, "store.tiers.gpu.capacity"),
                                    ({}, {"links": {"dram->gpu": {"gbps_now": "fast"}}}, "gbps_now"),
                                    ({}, {"waits_s": {"x": "y"}}, "store.waits_s")]:
            assert needle in err(client, dict(frame, live=live, store=store)), (live, store)
        good = {"step": 3, "total_steps": 12, "loss": 2.5, "eta_s": 1e30, "split": {"compute": 0.1},
                "optimizer": {"last_update_s": 0.2}}
        ok(svc.dispatch(client, dict(frame, live=good, store={})))
        snap = svc.snapshot()
        assert "tiermem_train_step 3.0" in prometheus(snap)
        from rich.console import Console

        Console(file=open(os.devnull, "w")).print(render(snap))
    finally:
        theirs.close()
        svc.shutdown()
        svc.release()


@pytest.mark.parametrize("content", ["[1, 2]", '{"store": {"tiers": [1]}}', '{"run": {"loss": "abc"}}', "{garbled",
                                     '{"run": {"optimizer": "fast"}}', '{"store": {"links": {"x": {"bytes": "1"}}}}'])
@pytest.mark.parametrize("command", [["stats", "--prometheus"], ["stats"], ["top", "--once"]])
def test_stats_of_a_file_of_the_wrong_shape(tmp_path, capsys, content, command):
    from tiermem.cli import main as tiermem_main

    (tmp_path / "tiermem_stats.json").write_text(content)
    assert tiermem_main([*command, "--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiermem: error: ") and err.count("\n") == 1 and "tiermem_stats.json" in err, err


@pytest.mark.parametrize("args,needle", [
    (["probe", "--reps", "0"], "--reps must be from 1"),
    (["probe", "--reps", "-3"], "--reps must be from 1"),
    (["serve", "--config", "{cfg}", "--metrics-port", "70000"], "--metrics-port must be a TCP port"),
    (["serve", "--config", "{cfg}", "--metrics-port", "-1"], "--metrics-port must be a TCP port"),
    (["serve", "--config", "{cfg}", "--socket", "{tmp}/" + "s" * 200], "the OS takes at most"),
    (["stats", "--socket", "{tmp}/" + "s" * 200], "the OS takes at most"),
])
def test_bad_command_arguments(tmp_path, capsys, args, needle):
    from tiermem.cli import main as tiermem_main

    (tmp_path / "svc.yaml").write_text(f"tiers:\n  dram: {{budget: 64MiB, path: {tmp_path}}}\n  gpu: {{device: cpu}}\n")
    args = [a.format(cfg=tmp_path / "svc.yaml", tmp=tmp_path) for a in args]
    assert tiermem_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiermem: error: ") and err.count("\n") == 1 and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["svc.yaml"]


# -- a service that does not answer ---------------------------------------------------------------------------------

@pytest.fixture
def quick_pulse(monkeypatch):
    """Pulses every 50 ms (a timeout may then be as short as 0.15 s): the liveness logic in milliseconds."""
    from tiermem.service import protocol

    monkeypatch.setattr(protocol, "PULSE_SECONDS", 0.05)
    return protocol


def test_stats_of_a_service_that_does_not_answer_ends_in_one_line(quick_pulse, capsys):
    """A stopped service (SIGSTOP) accepts connections (the kernel queues them) and never answers: stats had waited
    for good. A socket that listens and never reads stands in for it here."""
    import socket
    import tempfile

    from tiermem.cli import main as tiermem_main

    with tempfile.TemporaryDirectory(prefix="tm-") as d:
        path = Path(d) / "s.sock"
        mute = socket.socket(socket.AF_UNIX)
        mute.bind(str(path))
        mute.listen(8)
        try:
            for command in (["stats"], ["stats", "--prometheus"], ["top", "--once"]):
                assert tiermem_main([*command, "--socket", str(path), "--timeout", "0.3"]) == 2
                err = capsys.readouterr().err
                assert err.count("\n") == 1 and f"the tiermem service at {path} does not answer" in err, err
        finally:
            mute.close()


def test_a_busy_service_is_not_taken_for_a_stopped_one(quick_pulse, tmp_path, monkeypatch):
    """A request the service works on for longer than the client's timeout (a commit waiting for a long update)
    is not silence: the service pulses while it works, and the client waits for the answer. (A timeout of 20
    pulses: a busy machine may hold the pulsing thread back for a few, never for a second.)"""
    import tempfile
    import time

    from tests.test_service import _unit_service
    from tiermem.cli.top import read_service
    from tiermem.service.server import Service

    svc, _, _, theirs, _, _ = _unit_service(tmp_path, 0)
    slow = Service._stats
    monkeypatch.setattr(Service, "_stats", lambda self, c, m: time.sleep(1.5) or slow(self, c, m))
    with tempfile.TemporaryDirectory(prefix="tm-") as d:
        svc.socket_path = Path(d) / "s.sock"
        svc.listen()
        try:
            assert read_service(svc.socket_path, 1.0)["run"]["phase"].startswith("idle")
        finally:
            theirs.close()
            svc.shutdown()
            svc.release()
