"""What a run leaves for Hugging Face and LLaMA-Factory users: trainer_state.json (output_dir and each
checkpoint), train/eval/all_results.json, config.json with dtype, training_args.yaml with every auto
decided, TensorBoard event files, save_strategy and eval_strategy epoch, logging_first_step, the "saved
checkpoint-N" line as the save completes, and the ETA after a resume."""

from __future__ import annotations

import contextlib
import io
import json
import struct
from pathlib import Path

import crc32c
import pytest
import yaml

from tests.tiny_models import tiny_run
from trainer.cli import main
from trainer.outputs.report import Reporter
from trainer.outputs.saver import Saver
from trainer.run.executor import StepResult


def _masked(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _fields(buf: bytes) -> list[tuple[int, object]]:
    """A protocol buffer message's (field number, value) pairs: varints as ints, fixed64 and fixed32 as
    doubles and floats, length-delimited as bytes."""
    out, i = [], 0

    def varint():
        nonlocal i
        n, shift = 0, 0
        while True:
            b = buf[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return n
    while i < len(buf):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, varint()))
        elif wire == 1:
            out.append((number, struct.unpack("<d", buf[i:i + 8])[0]))
            i += 8
        elif wire == 5:
            out.append((number, struct.unpack("<f", buf[i:i + 4])[0]))
            i += 4
        else:
            n = varint()
            out.append((number, buf[i:i + n]))
            i += n
    return out


def read_events(path: Path) -> list[dict]:
    """The scalar events of a TensorBoard event file, every record's two CRCs checked."""
    data, i, events = path.read_bytes(), 0, []
    while i < len(data):
        head = data[i:i + 8]
        (n,) = struct.unpack("<Q", head)
        assert struct.unpack("<I", data[i + 8:i + 12])[0] == _masked(head)
        body = data[i + 12:i + 12 + n]
        assert struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] == _masked(body)
        i += 16 + n
        ev = dict(_fields(body))
        if 5 in ev:
            values = {}
            for number, value in _fields(ev[5]):
                assert number == 1
                v = dict(_fields(value))
                values[v[1].decode()] = v[2]
            events.append({"step": ev.get(2, 0), "values": values})
        else:
            assert ev[3] == b"brain.Event:2" and not events, "the file opens with its version"
    return events


@pytest.fixture(scope="module")
def epoch_run(tmp_path_factory):
    """Two epochs of 3 steps (12 training rows: 4 held out), evaluated and saved at each epoch's end,
    TensorBoard on; the Saver's wait() notes what was printed by the time the save's threads ended."""
    tmp_path = tmp_path_factory.mktemp("epochs")
    cfg = dict(tiny_run(tmp_path), max_steps=-1, num_train_epochs=2, val_size=4, eval_strategy="epoch",
               save_strategy="epoch", report_to="tensorboard", logging_steps=2, logging_first_step=True,
               output_dir=str(tmp_path / "out"), trust_remote_code=True, ddp_timeout=180000000,
               tiermem={"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}})
    printed, seen = io.StringIO(), []
    wait = Saver.wait

    def noting_wait(self):
        for t in self._threads:
            t.join()
        seen.append(printed.getvalue())
        return wait(self)

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv("TIERMEM_CACHE", str(tmp_path / "cache"))
        mp.setattr(Saver, "wait", noting_wait)
        assert main([str(tmp_path / "c.yaml")]) == 0
    return tmp_path / "out", printed.getvalue(), seen


def test_trainer_state_and_results_as_hugging_face_writes_them(epoch_run):
    from transformers import TrainerState

    out, printed, _ = epoch_run
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["current_steps"] for r in log if "loss" in r] == [1, 2, 4, 6]  # logging_first_step, every 2, last
    evals = {r["current_steps"]: r["eval_loss"] for r in log if "eval_loss" in r}
    assert list(evals) == [3, 6]  # eval_strategy epoch (the final evaluation is step 6's)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]

    state = TrainerState.load_from_json(str(out / "trainer_state.json"))
    assert state.global_step == 6 and state.max_steps == 6 and state.epoch == 2.0 and state.num_train_epochs == 2
    best_step = min(evals, key=evals.get)
    assert state.best_metric == evals[best_step] and state.best_global_step == best_step
    assert state.best_model_checkpoint == str(out / f"checkpoint-{best_step}")
    train = [h for h in state.log_history if "loss" in h]
    assert [h["step"] for h in train] == [1, 2, 4, 6] and [h["loss"] for h in train] == [r["loss"] for r in log
                                                                                           if "loss" in r]
    assert [h["eval_loss"] for h in state.log_history if "eval_loss" in h] == list(evals.values())
    results = json.loads((out / "train_results.json").read_text())
    assert state.log_history[-1]["train_loss"] == results["train_loss"] and state.total_flos > 0
    early = TrainerState.load_from_json(str(out / "checkpoint-3" / "trainer_state.json"))
    assert early.global_step == 3 and max(h["step"] for h in early.log_history) == 3

    eval_results = json.loads((out / "eval_results.json").read_text())
    assert eval_results["eval_loss"] == evals[6] and eval_results["epoch"] == 2.0
    assert eval_results["eval_runtime"] > 0 and eval_results["eval_samples_per_second"] > 0
    assert json.loads((out / "all_results.json").read_text()) == {**results, **eval_results}
    assert results["train_loss"] > 0 and {"train_runtime", "train_samples_per_second", "total_flos"} <= set(results)

    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and "torch_dtype" not in config
    assert "note: trust_remote_code has no effect here" in printed and "note: ddp_timeout has no effect" in printed
    assert printed.index("note: trust_remote_code") < printed.index("training data:"), "notes come first"


def test_training_args_record_every_auto_decided(epoch_run):
    out, _, _ = epoch_run
    args = yaml.safe_load((out / "training_args.yaml").read_text())

    def autos(node, where=""):
        if isinstance(node, dict):
            return [a for k, v in node.items() for a in autos(v, f"{where}.{k}")]
        return [where] if node == "auto" else []

    assert autos(args) == [], autos(args)
    tiers = args["tiermem"]["tiers"]
    assert tiers["dram"]["budget"] == 64 << 20 and isinstance(tiers["gpu"]["budget"], int)
    assert tiers["gpu"]["device"] == "cpu" and tiers["dram"]["pin"] == "false"
    placement = args["tiermem"]["placement"]
    assert set(placement) == {"param", "grad", "exp_avg", "exp_avg_sq"}, placement
    tiers_ = {"gpu", "dram", "nvme"}  # (the planner's: one tier per kind, or tier -> groups)
    assert all(t in tiers_ or (isinstance(t, dict) and set(t) <= tiers_) for t in placement.values()), placement
    assert args["do_eval"] is True and args["report_to"] == "tensorboard"
    assert Path(args["logging_dir"]).parent == out / "runs"


def test_tensorboard_event_files_hold_the_logged_scalars(epoch_run):
    out, _, _ = epoch_run
    (path,) = (out / "runs").glob("*/events.out.tfevents.*")
    events = read_events(path)
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    train = [(e["step"], e["values"]) for e in events if "train/loss" in e["values"]]
    assert [s for s, _ in train] == [1, 2, 4, 6]
    for (_, values), r in zip(train, [r for r in log if "loss" in r]):
        assert values["train/loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert values["train/learning_rate"] == pytest.approx(r["lr"], rel=1e-6)
        assert values["train/grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-6)
    assert [(e["step"], pytest.approx(e["values"]["eval/loss"], rel=1e-6)) for e in events
            if "eval/loss" in e["values"]] == [(r["current_steps"], r["eval_loss"]) for r in log if "eval_loss" in r]


def test_saved_line_comes_when_the_save_completes(epoch_run):
    _, _, seen = epoch_run
    # by the time checkpoint-3's threads had ended (the Saver's wait at checkpoint-6's begin: the first wait
    # is checkpoint-3's own begin), its line was out: the writer says it as it completes
    assert "saved checkpoint-3: " not in seen[0] and "saved checkpoint-3: " in seen[1], seen


def test_eta_after_a_resume_counts_the_steps_left_at_the_rate_since(tmp_path):
    lines = []
    report = Reporter(tmp_path, 200, 1000, lines.append, resume_step=100)
    result = StepResult(2.0, 1.0, 100, 1.0, 0.0, 0.0, {})
    report.step(101, result, 1e-3, 1.0, 2.0, False, 1)  # 1 step in 2 s since the resume: 99 left, 198 s
    assert report.live["eta_s"] == pytest.approx(198.0)
    assert lines[-1].endswith("ETA 0:03:18"), lines[-1]


def test_the_export_converts_a_tensor_piece_by_piece_to_the_same_bytes(tmp_path, monkeypatch):
    """A tensor exported in another dtype (a bf16 run's fp32 master) is converted a piece at a time, never
    whole beside itself: the shards hold exactly the whole tensor's conversion, and their recorded CRC32C."""
    import torch
    from safetensors.torch import load_file

    from tests.tiny_models import save_tiny_model
    from trainer.model.config import model_config_from_dict
    from trainer.model.weights import all_weights
    from trainer.outputs import weights_io

    model_dir = save_tiny_model("llama", tmp_path / "model")
    cfg = model_config_from_dict(json.loads((model_dir / "config.json").read_text()))
    monkeypatch.setattr(weights_io, "WRITE_THROUGH", 96)  # (48 bf16 elements a piece)
    writer = weights_io.ModelWriter(cfg, tmp_path / "out", torch.bfloat16, model_dir)
    gen = torch.Generator().manual_seed(0)
    want = {}
    for w in all_weights(cfg):
        t = torch.randn(w.shape, generator=gen)
        want[w.name] = t.to(torch.bfloat16)
        writer.put(w.name, t)
    files = writer.close()
    got = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(f))
        assert writer.crc32c[f.name] == f"{crc32c.crc32c(f.read_bytes()):08x}"
    assert files and set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
