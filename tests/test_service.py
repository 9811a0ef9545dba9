"""The service end to end on the CPU: `tiermem serve`, trainers attached with tiermem_server, kill -9 of
the trainer (forward, backward, optimizer) and of the service (mid-update), SIGTERM, SIGHUP
re-placement, the state lost to a "reboot", a hostile peer, and top/stats over the socket. Every attached
run must end with weights bit-identical to the same run embedded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.procs import child_env, ctrl_c_works
from tests.tiny_models import tiny_run
from tiermem.service import protocol
from trainer.cli import main

pytestmark = pytest.mark.slow  # services in subprocesses: `pytest -m "not slow"` skips them

ROOT = Path(__file__).resolve().parent.parent
PLACEMENT = {"param": "dram", "grad": "dram", "master": "dram", "exp_avg": "nvme", "exp_avg_sq": "dram"}
DRAM = dict.fromkeys(PLACEMENT, "dram")


class Service:
    """A `tiermem serve` subprocess whose output is collected line by line."""

    def __init__(self, config: Path, sock: Path, env: dict | None = None, fresh: bool = False):
        self.lines: list[str] = []
        cmd = [sys.executable, "-m", "tiermem.cli", "serve", "--config", str(config), "--socket", str(sock)]
        self.proc = subprocess.Popen(cmd + (["--fresh"] if fresh else []), cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=child_env(**(env or {})))
        threading.Thread(target=self._collect, daemon=True).start()
        self.wait_for("listening on")

    def _collect(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, needle: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while needle not in self.text:
            assert self.proc.poll() is None or needle in self.text, f"service exited:\n{self.text}"
            assert time.time() < deadline, f"no {needle!r} in:\n{self.text}"
            time.sleep(0.02)

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


@pytest.fixture
def env(tmp_path):
    base = tiny_run(tmp_path)
    sock_dir = Path(tempfile.mkdtemp(prefix="tm-"))  # short: Unix socket paths are limited to 107 bytes
    (tmp_path / "shm").mkdir()

    def service_config(placement=PLACEMENT, device="cpu", shm=None, share="auto", cpu_groups="spread",
                       durability="checkpoint", gpu_budget=None) -> Path:
        path = tmp_path / "serve.yaml"
        gpu = {"device": device, **({"budget": gpu_budget} if gpu_budget else {})}
        path.write_text(yaml.safe_dump({
            "name": f"t{os.getpid()}", "placement": placement, "durability": durability,
            "optimizer": {"gpu_share": share, "cpu_groups": cpu_groups},
            "tiers": {"gpu": gpu, "dram": {"path": str(shm or tmp_path / "shm"), "budget": "64MiB"},
                      "nvme": {"path": str(tmp_path / "nvme"), "budget": "64MiB", "backend": "posix"}}}))
        return path

    def train_config(name: str, attached: bool = True, device: str = "cpu", **over) -> Path:
        cfg = dict(base, output_dir=str(tmp_path / name), **over)
        if attached:
            cfg["tiermem_server"] = str(sock_dir / "s.sock")
        else:
            cfg["tiermem"] = {"tiers": {"gpu": {"device": device}, "dram": {"budget": "64MiB"}},
                              "optimizer": {"gpu_share": 0}}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    class Env:
        tmp, sock = tmp_path, sock_dir / "s.sock"

        def service(self, placement=PLACEMENT, device="cpu", shm=None, share="auto", cpu_groups="spread",
                    durability="checkpoint", gpu_budget=None, **kw) -> Service:
            return Service(service_config(placement, device, shm, share, cpu_groups, durability, gpu_budget),
                           self.sock, **kw)

        def reference(self, device="cpu", **over) -> dict:
            name = f"embedded-{device}" + "".join(f"-{k}" for k in over)
            if not (tmp_path / name / "model.safetensors").is_file():
                assert main([str(train_config(name, attached=False, device=device, **over))]) == 0
            return load_file(tmp_path / name / "model.safetensors")

        def train(self, name: str, kill_at: str | None = None, extra_env: dict | None = None,
                  **over) -> subprocess.CompletedProcess:
            cfg = train_config(name, **over)
            env = child_env(**(extra_env or {}))
            if kill_at:
                env["TIERMEM_TEST_KILL_AT"] = kill_at
            return subprocess.run([sys.executable, "-m", "trainer.cli", str(cfg)], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=300)

        def start_train(self, name: str, extra_env: dict | None = None, **over) -> subprocess.Popen:
            cfg = train_config(name, **over)
            return subprocess.Popen([sys.executable, "-m", "trainer.cli", str(cfg)], cwd=ROOT, text=True,
                                    env=child_env(**(extra_env or {})), preexec_fn=ctrl_c_works,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        def weights(self, name: str) -> dict:
            return load_file(tmp_path / name / "model.safetensors")

    yield Env()
    for p in (tmp_path / "shm").glob("*"):
        p.unlink()
    shutil.rmtree(sock_dir, ignore_errors=True)


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def losses(out: Path) -> list[tuple[int, float, float]]:
    """A run's trainer_log: (step, loss, grad_norm) of each line."""
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [(r["current_steps"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


# the update's split: every group by the service's CPU AdamW (gpu_share 0, the default without CUDA), or half
# of the groups by the trainer's GPU worker, which writes their new state out of place to places the service
# hands out (with CUDA the default is 0.85; here the "GPU" is the CPU stand-in)
SHARES = pytest.mark.parametrize("share", [0, 0.5])


@SHARES
def test_trainer_killed_in_forward_backward_and_optimizer_continues_bit_identically(env, share):
    ref = env.reference()
    svc = env.service(share=share, env={"TIERMEM_TEST_SLOW_UPDATE": "0.03"})  # the update outlives the trainer
    try:
        straight = env.train("straight")
        assert straight.returncode == 0, straight.stderr
        assert "(a new run)" in straight.stdout
        assert same(env.weights("straight"), ref)
        # each point once over the two shares (the suite's time): at share 0.5 group 0 is the trainer's GPU
        # worker's, killed with its update 3 written, not journaled
        points = [("backward:3", 2), ("update:3:0", 3)] if share else [("forward:3", 2), ("optimizer:3", 3)]
        for point, resumes_at in points:
            name = point.replace(":", "")
            killed = env.train(name, kill_at=point)
            assert killed.returncode == -signal.SIGKILL, killed.stderr
            again = env.train(name)
            assert again.returncode == 0, again.stderr
            assert f"continuing the service's run at step {resumes_at}" in again.stdout, again.stdout
            assert same(env.weights(name), ref), point
            # every step has its line, with the uninterrupted run's figures (a step the killed trainer had
            # committed but not logged too: its figures were kept in trainer_log.pending.jsonl)
            assert losses(env.tmp / name) == losses(env.tmp / "straight"), point
            assert not (env.tmp / name / "trainer_log.pending.jsonl").exists()  # removed at the end
        assert "finished at step 6" in svc.text
        if share:  # the service updated what the killed trainers had left of their share
            assert "groups the trainer left" in svc.text
    finally:
        assert svc.stop() == 0
    assert not list((env.tmp / "shm").glob("*.arena"))  # every run finished: nothing left behind


def test_with_cpu_groups_last_the_trainer_takes_the_first_groups_and_the_run_is_bit_identical(env):
    """optimizer.cpu_groups: last in the service's config: the trainer's GPU worker updates the first two of
    the tiny model's five groups (embed, 0-2, head: embed and 0), the service the ones the next forward
    needs last; the weights are the embedded run's."""
    ref = env.reference()
    svc = env.service(share=0.5, cpu_groups="last")
    try:
        run = env.train("last")
        assert run.returncode == 0, run.stderr
        assert "this trainer's GPU updates 2 of 5 groups (embed, 0), the service the others" in run.stdout
        assert same(env.weights("last"), ref)
    finally:
        assert svc.stop() == 0


def test_the_service_plans_a_run_from_its_trainers_step(env):
    """placement auto in the service's config: the trainer sends its step's workload, the service plans the run
    as an embedded run is planned (HBM a tier: the tiny model's state all there, in the service's own block; the
    layers that keep their activations, skipping the recompute, chosen with it) and both say the plan; the trainer
    keeps those layers' activations and the weights are the embedded run's. A trainer killed mid-update (group 0's
    new state written in the service's HBM, not flipped to) is continued by the same command, bit-identically."""
    ref = env.reference()
    svc = env.service(placement="auto")
    try:
        run = env.train("planned")
        assert run.returncode == 0, run.stderr
        assert "plan: predicted step" in run.stdout, run.stdout
        assert "plan: gpu " in run.stdout and "store: gpu: " in run.stdout, run.stdout  # (the service's HBM)
        assert "; the activations of layers 0-2 kept (no recompute)" in run.stdout, run.stdout
        args = yaml.safe_load((env.tmp / "planned" / "training_args.yaml").read_text())
        assert args["tiermem_keep_activations"] == 3  # (what the trainer's executor kept)
        svc.wait_for("planned for ")  # (the figures it planned for named: on a CPU, the H200's, said so)
        assert " pass a step" in svc.text and "pass(es)" not in svc.text, svc.text
        assert ("planned for the H200 machine's figures (no GPU here" in svc.text) == (not torch_cuda()), svc.text
        assert same(env.weights("planned"), ref)
        killed = env.train("killed", kill_at="update:3:0")
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        again = env.train("killed")
        assert again.returncode == 0, again.stderr
        assert "continuing the service's run at step 3" in again.stdout, again.stdout
        assert "the activations of layers 0-2 kept" in again.stdout, again.stdout
        assert same(env.weights("killed"), ref)
        assert losses(env.tmp / "killed") == losses(env.tmp / "planned")
    finally:
        assert svc.stop() == 0


@pytest.mark.parametrize("share,group,placement", [(0, 1, PLACEMENT), (0.5, 1, PLACEMENT), (0.5, 0, DRAM)])
def test_service_killed_mid_update_recovers_and_the_run_ends_bit_identically(env, share, group, placement):
    ref = env.reference()
    # group's update 3 written, not journaled. Group 1 is the service's CPU worker's: with all its state in
    # DRAM it is written out of place (the old state stays whole), with exp_avg on NVMe it is updated in
    # place behind the undo copy, which goes back. At share 0.5 group 0 is the trainer's GPU worker's,
    # written out of place; the trainer's flip request is what the service dies in. Then the update is redone.
    svc = env.service(placement=placement, share=share, env={"TIERMEM_TEST_KILL_AT": f"update:3:{group}"})
    lost = env.train("run")
    assert svc.proc.wait(timeout=60) == -signal.SIGKILL
    assert lost.returncode == 1 and "lost the tiermem service" in lost.stderr, lost.stderr
    assert len(lost.stderr.strip().splitlines()) == 1
    svc = env.service(placement=placement, share=share)
    try:
        undone = "put back group 1 as it was before update 3" in svc.text
        assert undone == (placement is PLACEMENT and group == 1), svc.text
        assert "finishing update 3 of" in svc.text
        assert "recovered run" in svc.text and "step 3 committed" in svc.text
        again = env.train("run")
        assert again.returncode == 0, again.stderr
        assert "continuing the service's run at step 3" in again.stdout
        assert same(env.weights("run"), ref)
    finally:
        assert svc.stop() == 0


@pytest.mark.parametrize("placement", [DRAM, PLACEMENT])
def test_bf16_service_killed_mid_update_recovers(env, placement):
    """bf16 with fp32 master weights: CPU AdamW writes the new master and moments out of place (all in
    DRAM) or, with exp_avg on NVMe, updates in place behind the undo copy (master, moments and gradient);
    the redo rewrites the bf16 compute copy from the old master."""
    ref = env.reference(bf16=True)
    svc = env.service(placement=placement, env={"TIERMEM_TEST_KILL_AT": "update:4:2"})
    lost = env.train("run", bf16=True)
    assert svc.proc.wait(timeout=60) == -signal.SIGKILL and lost.returncode == 1
    svc = env.service(placement=placement)
    try:
        assert ("put back group 2 as it was before update 4" in svc.text) == (placement is PLACEMENT)
        again = env.train("run", bf16=True)
        assert again.returncode == 0, again.stderr
        assert same(env.weights("run"), ref)
    finally:
        svc.stop()


def _wait_for_steps(trainer: subprocess.Popen, log: Path, n: int) -> None:
    deadline = time.time() + 120
    while not (log.is_file() and len(log.read_text().splitlines()) >= n):
        assert trainer.poll() is None, trainer.stderr.read()
        assert time.time() < deadline
        time.sleep(0.05)


def test_overwrite_output_dir_starts_the_services_run_afresh_as_an_embedded_run_does(env):
    """A trainer killed mid-run leaves its run in the service; the same command with overwrite_output_dir: true
    (Hugging Face's meaning: start afresh in that output_dir) discards it, says so in one note, and trains from
    step 0 to the uninterrupted run's weights; without it, the run continues where it was."""
    ref = env.reference()
    svc = env.service(env={"TIERMEM_TEST_SLOW_UPDATE": "0.03"})
    try:
        assert env.train("run", kill_at="forward:3").returncode == -signal.SIGKILL
        again = env.train("run", overwrite_output_dir=True)
        assert again.returncode == 0, again.stderr
        assert "(a new run)" in again.stdout and "continuing the service's run" not in again.stdout, again.stdout
        assert again.stdout.count("note: overwrite_output_dir: the service's run of this output_dir (at step 2) is "
                                  "discarded; this run starts at step 0") == 1, again.stdout
        assert "discarded at step 2: its trainer starts it afresh" in svc.text, svc.text
        assert same(env.weights("run"), ref)
        assert env.train("other", kill_at="forward:3").returncode == -signal.SIGKILL
        kept = env.train("other")  # (overwrite_output_dir unset: the service's run goes on)
        assert kept.returncode == 0 and "continuing the service's run at step 2" in kept.stdout, kept.stdout
        assert "discarded" not in kept.stdout
    finally:
        assert svc.stop() == 0


@SHARES
def test_sigterm_and_ctrl_c_stop_cleanly_and_training_continues(env, share):
    """At share 0.5 the SIGTERM lands while the trainer owes group 0 of update 2 (its GPU worker is held
    before the flip): the service finishes it itself before it stops."""
    ref = env.reference()
    svc = env.service(share=share, env={"TIERMEM_TEST_SLOW_UPDATE": "0.1"})
    trainer = env.start_train("run", extra_env={"TIERMEM_TEST_HOLD_AT": "update:2:0"})
    log = env.tmp / "run" / "trainer_log.jsonl"
    _wait_for_steps(trainer, log, 2)
    assert svc.stop(signal.SIGTERM) == 0  # the service: SIGTERM
    assert "kept at step 2" in svc.text
    if share:
        assert "finishing update 2 of 2 groups the trainer left" in svc.text, svc.text
        trainer.kill()  # its held thread would keep it from exiting
        trainer.communicate(timeout=60)
    else:
        _, err = trainer.communicate(timeout=60)
        assert trainer.returncode == 1 and "lost the tiermem service" in err
    svc = env.service(share=share, env={"TIERMEM_TEST_SLOW_UPDATE": "0.1"})
    try:
        assert "recovered run" in svc.text and "finishing" not in svc.text  # update 2 was whole at the stop
        other = env.train("other", learning_rate=5e-3)  # another run while this one is held: refused
        assert other.returncode == 2 and "holds another run" in other.stderr, other.stderr
        # held before committing step 5 at the latest, so the Ctrl-C lands inside the run however fast it goes
        trainer = env.start_train("run", extra_env={"TIERMEM_TEST_HOLD_AT": "commit:5"})
        _wait_for_steps(trainer, log, 4)
        trainer.send_signal(signal.SIGINT)  # the trainer: Ctrl-C
        _, err = trainer.communicate(timeout=60)
        assert trainer.returncode == 130, err
        again = env.train("run")
        assert again.returncode == 0, again.stderr
        assert same(env.weights("run"), ref)
    finally:
        svc.stop()


def test_state_lost_with_the_arena_names_the_newest_checkpoint(env):
    """The service names the checkpoint to resume from, and the trainer resumes from it (overwrite_output_dir
    unset; set, it starts over: tests/test_lost_run.py)."""
    ref = env.reference()
    svc = env.service(env={"TIERMEM_TEST_KILL_AT": "update:5:0"})
    # the service dies while the trainer still writes checkpoint-4 (read out of the store before
    # update 5 could start): the trainer finishes writing it before it stops
    lost = env.train("run", save_steps=2, extra_env={"TIERMEM_TEST_SLOW_SAVE": "0.4"})  # (outlasts a step under load)
    assert svc.proc.wait(timeout=60) == -signal.SIGKILL and lost.returncode == 1
    assert "saved checkpoint-4 before stopping" in lost.stdout, lost.stdout + lost.stderr
    for arena in (env.tmp / "shm").glob("*.arena"):  # what a reboot does to a tmpfs
        arena.unlink()
    svc = env.service()
    try:
        assert "is gone" in svc.text and "checkpoint-4" in svc.text, svc.text
        again = env.train("run", save_steps=2)  # a new run, from checkpoint-4
        assert again.returncode == 0, again.stderr
        assert "resumed from" in again.stdout and "checkpoint-4 at step 4" in again.stdout, again.stdout
        assert same(env.weights("run"), ref)
    finally:
        svc.stop()


def test_a_non_finite_step_is_not_committed_and_the_service_says_why(env):
    """An attached trainer whose step 2 has a non-finite gradient norm stops with one line and exit 2
    without committing it; the service says why and keeps step 1: a rerun continues at step 1 and stops at
    step 2 again."""
    svc = env.service()
    try:
        for attempt in range(2):
            run = env.train("nan", learning_rate=1e35, lr_scheduler_type="constant", max_steps=4)
            assert run.returncode == 2, run.stderr
            assert run.stderr.startswith("tiermem-train: error: step 2: gradient norm is "), run.stderr
            assert run.stderr.count("\n") == 2, run.stderr  # (the second: where it stopped, the way on)
            assert run.stderr.splitlines()[1].startswith("tiermem-train: stopped at step 1 of 4; the service keeps "
                                                         "the run's state: continue with: tiermem-train "), run.stderr
            if attempt:
                assert "continuing the service's run at step 1" in run.stdout, run.stdout
            deadline = time.time() + 30
            while svc.text.count("the run stays at step 1") <= attempt and time.time() < deadline:
                time.sleep(0.05)
        assert svc.text.count("step 2: gradient norm is") == 2, svc.text
        assert svc.text.count("the run stays at step 1") == 2, svc.text
    finally:
        assert svc.stop() == 0


def test_weights_an_update_of_the_service_made_inf_stop_the_trainer_in_one_line(env):
    """The service's update 1 makes weights inf (a learning rate of 1e38): the trainer's step 2 finds its loss not
    finite, finds which group's weights are not, says so in one line and exports nothing; the service keeps the run
    at the step it committed (its CPU AdamW does not check what it writes: tiermem.optim.store_adamw)."""
    svc = env.service()
    try:
        run = env.train("inf", learning_rate=1e38, max_steps=2, warmup_steps=0)
        assert run.returncode == 2 and run.stderr.count("\n") == 2, run.stderr  # (and where it stopped)
        assert run.stderr.startswith("tiermem-train: error: update 1 made weights of group "), run.stderr
        assert not (env.tmp / "inf" / "model.safetensors").exists()
        svc.wait_for("the run stays at step 1")
    finally:
        svc.stop()


@pytest.mark.parametrize("share", [0.5])  # (the trainer's GPU worker beside the moves; share 0 adds no path)
def test_sighup_moves_optimizer_state_between_tiers_while_training(env, share):
    from tiermem.cli.top import read_service

    ref = env.reference()
    # the service dies in the last update (6), well after the re-placement at the first commit after SIGHUP:
    # the moved places must be what the restarted service finds
    svc = env.service(placement=dict(PLACEMENT, exp_avg="dram"), share=share,
                      env={"TIERMEM_TEST_SLOW_UPDATE": "0.1", "TIERMEM_TEST_KILL_AT": "update:6:0"})
    try:
        trainer = env.start_train("run")
        svc.wait_for("attached to run")
        (env.tmp / "serve.yaml").write_text((env.tmp / "serve.yaml").read_text().replace("exp_avg: dram",
                                                                                         "exp_avg: nvme"))
        svc.proc.send_signal(signal.SIGHUP)
        svc.wait_for("re-placed: exp_avg of")
        snap = read_service(env.sock)
        assert snap["store"]["tiers"]["nvme"]["by_kind"].get("exp_avg", 0) > 0
        assert "exp_avg" not in snap["store"]["tiers"]["dram"]["by_kind"]
        assert svc.proc.wait(timeout=120) == -signal.SIGKILL
        _, err = trainer.communicate(timeout=120)
        assert trainer.returncode == 1, err  # it lost the service
        svc = env.service(placement=dict(PLACEMENT, exp_avg="nvme"), share=share)
        again = env.train("run")
        assert again.returncode == 0, again.stderr
        assert same(env.weights("run"), ref)
    finally:
        svc.stop()


def _exchange(sock_path: Path, raw: bytes) -> dict | None:
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(sock_path))
    try:
        s.sendall(raw)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused at once (another uid): the refusal is still there to read
    try:
        return protocol.recv(s)
    finally:
        s.close()


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def test_bad_peers_are_refused_and_the_trainer_is_not_disturbed(env):
    ref = env.reference()
    svc = env.service(env={"TIERMEM_TEST_SLOW_UPDATE": "0.2"})  # the run outlasts the hostile peers
    try:
        trainer = env.start_train("run")
        svc.wait_for("attached to run")
        record = json.loads(next((env.tmp / "nvme").glob("*.run.json")).read_text())
        cases = [
            (b"\x00\x00\x00\x05hello", "not UTF-8 JSON"),
            (b"\xff\xff\xff\xff" + b"x" * 64, "exceeds"),
            (_frame([1, 2]), "not a JSON object"),
            (_frame({"op": "explode", "id": 1}), "unknown op"),
            (_frame({"op": "commit", "id": 2, "run": record["run"], "step": 3, "lr": 1.0}), "not the run's trainer"),
            (_frame({"op": "layout", "id": 3, "run": "someone-else"}), "for run"),
            (_frame({"op": "hello", "id": 4, "run": "another-run", "specs": [], "optim": {}}), "another run"),
            (_frame({"op": "hello", "id": 5, "run": record["run"], "specs": [], "optim": {}}),
             "already has a trainer attached"),
        ]
        for raw, needle in cases:
            reply = _exchange(env.sock, raw)
            assert reply is not None and reply["ok"] is False and needle in reply["error"], (needle, reply)
        if os.getuid() == 0:  # a peer of another user: really, by switching user in a child process
            os.chmod(env.sock.parent, 0o755)
            os.chmod(env.sock, 0o666)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                try:
                    os.setuid(65534)
                    reply = _exchange(env.sock, _frame({"op": "stats", "id": 1}))
                except BaseException as e:  # noqa: BLE001 - reported to the parent
                    reply = {"child_error": repr(e)}
                try:
                    os.write(w, json.dumps(reply).encode())
                finally:
                    os._exit(0)
            os.close(w)
            os.waitpid(pid, 0)
            reply = json.loads(os.read(r, 65536).decode())
            assert "child_error" not in reply, reply
            assert reply["ok"] is False and "refused: uid 65534" in reply["error"]
        assert protocol.peer_allowed(os.getuid()) and not protocol.peer_allowed(os.getuid() + 1)
        _, err = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, err
        assert same(env.weights("run"), ref)
    finally:
        svc.stop()


def test_top_and_stats_over_the_socket(env):
    svc = env.service(share=0.5)
    cli = lambda *a: subprocess.run([sys.executable, "-m", "tiermem.cli", *a, "--socket", str(env.sock)], cwd=ROOT,
                                    capture_output=True, text=True, timeout=60)
    try:
        idle = cli("top", "--once")
        assert idle.returncode == 0 and "idle, no run" in idle.stdout, idle.stderr
        # the trainer is held before committing step 4, so the run lasts while it is watched however fast
        # the machine is
        trainer = env.start_train("run", max_steps=12, extra_env={"TIERMEM_TEST_HOLD_AT": "commit:4"})
        log = env.tmp / "run" / "trainer_log.jsonl"
        deadline = time.time() + 120
        while len(log.read_text().splitlines() if log.is_file() else []) < 3:
            assert time.time() < deadline and trainer.poll() is None
            time.sleep(0.05)
        time.sleep(0.6)  # step 3's progress message has reached the service
        frame = cli("top", "--once")
        assert frame.returncode == 0, frame.stderr
        for needle in ("service on", "trainer pid", "committed step", "dram", "nvme", "step ", "loss",
                       "at full overlap"):
            assert needle in frame.stdout, (needle, frame.stdout)
        snap = json.loads(cli("stats", "--json").stdout)
        assert snap["service"]["trainer_pid"] == trainer.pid and snap["run"]["total_steps"] == 12
        assert snap["run"]["optimizer"]["gpu_share"] == 0.5 and snap["run"]["optimizer"]["committed"] == 3
        assert snap["run"]["step"] == 3 and snap["run"]["loss"] > 0
        prom = cli("stats", "--prometheus").stdout
        assert 'tiermem_tier_used_bytes{kind="exp_avg",tier="nvme"}' in prom, prom
        assert "tiermem_train_step 3" in prom, prom
        # the trainer's own stats file leaves the shared tiers' free space to the service
        own = json.loads((env.tmp / "run" / "tiermem_stats.json").read_text())["store"]["tiers"]
        theirs = snap["store"]["tiers"]
        for name in ("dram", "nvme"):
            assert own[name]["owner"] == "service" and own[name]["free"] is None, own[name]
            assert own[name]["used"] == sum(own[name]["by_kind"].values()) > 0
            t = theirs[name]
            assert t["free"] == t["capacity"] - t["used"] and "owner" not in t
    finally:
        if "trainer" in locals():
            trainer.kill()
            trainer.communicate()
        svc.stop()
    gone = cli("stats", "--json")
    assert gone.returncode == 2 and "no tiermem service at" in gone.stderr


def ok(reply: dict) -> dict:
    assert reply["ok"], reply
    return reply


def _unit_service(tmp_path, share):
    """An in-process service over a one-tensor model, a trainer connection and another one."""
    from tiermem.service.runs import Client
    from tiermem.service.server import Service as Svc
    from tiermem.specs import TensorSpec
    from tiermem.store.layout import spec_to_json

    (tmp_path / "shm").mkdir()
    cfg = tmp_path / "serve.yaml"
    # the CPU stand-in, also on a GPU machine (where the arena would be pinned, which a disk directory refuses)
    cfg.write_text(yaml.safe_dump({"name": "unit", "tiers": {"gpu": {"device": "cpu"},
                                                             "dram": {"path": str(tmp_path / "shm"), "budget": "1MiB"}},
                                   "placement": "auto", "optimizer": {"gpu_share": share}}))
    svc = Svc(str(cfg), str(tmp_path / "s.sock"), say=lambda _: None)
    mine, theirs = socket.socketpair()
    client, other = Client(mine), Client(socket.socketpair()[0])
    specs = [TensorSpec(n, (4, 4), __import__("torch").float32, k, 0) for n, k in
             (("w", "param"), ("grad/w", "grad"), ("exp_avg/w", "exp_avg"), ("exp_avg_sq/w", "exp_avg_sq"))]
    optim = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "has_master": False, "decay": {"w": True},
             "groups": [0]}
    hello = {"op": "hello", "id": 1, "run": "r1", "specs": [spec_to_json(s) for s in specs], "optim": optim}

    def err(c, msg) -> str:
        reply = svc.dispatch(c, msg)
        assert reply["ok"] is False and reply["id"] == msg.get("id"), reply
        return reply["error"]

    return svc, client, other, theirs, hello, err


def test_requests_are_checked_one_by_one(tmp_path):
    """In-process: malformed specs, unknown tensor names, out-of-order and foreign messages get an error
    reply each, and the run goes on."""
    from tiermem.store.layout import spec_from_json, spec_to_json

    svc, client, other, theirs, hello, err = _unit_service(tmp_path, 0)
    specs = [spec_from_json(x) for x in hello["specs"]]
    bad = dict(hello, specs=[dict(spec_to_json(specs[0]), dtype="float8")])
    assert "unknown dtype" in err(client, bad)
    assert "bad shape" in err(client, dict(hello, specs=[dict(spec_to_json(specs[0]), shape=[-1])]))
    assert "missing or of the wrong type" in err(client, dict(hello, specs="all of them"))
    assert "which groups it owns" in err(client, dict(hello, world=2))
    assert "0 <= rank < world" in err(client, dict(hello, world=2, rank=2, owns=[]))
    assert "'fresh' must be true or false" in err(client, dict(hello, fresh="yes"))
    ok(svc.dispatch(client, hello))
    assert "unknown tensor names: nope" in err(client, {"op": "layout", "id": 2, "run": "r1", "names": ["w", "nope"]})
    assert svc.dispatch(client, {"op": "layout", "id": 3, "run": "r1", "names": ["w"]})["layout"]["w"][0] == "dram"
    assert "commit before init" in err(client, {"op": "commit", "id": 4, "run": "r1", "step": 1, "lr": 0.1})
    assert svc.dispatch(client, {"op": "init", "id": 5, "run": "r1", "step": 0})["ok"]
    assert "out of order" in err(client, {"op": "commit", "id": 6, "run": "r1", "step": 2, "lr": 0.1})
    assert "wrong type" in err(client, {"op": "commit", "id": 7, "run": "r1", "step": 1, "lr": "fast"})
    assert "is for run" in err(client, {"op": "commit", "id": 8, "run": "r2", "step": 1, "lr": 0.1})
    assert "not the run's trainer" in err(other, {"op": "commit", "id": 9, "run": "r1", "step": 1, "lr": 0.1})
    assert svc.dispatch(client, {"op": "commit", "id": 10, "run": "r1", "step": 1, "lr": 0.1})["ok"]
    svc.run.wait()
    assert svc.run.state.updated == 1 and svc.run.store.catalog.version(0) == 1
    assert "finish before" not in str(svc.dispatch(client, {"op": "finish", "id": 11, "run": "r1"}))
    # the finished run's state is freed; the store's lock file stays (tiermem.service.owner: removing it would race)
    assert svc.run is None and [p.name for p in (tmp_path / "shm").glob("*")] == ["unit.lock"]
    theirs.close()


def test_the_trainers_share_of_an_update_is_checked_and_taken_over_when_it_leaves(tmp_path):
    """In-process, every group the trainer's: places are handed out only for an owed group, a flip must
    name them, it journals and publishes the group; a trainer gone mid-update leaves its groups to the
    service, which frees the places it had handed out."""
    import torch

    from tiermem.tiers.extents import Extent

    svc, client, other, theirs, hello, err = _unit_service(tmp_path, 1)
    reply = ok(svc.dispatch(client, hello))
    assert reply["trainer_groups"] == [0] and reply["gpu_share"] == 1
    assert svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0})["ok"]
    assert "not owed" in err(client, {"op": "alloc", "id": 3, "run": "r1", "step": 1, "group": 0})
    assert svc.dispatch(client, {"op": "commit", "id": 4, "run": "r1", "step": 1, "lr": 0.1})["ok"]
    assert "not owed" in err(client, {"op": "alloc", "id": 5, "run": "r1", "step": 1, "group": 7})
    assert "not the run's trainer" in err(other, {"op": "alloc", "id": 6, "run": "r1", "step": 1, "group": 0})
    places = svc.dispatch(client, {"op": "alloc", "id": 7, "run": "r1", "step": 1, "group": 0})["places"]
    assert set(places) == {"w", "exp_avg/w", "exp_avg_sq/w"}
    old = svc.dispatch(client, {"op": "layout", "id": 8, "run": "r1"})["layout"]
    assert all(places[n][0] != old[n][1] for n in places)  # new places, the old state untouched
    forged = dict(places, w=[old["w"][1], old["w"][2]])
    assert "did not allocate" in err(client, {"op": "flip", "id": 9, "run": "r1", "step": 1, "group": 0,
                                              "places": forged})
    store = svc.run.store
    for off, nbytes in places.values():  # what the trainer's GPU worker writes there
        store.dram.view(Extent(off, nbytes))[:64].copy_(torch.full((4, 4), 2.0).view(torch.uint8).reshape(-1))
    assert svc.dispatch(client, {"op": "flip", "id": 10, "run": "r1", "step": 1, "group": 0, "places": places})["ok"]
    svc.run.wait()
    assert svc.run.state.updated == 1 and store.catalog.version(0) == 1
    assert (store.read("w").result() == 2.0).all()
    assert "not owed" in err(client, {"op": "flip", "id": 11, "run": "r1", "step": 1, "group": 0, "places": places})
    # update 2: places handed out, then the trainer is gone: the service updates group 0 itself
    assert svc.dispatch(client, {"op": "commit", "id": 12, "run": "r1", "step": 2, "lr": 0.1})["ok"]
    free = store.dram.allocator.free_bytes()
    assert svc.dispatch(client, {"op": "alloc", "id": 13, "run": "r1", "step": 2, "group": 0})["ok"]
    assert store.dram.allocator.free_bytes() < free
    with svc.lock:
        svc.run.trainer = None
        svc._trainer_left(svc.run)
    svc.run.wait()
    assert svc.run.state.updated == 2 and store.catalog.version(0) == 2
    assert store.dram.allocator.free_bytes() == free
    svc._close_run(keep=False)
    theirs.close()



def test_a_trainer_attaching_after_the_services_redo_failed_is_told_so_in_one_line(tmp_path):
    """In-process: the trainer leaves owing update 1 and the service's redo of it fails (its weights not finite:
    a learning rate of 1e38). The next trainer's hello is refused with that error in one line, every time, instead
    of attaching to a run whose update never comes (the hello used to clear the error: the rerun then waited for
    group 0's version 1 for good); one that starts afresh (overwrite_output_dir) is let in."""
    import torch

    svc, client, other, theirs, hello, err = _unit_service(tmp_path, 1)
    ok(svc.dispatch(client, hello))
    ok(svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0}))
    svc.run.store.write("grad/w", torch.ones(4, 4)).result()
    ok(svc.dispatch(client, {"op": "commit", "id": 3, "run": "r1", "step": 1, "lr": 1e38}))
    with svc.lock:
        svc.run.trainer = None
        svc._trainer_left(svc.run)
    svc.run.wait()
    assert "inf or NaN" in str(svc.run.error), svc.run.error
    for n in (4, 5):  # (a second try is refused the same)
        said = err(other, dict(hello, id=n))
        assert said.startswith("update 1 of run ") and "failed in the service: " in said and "\n" not in said, said
        assert "inf or NaN" in said and said.endswith("restart the service: it recovers the last committed step")
        assert svc.run.trainer is None and svc.run.error
    reply = ok(svc.dispatch(other, dict(hello, id=6, fresh=True)))  # (overwrite_output_dir: the run starts afresh)
    assert reply["replaced"] == 1 and not reply["initialized"] and svc.run.error is None
    svc._close_run(keep=False)
    theirs.close()


def test_a_rerun_after_the_services_redo_failed_stops_in_one_line_and_does_not_hang(env):
    """End to end: the trainer is killed with its GPU worker's update 1 of group 0 written, not journaled; the
    service's redo finds the new weights not finite (a learning rate of 1e38). The same command again stops with
    one line and exit code 2 (it used to wait for group 0's update 1 for good)."""
    svc = env.service(share=0.5)
    try:
        over = {"learning_rate": 1e38, "lr_scheduler_type": "constant", "warmup_steps": 0, "max_steps": 2}
        killed = env.train("failed", kill_at="update:1:0", **over)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        svc.wait_for("update 1 failed")
        proc = subprocess.Popen([sys.executable, "-m", "trainer.cli", str(env.tmp / "failed.yaml")], cwd=ROOT,
                                env=child_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=120)  # (a safety net: it hung for good before)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the rerun after a failed redo hangs:\n" + "".join(proc.communicate()))
        assert proc.returncode == 2, (out, err)
        assert err.startswith("tiermem-train: error: the tiermem service refused hello: update 1 of run "), err
        assert "inf or NaN" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in out + err, err
    finally:
        assert svc.stop() == 0

def test_the_ranks_of_a_run_of_several_each_take_the_groups_they_own(tmp_path):
    """In-process, a run of two ranks (the trainers' share: every group; group 0 owned by rank 0): rank 1 joins
    only after rank 0, gets no group of the update (places for group 0 are refused to it), may not commit, and
    leaves without detaching the run; rank 0 takes group 0."""
    svc, client, other, theirs, hello, err = _unit_service(tmp_path, 1)
    peer = dict(hello, rank=1, world=2, owns=[])
    assert "before rank 0" in err(other, peer)
    reply = ok(svc.dispatch(client, dict(hello, world=2, owns=[0], owners=[[0, 0]])))
    assert reply["trainer_groups"] == [0]
    assert "before rank 0" in err(other, dict(peer, world=3))  # (another world than rank 0's)
    assert ok(svc.dispatch(other, peer))["trainer_groups"] == []
    assert "already has rank 1" in err(other, peer)
    assert "only rank 0" in err(other, {"op": "init", "id": 2, "run": "r1", "step": 0})
    assert svc.dispatch(client, {"op": "init", "id": 3, "run": "r1", "step": 0})["ok"]
    assert "only rank 0" in err(other, {"op": "commit", "id": 4, "run": "r1", "step": 1, "lr": 0.1})
    assert svc.dispatch(client, {"op": "commit", "id": 5, "run": "r1", "step": 1, "lr": 0.1})["ok"]
    assert "not owed" in err(other, {"op": "alloc", "id": 6, "run": "r1", "step": 1, "group": 0})
    assert svc.dispatch(other, {"op": "layout", "id": 7, "run": "r1", "names": ["w"]})["ok"]
    assert svc.dispatch(client, {"op": "alloc", "id": 8, "run": "r1", "step": 1, "group": 0})["places"]
    assert "finish (or stop), not leave" in err(client, {"op": "leave", "id": 9, "run": "r1"})
    assert svc.dispatch(other, {"op": "leave", "id": 10, "run": "r1"})["ok"]
    assert svc.run.peers[1].done and svc.run.trainer is client
    with svc.lock:  # (rank 0 gone before its flip: the service updates group 0 itself)
        svc._detach(svc.run)
    svc.run.wait()
    assert svc.run.state.updated == 1 and not svc.run.peers
    svc._close_run(keep=False)
    theirs.close()


def test_cpu_adamw_writes_out_of_place_and_falls_back_to_the_undo_copy_without_room(tmp_path):
    """In-process, the service's CPU AdamW: update 1 finds no room in the arena and goes in place behind
    the undo copy (journal: begin, then done); update 2 writes out of place (journal: done with the new
    places). Both give torch.optim.AdamW's numbers; out of place the gradient keeps its bytes (the clip's
    unscale works on a copy)."""
    import torch

    from tiermem.tiers.extents import OutOfSpace

    svc, client, _, theirs, hello, _ = _unit_service(tmp_path, 0)
    ok(svc.dispatch(client, hello))
    store = svc.run.store
    w0, grads = torch.randn(4, 4), [torch.randn(4, 4), torch.randn(4, 4)]
    store.write("w", w0).result()
    assert svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0})["ok"]
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0)
    real = store.dram.allocate

    def full(nbytes):
        raise OutOfSpace("full")

    for step, grad in enumerate(grads, 1):
        store.write("grad/w", grad).result()
        store.dram.allocate = full if step == 1 else real
        assert svc.dispatch(client, {"op": "commit", "id": 2 + step, "run": "r1", "step": step, "lr": 0.1,
                                     "grad_scale": 2.0})["ok"]
        svc.run.wait()
        ref.grad = grad / 2.0
        opt.step()
        assert torch.allclose(store.read("w").result(), ref.detach(), rtol=0, atol=1e-6), step
        # in place the fused kernel unscales the gradient (the undo copy keeps it); out of place a copy takes it
        assert torch.equal(store.read("grad/w").result(), grad) == (step == 2)
    store.dram.allocate = real
    ops = [json.loads(line) for line in svc.journal_path.read_text().splitlines()]
    ops = [(r["op"], r.get("step"), "moves" in r) for r in ops if r["op"] in ("begin", "done")]
    assert ops == [("begin", 1, False), ("done", 1, False), ("done", 2, True)]
    assert svc.run.optimizer.no_room == 1 and svc.run.taken_count == 0  # for the finish line
    svc._close_run(keep=False)
    theirs.close()


def test_with_no_room_for_the_trainers_share_the_service_updates_it(tmp_path):
    """In-process, every group the trainer's, the arena full: asked for places, the service answers none
    and updates the group itself (CPU AdamW behind the undo copy); a trainer gone mid-update leaves a group
    the service's GPU worker finds no room for either, so its CPU worker takes it. Both give
    torch.optim.AdamW's numbers."""
    import torch

    from tiermem.tiers.extents import OutOfSpace

    svc, client, _, theirs, hello, err = _unit_service(tmp_path, 1)
    ok(svc.dispatch(client, hello))
    store = svc.run.store
    w0 = torch.randn(4, 4)
    store.write("w", w0).result()
    assert svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0})["ok"]
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0)

    def full(nbytes):
        raise OutOfSpace("full")

    store.dram.allocate = full
    said: list[str] = []
    svc.say = said.append
    for step in (1, 2):
        grad = torch.randn(4, 4)
        store.write("grad/w", grad).result()
        assert svc.dispatch(client, {"op": "commit", "id": 10 * step, "run": "r1", "step": step, "lr": 0.1})["ok"]
        if step == 1:
            reply = svc.dispatch(client, {"op": "alloc", "id": 11, "run": "r1", "step": 1, "group": 0})
            assert reply["ok"] and reply["places"] is None
            assert "not owed" in err(client, {"op": "flip", "id": 12, "run": "r1", "step": 1, "group": 0,
                                              "places": {}})
        else:
            with svc.lock:
                svc.run.trainer = None
                svc._trainer_left(svc.run)
        svc.run.wait()
        assert svc.run.state.updated == step and store.catalog.version(0) == step
        ref.grad = grad
        opt.step()
        assert torch.allclose(store.read("w").result(), ref.detach(), rtol=0, atol=1e-6), step
    ops = [json.loads(line)["op"] for line in svc.journal_path.read_text().splitlines()]
    assert ops.count("begin") == 2  # both in place behind the undo copy
    # the finish line counts them: the trainer's group taken, then in place on the service's CPU; the left
    # group, no room on the service's GPU worker, then in place on its CPU worker: two updates in place
    from tiermem.service.runs import no_room_note as _no_room

    assert (svc.run.taken_count, svc.run.optimizer.no_room) == (1, 2)
    assert [x for x in said if "no room" in x] == [  # (said once a run, when the trainer's first finds none)
        "update 1: no room for group 0's new state (full); the service updates such a group itself, in place (slower)"]
    assert _no_room(3, 1) == ("; 3 group updates went in place for want of room in the arena; 1 of the trainer's "
                              "were handed to the service for want of room") and _no_room(0, 0) == ""
    svc._close_run(keep=False)
    theirs.close()


def test_journal_replay_keeps_the_begun_group_while_another_finishes(tmp_path):
    from tiermem.service.journal import Journal

    j = Journal(tmp_path / "j")
    j.append("init", step=0, groups=[0, 1, "head"])
    j.append("commit", step=1, lr=0.5, grad_scale=None)
    j.append("begin", group=1, step=1)
    j.append("done", group=0, step=1, moves={"w0": ["dram", 4096, 4096, 0]})  # the GPU worker's group
    j.close()
    st = Journal(tmp_path / "j").state
    assert st.inflight == (1, 1) and st.versions == {0: 1, 1: 0, "head": 0} and st.committed == 1
    assert st.layout({"layout": {"w0": ["dram", 0, 4096]}, "epoch": 0}) == {"w0": ["dram", 4096, 4096]}
    assert st.layout({"layout": {"w0": ["dram", 0, 4096]}, "epoch": 1}) == {"w0": ["dram", 0, 4096]}
    j = Journal(tmp_path / "j")
    import tiermem.service.journal as journal

    before = j.state.to_json()
    journal.COMPACT_BYTES = 0
    try:
        j.compact()
    finally:
        journal.COMPACT_BYTES = 256 << 10
    j.append("done", group=1, step=1)
    j.close()
    assert len((tmp_path / "j").read_text().splitlines()) == 2  # the state line, then what came after
    st = Journal(tmp_path / "j").state
    assert before["versions"] == [[0, 1], [1, 0], ["head", 0]] and st.versions == {0: 1, 1: 1, "head": 0}
    assert st.inflight is None and st.moves == {"w0": ["dram", 4096, 4096, 0]}


def test_a_service_with_a_gpu_gives_its_cpu_the_last_groups(monkeypatch):
    """optimizer.cpu_groups: auto resolves in the service: last with a GPU (measured best there), spread
    on the CPU stand-in; an explicit value stays."""
    import torch

    from tiermem.config import load_store_config
    from tiermem.service.config import planning_config as _planning

    def planned(**optimizer):
        return _planning(load_store_config({"tiers": {"dram": {"path": "/dev/shm"}},
                                            "optimizer": optimizer})).optimizer.cpu_groups

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert planned() == "spread"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert planned() == "last" and planned(cpu_groups="spread") == "spread"


def test_serve_refuses_configs_a_service_cannot_use(tmp_path, capsys, monkeypatch):
    import torch

    from tiermem.cli.main import main as tiermem
    from tiermem.tiers.dram import on_disk

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine: the arena is pinned
    cases = {"anon": ({"tiers": {"dram": {"path": "anonymous"}}}, "must be a shared file"),
             "grad in hbm": ({"tiers": {"dram": {"path": str(tmp_path)}}, "placement": {"grad": "gpu"},
                              "durability": "step"}, "place grad on dram"),
             "typo": ({"tiers": {"dram": {"pth": str(tmp_path)}}}, "did you mean 'path'"),
             "disk full": ({"tiers": {"gpu": {"device": "cpu"}, "dram": {"path": str(tmp_path)},
                                      "nvme": {"path": str(tmp_path / "nv"), "budget": "1000TiB"}}},
                           "NVMe tier needs 1000.0 TiB but")}
    if on_disk(tmp_path):  # CUDA cannot pin an arena file on a disk filesystem: said at start, not at attach
        cases["disk"] = ({"tiers": {"dram": {"path": str(tmp_path)}}}, "is on a disk filesystem")
    for name, (cfg, needle) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        assert tiermem(["serve", "--config", str(path), "--socket", str(tmp_path / "s.sock")]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    assert tiermem(["serve", "--config", str(tmp_path / "none.yaml")]) == 2


def test_versions_pushed_while_attaching_are_applied_in_order(tmp_path):
    """Events the service pushes before the trainer's catalog exists (an update running during hello) are
    kept and applied in their order over the hello's layout; later ones apply at once."""
    import torch

    from tiermem.service.client import ServiceClient
    from tiermem.specs import TensorSpec
    from tiermem.store.catalog import Catalog
    from tiermem.tiers.extents import Extent

    path = tmp_path / "s.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen()
    client = ServiceClient(path)
    conn, _ = srv.accept()
    for v, off in ((2, 8192), (3, 12288)):
        protocol.send(conn, {"ev": "version", "group": 0, "version": v, "layout": {"w": ["dram", off, 4096]}})
    deadline = time.time() + 10
    while len(client._early) < 2:
        assert time.time() < deadline
        time.sleep(0.01)
    cat = Catalog()
    cat.add(TensorSpec("w", (1024,), torch.float32, "param", 0), "dram", Extent(8192, 4096))
    client.bind(cat, [[0, 2]])
    assert cat.version(0) == 3 and cat["w"].extent.offset == 12288
    protocol.send(conn, {"ev": "version", "group": 0, "version": 4, "layout": {"w": ["dram", 4096, 4096]}})
    cat.wait_version(0, 4, timeout=10)
    assert cat["w"].extent.offset == 4096
    client.close()
    conn.close()
    srv.close()


def test_a_journal_line_whose_bytes_changed_is_refused(tmp_path):
    """Each journal line carries its CRC32C: a line cut by a crash still ends the journal quietly, a line an
    older version wrote (no checksum) still reads, a line whose bytes changed is refused in one line."""
    from tiermem.errors import UserError
    from tiermem.service.journal import Journal, JournalDamaged

    path = tmp_path / "j"
    j = Journal(path)
    j.append("init", step=0, groups=[0, 1])
    j.append("commit", step=1, lr=0.5, grad_scale=None)
    j.append("done", group=0, step=1)
    j.close()
    lines = path.read_text().splitlines()
    assert all('"crc": ' in line for line in lines)
    path.write_text("\n".join(lines) + "\n" + lines[-1][:10])  # a line cut by a crash
    assert Journal(path).state.versions == {0: 1, 1: 0}
    path.write_text(lines[0] + "\n" + json.dumps({"op": "commit", "step": 1, "lr": 0.5, "grad_scale": None}) + "\n")
    assert Journal(path).state.committed == 1  # an older line, without a checksum
    path.write_text("\n".join([lines[0], lines[1].replace('"step": 1', '"step": 7'), lines[2]]) + "\n")
    with pytest.raises(JournalDamaged, match="damaged at line 2") as e:
        Journal(path)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)


def test_the_undo_copy_is_checked_before_it_is_put_back(tmp_path):
    """An update in place behind the undo copy journals the copy's CRC32Cs with its begin; recovery puts the
    copy back only when it matches (an earlier version's one CRC32C as well)."""
    import torch

    from tiermem.errors import StorageError
    from tiermem.store.checkpoint import crc32c_of
    from tiermem.tiers.extents import OutOfSpace

    svc, client, _, theirs, hello, _ = _unit_service(tmp_path, 0)
    ok(svc.dispatch(client, hello))
    store = svc.run.store
    w0 = torch.randn(4, 4)
    store.write("w", w0).result()
    ok(svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0}))
    store.write("grad/w", torch.randn(4, 4)).result()
    real = store.dram.allocate

    def full(nbytes):
        raise OutOfSpace("full")

    store.dram.allocate = full  # no room out of place: in place, behind the undo copy
    ok(svc.dispatch(client, {"op": "commit", "id": 3, "run": "r1", "step": 1, "lr": 0.1, "grad_scale": None}))
    svc.run.wait()
    store.dram.allocate = real
    begin = next(json.loads(line) for line in svc.journal_path.read_text().splitlines() if '"begin"' in line)
    guard, group, crc = svc.run.guard, begin["group"], begin["undo_crc"]
    assert isinstance(crc, list)  # the CRC32C of each piece
    guard.restore(group, crc)  # intact: w is back at its value before the update
    assert torch.equal(store.read("w").result(), w0)
    end = max(off + e.spec.nbytes for _, e, off in guard._pieces(group))
    earlier = crc32c_of(store.dram.view(guard.extent)[:end].numpy())  # one CRC32C: an earlier version's journal
    guard.restore(group, earlier)
    store.dram.view(guard.extent)[5] ^= 0xFF
    for c in (crc, earlier):
        with pytest.raises(StorageError, match="does not match its checksum"):
            guard.restore(group, c)
    svc._close_run(keep=False)
    theirs.close()
