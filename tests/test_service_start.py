"""`tiermem serve` at start: its config checked against the machine (a DRAM budget larger than the arena's
filesystem, a CUDA device the machine lacks: one line, exit 2), and `--metrics-port` serving Prometheus
metrics over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.procs import ROOT, child_env
from tiermem.cli.main import main as tiermem_main


def _config(tmp_path: Path, dram: dict, device: str = "cpu") -> Path:
    (tmp_path / "shm").mkdir(exist_ok=True)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"name": f"t{os.getpid()}-start", "placement": {"param": "dram"},
                                    "tiers": {"gpu": {"device": device},
                                              "dram": {"path": str(tmp_path / "shm"), **dram}}}))
    return path


def test_config_is_checked_against_the_machine(tmp_path, capsys):
    sock = Path(tempfile.mkdtemp(prefix="tm-")) / "s.sock"
    st = os.statvfs(tmp_path)
    too_big = f"{st.f_blocks * st.f_frsize * 2}"
    for dram, device, needle in (({"budget": too_big}, "cpu", "larger than the filesystem of"),
                                 ({"budget": "64MiB"}, "cuda:64", "set device: cpu")):
        path = _config(tmp_path, dram, device)
        assert tiermem_main(["serve", "--config", str(path), "--socket", str(sock)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tiermem: error: {path}: tiers.") and err.count("\n") == 1 and needle in err, err
        assert not list((tmp_path / "shm").iterdir()) and not sock.exists(), "nothing was made"


@pytest.mark.slow
def test_metrics_port_serves_prometheus_text(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = Path(tempfile.mkdtemp(prefix="tm-")) / "s.sock"
    cmd = [sys.executable, "-m", "tiermem.cli", "serve", "--config", str(_config(tmp_path, {"budget": "64MiB"})),
           "--socket", str(sock), "--metrics-port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline, text = time.time() + 60, ""
        while "tiermem_up 1.0" not in text:
            assert proc.poll() is None and time.time() < deadline, (proc.stdout.read() if proc.poll() else text)
            time.sleep(0.1)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                continue
        # an idle service (no run attached yet) has no tiers to show: the families are there, empty
        for name in ("tier_capacity_bytes gauge", "link_bytes_total counter", "wait_seconds_total counter"):
            assert f"# TYPE tiermem_{name}" in text, text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs" / "tiermem").glob("*.yaml")))
def test_the_bundled_service_configs_run_on_this_machine(name):
    """Each bundled service config is taken as written here, with or without a GPU (device auto: CUDA when
    there is one, else the CPU stand-in); a pinned `device: cuda` was refused on a machine without CUDA."""
    from tiermem.plan.resolve import compute_device
    from tiermem.service.config import service_config

    cfg = service_config(str(ROOT / "configs" / "tiermem" / name))
    assert cfg.tiers.device_tier.device == "auto" and cfg.tiers.dram.path != "anonymous" and cfg.name
    assert compute_device(cfg).type == ("cuda" if torch_cuda() else "cpu")


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
