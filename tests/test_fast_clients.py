"""The clients a user types while a run goes on answer at once: ``tiermem stats``, ``top --once``, ``arenas``,
``--help`` and ``--version`` (and ``tiermem-train --help``, ``--version``) do not import torch, even to say in one
line that no service is there; every subcommand's --help says what it does; ``tiermem probe`` without CUDA
prints no figure it did not measure, and starts with its title."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.procs import ROOT, child_env
from tiermem.cli import probe
from tiermem.cli.main import main

# runs the entry point in a fresh interpreter, then says whether torch was imported (the last line of stderr)
NO_TORCH = ("import sys\nfrom {module} import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    code = e.code\nprint('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
            "sys.exit(code)\n")


def client(module: str, *args: str, tmp_path) -> subprocess.CompletedProcess:
    env = child_env(XDG_RUNTIME_DIR=str(tmp_path / "run"), TIERMEM_SERVICE_TIMEOUT="5")
    return subprocess.run([sys.executable, "-c", NO_TORCH.format(module=module), *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)


@pytest.mark.parametrize("args", [["stats"], ["top", "--once"], ["stats", "--prometheus"]])
def test_a_client_says_no_service_is_there_without_torch(tmp_path, args):
    r = client("tiermem.cli.main", *args, tmp_path=tmp_path)
    said = r.stderr.splitlines()
    assert r.returncode == 2 and said[-1] == "no torch", r.stderr
    assert len(said) == 2 and said[0].startswith("tiermem: error: no tiermem service at "), r.stderr


@pytest.mark.parametrize("module,args", [
    ("tiermem.cli.main", ["arenas", "--dir", "{tmp}"]), ("tiermem.cli.main", ["--help"]),
    ("tiermem.cli.main", ["--version"]), ("tiermem.cli.main", ["probe", "--help"]),
    ("tiermem.cli.main", ["stats", "--run", "{tmp}"]),
    ("trainer.cli", ["--help"]), ("trainer.cli", ["--version"])])
def test_help_version_and_arenas_answer_without_torch(tmp_path, module, args):
    r = client(module, *[a.format(tmp=tmp_path) for a in args], tmp_path=tmp_path)
    assert r.stderr.splitlines()[-1] == "no torch", r.stderr
    assert r.returncode in (0, 2) and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["probe", "arenas", "serve", "top", "stats", "plan"])
def test_every_subcommands_help_says_what_it_does(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    usage, description = out.split("\n\n")[:2]
    assert usage.startswith(f"usage: tiermem {command}") and not description.startswith("options:"), out
    assert len(description.split()) >= 10, description
    assert "``" not in description, description  # (a docstring's markup is not for the terminal)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe of a machine without CUDA")
def test_probe_without_cuda_prints_only_what_it_measured(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(probe, "probe_adamw", lambda: [])  # (the update's rates: seconds of a test's time)
    args = ["probe", "--size", "1MiB", "--reps", "1", "--nvme-path", str(tmp_path / "disk"), "--arena-dir",
            str(tmp_path)]
    assert main([*args, "--save", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiermem probe (1.0 MiB transfers)"), repr(out[:200])  # (no line of spaces first)
    rows = {r["link"]: r for r in json.loads((tmp_path / "p.json").read_text())["rows"]}
    for label in ("arena setup", "arena setup (anonymous)"):
        note = rows[label]["note"]
        assert "touch pages 0.00" not in note and "cudaHostRegister 0.00" not in note, note
        assert note.endswith("create only; touch pages and cudaHostRegister not measured: no CUDA (the arena is "
                             "not pinned)"), note


def test_top_and_stats_of_a_live_service_with_a_planned_run_answer_without_torch(tmp_path):
    """A service whose trainer reported a planned step: `tiermem top --once` shows the plan against the step (its
    rows, and a probe file's links, name the tiers as the snapshot says their roles) and `stats` the figures,
    without torch (the tiers' registry imports it)."""
    import tempfile
    from pathlib import Path

    from tests.test_service import _unit_service, ok

    svc, peer, _, theirs, hello, _ = _unit_service(tmp_path, 0)
    ok(svc.dispatch(peer, hello))
    ok(svc.dispatch(peer, {"op": "init", "id": 2, "run": "r1", "step": 0}))
    trainer = svc.snapshot()["store"]  # (the trainer's own store: its device tier, as its stats file says it)
    trainer["tiers"] = {"gpu": {"role": "device", "capacity": 1 << 20, "used": 0, "slots": 3, "slot_bytes": 4096}}
    trainer["links"] = {"dram->gpu": {"bytes": 4096, "gbps_now": 1.0, "gbps_avg": 1.0, "busy_s": 0.0, "queue": 0}}
    plan = {"predicted_step_s": 0.2, "busy": {"gpu": 0.15, "cpu": 0.2}, "bound": "cpu", "bound_said": "CPU AdamW",
            "compute": 0.15, "wait_optimizer": 0.05, "wait_transfer": 0.0, "bytes": {"h2d": 4096, "d2h": 4096}}
    live = {"step": 1, "total_steps": 4, "phase": "forward", "step_s": 0.25, "plan": plan,
            "split": {"compute": 0.2, "wait_transfer": 0.0, "wait_optimizer": 0.05},
            "link_bytes_per_step": {"dram->gpu": 4096}, "optimizer": {"split": {}}}
    ok(svc.dispatch(peer, {"op": "progress", "id": 3, "run": "r1", "live": live, "store": trainer}))
    with tempfile.TemporaryDirectory(prefix="tm-") as d:  # (short: Unix socket paths are limited to 107 bytes)
        svc.socket_path = Path(d) / "s.sock"
        svc.listen()
        try:
            probe = tmp_path / "probe.json"  # (its links named as the snapshot names the tiers)
            probe.write_text(json.dumps({"rows": [{"link": "arena -> GPU", "raw": 55.13}]}))
            for args in (["top", "--once"], ["top", "--once", "--probe", str(probe)], ["stats", "--prometheus"]):
                r = client("tiermem.cli.main", *args, "--socket", str(svc.socket_path), tmp_path=tmp_path)
                assert r.returncode == 0 and r.stderr.splitlines()[-1] == "no torch", (args, r.stderr)
                if args[0] == "top":
                    assert "plan against the last step (bound: CPU AdamW)" in r.stdout, r.stdout
                    assert "PCIe to the GPU" in r.stdout and ("55.13" in r.stdout) == ("--probe" in args), r.stdout
        finally:
            theirs.close()
            svc.shutdown()
            svc.release()
