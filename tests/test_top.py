"""``tiermem top`` and ``tiermem stats`` over an embedded run's stats file: a golden frame for a fixed
snapshot, a live run directory, the Prometheus text, and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import yaml
from rich.console import Console

from tiermem.cli.main import main as tiermem_main
from tiermem.cli.metrics import prometheus
from tiermem.cli.top import ceilings, plan_rows, predict, render

GOLDEN = Path(__file__).parent / "golden" / "top_frame.txt"
MiB = 1 << 20

SNAPSHOT = {
    "pid": 4242,
    "store": {
        "store": "tiermem-4242",
        "tiers": {
            "gpu": {"capacity": 64 * MiB, "used": 48 * MiB, "budget": 64 * MiB, "slots": 3, "slots_free": 1,
                    "slot_bytes": 8 * MiB, "by_kind": {"param": 16 * MiB, "grad": 16 * MiB, "exp_avg": 8 * MiB}},
            "dram": {"capacity": 512 * MiB, "used": 384 * MiB, "budget": 1024 * MiB, "path": "anonymous",
                     "pinned": True, "by_kind": {"param": 64 * MiB, "grad": 128 * MiB, "master": 128 * MiB,
                                                 "exp_avg_sq": 64 * MiB}},
            "nvme": {"capacity": 256 * MiB, "used": 128 * MiB, "budget": None, "backend": "posix",
                     "by_kind": {"exp_avg": 128 * MiB}},
        },
        "links": {"dram->gpu": {"bytes": 10 * 1024 * MiB, "gbps_now": 51.2, "gbps_avg": 49.87, "busy_s": 0.22,
                                "queue": 1},
                  "gpu->dram": {"bytes": 2 * 1024 * MiB, "gbps_now": 0.0, "gbps_avg": 48.1, "busy_s": 0.05,
                                "queue": 0},
                  "nvme->dram": {"bytes": 0, "gbps_now": 0.0, "gbps_avg": 0.0, "busy_s": 0.0, "queue": 0}},
        "waits_s": {"gpu_slot": 1.5},
    },
    "run": {"step": 30, "total_steps": 120, "phase": "backward", "layer": 7, "eta_s": 95.0, "loss": 2.3456,
            "grad_norm": 0.789, "lr": 1.5e-4, "eval_loss": 2.5, "tokens_per_s": 12345.0, "tflops": 210.5,
            "step_s": 1.25, "split": {"compute": 1.1, "wait_transfer": 0.05, "wait_optimizer": 0.1},
            "link_bytes_per_step": {"dram->gpu": 8 * 1024 * MiB, "gpu->dram": 4 * 1024 * MiB},
            "optimizer": {"last_update_s": 0.9, "split": {"cpu_adamw": 0.5, "gpu_path": 0.8}, "gpu_share": 0.7}},
}
PROBE = {"rows": [{"link": "arena -> GPU", "raw": 55.13}, {"link": "GPU -> arena", "raw": 55.05},
                  {"link": "NVMe -> arena (posix)", "raw": 1.69}, {"link": "NVMe -> arena (kvikio)", "raw": 1.82}]}


def frame(snapshot, probe=None) -> str:
    console = Console(width=110, record=True, color_system=None, file=open("/dev/null", "w"))
    console.print(render(snapshot, probe))
    return console.export_text()


def test_frame_matches_the_golden_text(tmp_path, monkeypatch):
    monkeypatch.setattr("tiermem.cli.top._alive", lambda pid: pid == 4242)  # the run is alive
    (tmp_path / "probe.json").write_text(json.dumps(PROBE))
    ceiling = ceilings(tmp_path / "probe.json")
    assert ceiling == {"dram->gpu": 55.13, "gpu->dram": 55.05, "nvme->dram": 1.82}
    assert frame(SNAPSHOT, ceiling) == GOLDEN.read_text()


def test_a_finished_run_says_so_and_a_dead_one_says_it_stopped():
    done = {**SNAPSHOT, "run": {**SNAPSHOT["run"], "step": 120, "finished": True, "train_loss": 1.23456,
                                "train_runtime": 3725.0, "phase": "evaluation"}}
    head = frame(done).splitlines()[0]
    assert "finished: step 120/120, train_loss 1.2346, trained in 1:02:05" in head and "phase" not in head, head
    dead = {**SNAPSHOT, "pid": 2**22 + 12345}  # no such process (above the kernel's pid_max default)
    assert "stopped: pid 4206649 is gone before the run finished" in " ".join(frame(dead).split())


def test_predicted_step_time_is_the_largest_part():
    best = predict(SNAPSHOT, {"dram->gpu": 55.13})
    assert best["bound"] == "compute" and best["seconds"] == 1.1
    assert abs(best["parts"]["dram->gpu"] - 8 * 1024 * MiB / 55.13e9) < 1e-9
    assert abs(best["parts"]["gpu->dram"] - 4 * 1024 * MiB / 48.1e9) < 1e-9  # no ceiling: its own average
    slow = {**SNAPSHOT, "run": {**SNAPSHOT["run"], "link_bytes_per_step": {"dram->gpu": 80 * 1024 * MiB}}}
    assert predict(slow, {"dram->gpu": 55.13})["bound"] == "dram->gpu"
    assert predict({"run": {}}) is None


def test_prometheus_text_is_well_formed():
    text = prometheus(SNAPSHOT)
    sample = re.compile(r'^tiermem_[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith("# HELP tiermem_") or line.startswith("# TYPE tiermem_") or sample.match(line), line
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if not line.startswith("#")}
    assert values['tiermem_tier_used_bytes{kind="exp_avg",tier="nvme"}'] == 134217728
    assert values["tiermem_train_step"] == 30
    assert values['tiermem_train_predicted_step_seconds{bound="compute"}'] == 1.1
    assert values['tiermem_link_bytes_per_second{link="dram->gpu"}'] == 51.2e9  # base units: bytes, not GB
    assert values['tiermem_link_bytes_total{link="dram->gpu"}'] == 10 * 1024 * MiB
    assert values["tiermem_train_eta_seconds"] == 95.0 and values["tiermem_train_finished"] == 0
    assert "# TYPE tiermem_link_bytes_total counter" in text
    assert "# HELP tiermem_tier_capacity_bytes bytes the tier holds" in text
    names = {k.split("{")[0] for k in values}
    assert not any(n.endswith(("_s", "_gbps_now")) for n in names), names


def test_prometheus_label_values_are_escaped():
    snap = {"store": {"waits_s": {'a "quoted"\\name': 1.0}}}
    assert 'tiermem_wait_seconds_total{what="a \\"quoted\\"\\\\name"} 1.0' in prometheus(snap)


def test_top_and_stats_follow_a_real_run(tmp_path, capsys):
    from tests.tiny_models import save_tiny_model, write_tokenized_dataset
    from trainer.cli import main as train_main

    model = save_tiny_model("llama", tmp_path / "model")
    name = write_tokenized_dataset(tmp_path / "data")
    cfg = {"model_name_or_path": str(model), "dataset": name, "dataset_dir": str(tmp_path / "data"),
           "output_dir": str(tmp_path / "out"), "max_steps": 3, "per_device_train_batch_size": 2,
           "tiermem": {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert train_main([str(tmp_path / "c.yaml")]) == 0
    if not torch.cuda.is_available():  # (placed by the H200's figures, as a layout must not turn on a CPU's load)
        said = capsys.readouterr().out
        assert "plan: the prediction is for the H200 machine's figures (no GPU here" in said
        assert "`tiermem plan` predicts with this machine's own figures\n" in said  # (a whole sentence)
    capsys.readouterr()
    assert tiermem_main(["top", "--run", str(tmp_path / "out"), "--once"]) == 0
    shown = capsys.readouterr().out
    assert "finished: step 3/3, train_loss " in shown and "phase" not in shown, shown
    assert "dram->gpu" in shown and "loss" in shown
    # one prediction, the plan's (the planner placed it), in words
    assert "plan against the last step (bound: GPU compute)" in shown and "GPU compute" in shown, shown
    assert "at full overlap" not in shown
    assert tiermem_main(["stats", "--run", str(tmp_path / "out"), "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["run"]["step"] == 3 and set(snap["store"]["tiers"]) >= {"gpu", "dram"}
    # (each tier's role, which top names the tiers by without the tiers' registry: tests/test_fast_clients.py)
    assert [snap["store"]["tiers"][t]["role"] for t in ("gpu", "dram")] == ["device", "host"]
    assert snap["run"]["finished"] is True and snap["run"]["eta_s"] == 0.0


def test_bad_input(tmp_path, capsys):
    for argv in (["top", "--socket", "/tmp/x.sock", "--once"], ["stats", "--json"],
                 ["top", "--run", str(tmp_path), "--once"], ["top", "--run", str(tmp_path), "--probe", "/nope"]):
        assert tiermem_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("tiermem: error: ") and err.count("\n") == 1, err


def test_the_plan_is_shown_against_the_measured_step():
    plan = {"predicted_step_s": 1.2, "busy": {"gpu": 1.0, "gpu_adamw": 0.05, "h2d": 0.2, "d2h": 0.1, "nvme": 0.0,
                                              "cpu": 0.4}, "bound": "gpu", "compute": 1.0, "wait_optimizer": 0.15,
            "wait_transfer": 0.0, "bytes": {"h2d": 8 * 1024 * MiB, "d2h": 2 * 1024 * MiB, "nvme_read": 0,
                                            "nvme_write": 0}}
    snap = json.loads(json.dumps(SNAPSHOT))
    snap["run"]["plan"] = plan
    snap["run"]["disk_busy_s_per_step"] = 0.25
    rows = {r[0]: r[1:] for r in plan_rows(snap)}
    assert rows["step"] == ("1.200 s", "1.250 s") and rows["GPU compute"] == ("1.000 s", "1.100 s")
    assert rows["waiting for the update"] == ("0.150 s", "0.100 s")
    assert rows["PCIe to the GPU"] == ("8.0 GiB", "8.0 GiB") and rows["PCIe from the GPU"] == ("2.0 GiB", "4.0 GiB")
    assert rows["NVMe busy (either way)"] == ("0.000 s", "0.250 s")
    assert rows["CPU AdamW"] == ("0.400 s", "0.500 s") and rows["GPU AdamW"] == ("0.050 s", "0.800 s")
    shown = frame(snap)
    assert "plan against the last step (bound: gpu)" in shown and "PCIe from the GPU" in shown
    assert plan_rows(SNAPSHOT) == [] and "plan against" not in frame(SNAPSHOT)


def test_a_services_frame_shows_its_committed_step_one_prediction_and_no_eta_without_a_trainer():
    """Over a service: the header's step is the service's committed step (the trainer's last report lags it), no
    ETA while no trainer is attached, and one prediction: the plan's, its bound in words."""
    plan = {"predicted_step_s": 0.2, "busy": {"gpu": 0.15, "cpu": 0.2}, "bound": "cpu", "bound_said": "CPU AdamW",
            "compute": 0.15, "wait_optimizer": 0.05, "wait_transfer": 0.0, "bytes": {"h2d": MiB, "d2h": MiB}}
    snap = json.loads(json.dumps(SNAPSHOT))
    snap["run"].update(plan=plan, optimizer=dict(snap["run"]["optimizer"], committed=31, updated=31))
    snap["service"] = {"socket": "/tmp/s.sock", "run": "r", "label": {"output_dir": "out"}, "trainer_pid": None}
    shown = frame(snap)
    head = shown.splitlines()[0]
    assert "step 31/120" in head and "ETA" not in head and "layer" not in head, head
    assert "no trainer attached; committed step 31" in " ".join(shown.split())
    assert "plan against the last step (bound: CPU AdamW)" in shown and "at full overlap" not in shown, shown
    snap["service"]["trainer_pid"] = 4242  # attached again: its ETA
    assert "ETA 0:01:35" in frame(snap).splitlines()[0]
    del snap["run"]["plan"]  # a run the planner did not place (every kind pinned): the full-overlap bound instead
    assert "at full overlap" in frame(snap) and "plan against" not in frame(snap)


def test_a_services_plan_is_shown_against_the_updates_of_both_its_workers():
    """Over a service the update's split is the service's part and the trainer's GPU worker's, each named so
    (``tiermem.service.monitor``): the plan's CPU AdamW and GPU AdamW rows measure them (they read 0 s)."""
    plan = {"predicted_step_s": 0.2, "busy": {"gpu": 0.15, "cpu": 0.2, "gpu_adamw": 0.05}, "bound": "cpu",
            "compute": 0.15, "wait_optimizer": 0.05, "wait_transfer": 0.0, "bytes": {"h2d": MiB, "d2h": MiB}}
    snap = json.loads(json.dumps(SNAPSHOT))
    split = {"service_cpu_adamw": 0.5, "service_cpu_compute_copy": 0.1, "service_cpu_staging": 0.3,
             "trainer_gpu_path": 0.2, "trainer_gpu_in_place": 0.05}
    snap["run"].update(plan=plan, optimizer=dict(snap["run"]["optimizer"], split=split))
    snap["service"] = {"socket": "/tmp/s.sock", "run": "r", "label": {"output_dir": "out"}, "trainer_pid": 4242}
    rows = {r[0]: r[1:] for r in plan_rows(snap)}
    assert rows["CPU AdamW"] == ("0.200 s", "0.600 s") and rows["GPU AdamW"] == ("0.050 s", "0.250 s"), rows


def test_a_services_frame_says_what_its_crash_would_lose():
    """The service's line names its run's durability (tiermem.service.hbm.durability_of)."""
    from tiermem.service.hbm import durability_of

    said = durability_of({"durability": "step"}, in_hbm=True)
    snap = {**SNAPSHOT, "service": {"socket": "/s.sock", "run": "r", "label": {"output_dir": "/out"},
                                    "trainer_pid": 7, "durability": said}}
    text = " ".join(frame(snap).split())
    assert "service on /s.sock: run /out, trainer pid 7" in text and "durability: step (HBM written through" in text
    assert durability_of({}, in_hbm=True).startswith("durability: checkpoint (")
    assert durability_of({"durability": "step"}, in_hbm=False).startswith("durability: no state in HBM")
