"""What must not lose a run's state, end to end on the CPU: a second `tiermem serve` on the same store,
`tiermem arenas --clean` after a kill -9, a file where the socket goes, the state lost with the arena
(tests/test_lost_run.py: the trainer's choice then), the run record's mode, and malformed requests from a peer."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.procs import child_env
from tests.test_service import ROOT, _exchange, _frame, _unit_service, _wait_for_steps, env, ok, same  # noqa: F401
from tiermem.service import protocol

pytestmark = pytest.mark.slow  # services in subprocesses: `pytest -m "not slow"` skips them


def _tiermem(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`tiermem ARGS` in a subprocess; one that is still running after ``timeout`` is killed (a second
    service that did not refuse to start)."""
    proc = subprocess.Popen([sys.executable, "-m", "tiermem.cli", *args], cwd=ROOT, env=child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"`tiermem {' '.join(args)}` still ran after {timeout} s:\n{out}{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _one_line(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_a_second_service_on_the_same_store_is_refused_and_touches_nothing(env):  # noqa: F811 - the fixture
    first = env.service()
    config, other = str(env.tmp / "serve.yaml"), str(env.sock.parent / "b.sock")
    owns = f"another tiermem service (pid {first.proc.pid}) owns the store t{os.getpid()}"
    try:
        _one_line(_tiermem("serve", "--config", config, "--socket", other, timeout=30), owns)
        trainer = env.start_train("run", extra_env={"TIERMEM_TEST_HOLD_AT": "commit:4"})
        _wait_for_steps(trainer, env.tmp / "run" / "trainer_log.jsonl", 3)
        nvme = env.tmp / "nvme"
        record, journal = next(nvme.glob("*.run.json")), next(nvme.glob("*.journal"))
        before = {p: p.read_bytes() for p in (record, journal)}
        arena = next((env.tmp / "shm").glob("*.arena"))
        # with --fresh it would discard the run: refused all the same
        _one_line(_tiermem("serve", "--config", config, "--socket", other, "--fresh", timeout=30), owns)
        assert record.read_bytes() == before[record] and arena.is_file()
        assert journal.read_bytes().startswith(before[journal])  # only ever appended to
        first.proc.kill()  # kill -9: the lock goes with the process
        assert first.proc.wait(timeout=60) == -signal.SIGKILL
        trainer.kill()
        trainer.communicate(timeout=60)
        first = env.service()
        assert "recovered run" in first.text and "step 3 committed" in first.text, first.text
    finally:
        first.stop()


def _orphan_arena(directory: Path, name: str) -> Path:
    """An arena whose owner is gone and that no run record names (an embedded run's, killed)."""
    code = ("import os, sys; from tiermem.tiers.dram import DramArena; "
            f"DramArena.create({name!r}, 1 << 20, sys.argv[1]); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(directory)], cwd=ROOT, env=child_env(), check=True, timeout=60)
    return directory / f"{name}.arena"


def test_arenas_clean_keeps_a_killed_services_arena_unless_forced(env):  # noqa: F811 - the fixture
    shm = env.tmp / "shm"
    svc = env.service(env={"TIERMEM_TEST_KILL_AT": "update:3:1"})
    lost = env.train("run")
    assert svc.proc.wait(timeout=60) == -signal.SIGKILL and lost.returncode == 1
    arena = next(shm.glob("*.arena"))
    orphan = _orphan_arena(shm, "orphan")
    config = (env.tmp / "serve.yaml").resolve()
    recoverable = f"recoverable: start `tiermem serve --config {config} --socket {env.sock}` to recover step 3"
    listed = _tiermem("arenas", "--dir", str(shm))
    assert listed.returncode == 0, listed.stderr
    line = next(x for x in listed.stdout.splitlines() if x.startswith(str(arena)))
    assert "left behind" in line and recoverable in line, listed.stdout
    assert "recoverable" not in next(x for x in listed.stdout.splitlines() if x.startswith(str(orphan)))
    cleaned = _tiermem("arenas", "--dir", str(shm), "--clean")
    assert cleaned.returncode == 0, cleaned.stderr
    assert arena.is_file() and not orphan.exists(), cleaned.stdout
    assert f"removed {orphan}" in cleaned.stdout
    assert f"`tiermem arenas --dir {shm} --clean --force --name {arena.stem}` removes it" in cleaned.stdout
    svc = env.service()  # what --clean kept is what the service recovers
    try:
        assert "recovered run" in svc.text and "step 3 committed" in svc.text, svc.text
    finally:
        assert svc.stop() == 0  # the run's state is kept for the next start: still recoverable
    forced = _tiermem("arenas", "--dir", str(shm), "--clean", "--force")
    assert forced.returncode == 0, forced.stderr
    assert not arena.exists() and f"removed {arena}" in forced.stdout, forced.stdout
    svc = env.service()
    try:
        assert "is gone" in svc.text, svc.text  # as after a reboot
    finally:
        svc.stop()


def test_serve_never_removes_what_is_not_a_dead_socket(tmp_path, capsys):
    from tiermem.cli import main as tiermem

    (tmp_path / "shm").mkdir()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"name": "sock", "tiers": {"gpu": {"device": "cpu"},
                                                             "dram": {"path": str(tmp_path / "shm")}}}))
    file, directory = tmp_path / "notes.txt", tmp_path / "adir"
    file.write_text("keep me\n")
    directory.mkdir()
    (directory / "inside").write_text("x")
    for path, what in ((file, "a regular file"), (directory, "a directory")):
        assert tiermem(["serve", "--config", str(cfg), "--socket", str(path)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and what in err and len(err.strip().splitlines()) == 1, err
    assert file.read_text() == "keep me\n" and (directory / "inside").read_text() == "x"


def test_the_run_record_and_journal_are_private(tmp_path):
    """Written 0600 (they name the model, the output_dir and every tensor), also after a compaction; a
    recovered service makes an older, wider one private again."""
    import tiermem.service.journal as journal
    from tiermem.service.server import Service

    svc, client, _, theirs, hello, _ = _unit_service(tmp_path, 0)
    ok(svc.dispatch(client, hello))
    assert svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0})["ok"]
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)
    assert mode(svc.record_path) == 0o600 and mode(svc.journal_path) == 0o600
    journal.COMPACT_BYTES = 0
    try:
        svc.run.journal.compact()
    finally:
        journal.COMPACT_BYTES = 256 << 10
    assert mode(svc.journal_path) == 0o600
    with svc.lock:
        svc._close_run(keep=True)
    svc.release()
    for p in (svc.record_path, svc.journal_path):
        os.chmod(p, 0o644)
    again = Service(str(tmp_path / "serve.yaml"), str(tmp_path / "s.sock"), say=lambda _: None)
    try:
        assert again.run is not None and again.run.state.initialized
        assert mode(again.record_path) == 0o600 and mode(again.journal_path) == 0o600
    finally:
        again._close_run(keep=False)
        again.release()
    theirs.close()


def _attach_raw(sock_path: Path):
    """A connection that attached a one-tensor run of its own with hello (as _unit_service's)."""
    import torch

    from tiermem.specs import TensorSpec
    from tiermem.store.layout import spec_to_json

    specs = [TensorSpec(n, (4, 4), torch.float32, k, 0) for n, k in
             (("w", "param"), ("grad/w", "grad"), ("exp_avg/w", "exp_avg"), ("exp_avg_sq/w", "exp_avg_sq"))]
    optim = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "has_master": False,
             "decay": {"w": True}, "groups": [0]}
    s = protocol.connect(sock_path)
    protocol.send(s, {"op": "hello", "id": 1, "run": "raw", "specs": [spec_to_json(x) for x in specs], "optim": optim})
    assert protocol.recv(s)["ok"]
    return s


def test_malformed_requests_get_an_error_naming_the_field_and_the_service_goes_on(env):  # noqa: F811 - the fixture
    ref = env.reference()
    svc = env.service()
    try:
        deep = b"[" * 200_000 + b"]" * 200_000
        cases = [
            (_frame({"op": ["hello"], "id": 1}), "'op'"),
            (_frame({"op": "stats", "id": [1]}), "'id'"),
            (struct_frame(deep), "nested too deep"),
            (struct_frame(b'{"op": "stats", "id": 1, "x": ' + b"[" * 100 + b"]" * 100 + b"}"), "nested too deep"),
            (_frame({"op": "hello", "id": 2, "run": "r", "label": "abc", "specs": [], "optim": {}}), "'label'"),
        ]
        for raw, needle in cases:
            reply = _exchange(env.sock, raw)
            assert reply is not None and reply["ok"] is False and needle in reply["error"], (needle, reply)
            assert svc.proc.poll() is None
        s = _attach_raw(env.sock)
        try:
            for live in ([1, 2], "fast", {"optimizer": [1]}):
                protocol.send(s, {"op": "progress", "id": 3, "run": "raw", "live": live})
                reply = protocol.recv(s)
                assert reply["ok"] is False and "'live" in reply["error"], (live, reply)
            protocol.send(s, {"op": "progress", "id": 4, "run": "raw", "live": {}, "store": {"tiers": [2]}})
            reply = protocol.recv(s)
            assert reply["ok"] is False and "'store" in reply["error"], reply
            protocol.send(s, {"op": "stats", "id": 5})  # the same connection still answers
            assert protocol.recv(s)["ok"]
        finally:
            s.close()
        svc.wait_for("detached from run raw")
        run = env.train("run")
        assert run.returncode == 0, run.stderr
        assert same(env.weights("run"), ref)
    finally:
        svc.stop()
    assert "Traceback" not in svc.text and "internal error" not in svc.text, svc.text


def struct_frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


BAD = ([1, 2], {"a": [1]}, "abc", 1.5, -1, True, None, [[0]], {"": None})


def test_no_malformed_field_of_any_request_is_an_internal_error(tmp_path, caplog):
    """In-process, every field of every request given values of the wrong shape: each answer is a refusal
    (or a success), never an internal error, and nothing is logged."""
    svc, client, _, theirs, hello, _ = _unit_service(tmp_path, 1)
    from tiermem.service.runs import Client

    for key in ("run", "label", "specs", "optim", "rank", "world", "pid"):
        for bad in BAD:
            c = Client(__import__("socket").socketpair()[0])
            reply = svc.dispatch(c, dict(hello, **{key: bad}))
            assert "internal error" not in str(reply.get("error")), (key, bad, reply)
            if svc.run is not None:
                with svc.lock:
                    svc._close_run(keep=False)
    for key in ("beta1", "decay", "groups", "has_master"):
        for bad in BAD:
            reply = svc.dispatch(client, dict(hello, optim=dict(hello["optim"], **{key: bad})))
            assert "internal error" not in str(reply.get("error")), (key, bad, reply)
            if svc.run is not None:
                with svc.lock:
                    svc._close_run(keep=False)
    ok(svc.dispatch(client, hello))
    assert svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0})["ok"]
    assert svc.dispatch(client, {"op": "commit", "id": 3, "run": "r1", "step": 1, "lr": 0.1})["ok"]
    fields = {"init": ("step",), "commit": ("step", "lr", "grad_scale"), "alloc": ("step", "group"),
              "flip": ("step", "group", "places"), "layout": ("names",), "progress": ("live", "store"),
              "stop": ("reason",), "stats": (), "finish": (), "hello": ()}
    for op, keys in fields.items():
        for key in keys + ("id", "op", "run"):
            for bad in BAD:
                msg = {"op": op, "id": 9, "run": "r1", "step": 1, "group": 0, **{key: bad}}
                if op != "finish":  # a finish that passes would end the run
                    reply = svc.dispatch(client, msg)
                    assert "internal error" not in str(reply.get("error")), (op, key, bad, reply)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    with svc.lock:  # the trainer leaves: the service updates the group it owed
        svc._detach(svc.run)
    svc.run.wait()
    with svc.lock:
        svc._close_run(keep=False)
    svc.release()
    theirs.close()


def _service_on_nvme(tmp_path, say=lambda _: None):
    """An in-process service whose run record lives in its NVMe directory (not the default state directory), with
    a one-tensor run initialized (a run a service recovers), and its config's path and text."""
    from tiermem.service.server import Service

    shm, nvme = tmp_path / "shm", tmp_path / "nvme"
    shm.mkdir()
    config = {"name": "hz", "placement": "auto", "optimizer": {"gpu_share": 0},
              "tiers": {"gpu": {"device": "cpu"}, "dram": {"path": str(shm), "budget": "1MiB"},
                        "nvme": {"path": str(nvme), "budget": "1MiB", "backend": "posix"}}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    import socket

    import torch

    from tiermem.service.runs import Client
    from tiermem.specs import TensorSpec
    from tiermem.store.layout import spec_to_json

    specs = [TensorSpec(n, (4, 4), torch.float32, k, 0) for n, k in
             (("w", "param"), ("grad/w", "grad"), ("exp_avg/w", "exp_avg"), ("exp_avg_sq/w", "exp_avg_sq"))]
    optim = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "has_master": False, "decay": {"w": True},
             "groups": [0]}
    hello = {"op": "hello", "id": 1, "run": "r1", "specs": [spec_to_json(x) for x in specs], "optim": optim}
    svc = Service(str(path), str(tmp_path / "s.sock"), say=say)
    client = Client(socket.socketpair()[0])
    ok(svc.dispatch(client, hello))
    ok(svc.dispatch(client, {"op": "init", "id": 2, "run": "r1", "step": 0}))
    return svc, path, config


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_arenas_clean_keeps_a_recoverable_arena_whose_lock_file_is_gone(tmp_path, capsys):
    """`tiermem arenas --clean` removed a recoverable arena when the lock file beside it was missing (it said where
    the run was recorded). The arena's own header says who made it and where its run is recorded: kept, listed as
    recoverable, and a service recovers it."""
    import json

    from tiermem.cli import main as tiermem
    from tiermem.service.server import Service
    from tiermem.tiers.dram import HEADER, MAGIC

    svc, path, _ = _service_on_nvme(tmp_path)
    with svc.lock:
        svc._close_run(keep=True)  # (as a service killed mid-run leaves it)
    svc.release()
    shm = tmp_path / "shm"
    arena = shm / "hz.arena"
    with open(arena, "r+b") as f:  # its owner gone
        header = json.loads(f.read(HEADER)[len(MAGIC):].rstrip(b"\0"))
        f.seek(0)
        f.write((MAGIC + json.dumps(dict(header, pid=_dead_pid())).encode()).ljust(HEADER, b"\0"))
    (shm / "hz.lock").unlink()
    capsys.readouterr()
    assert tiermem(["arenas", "--dir", str(shm), "--clean"]) == 0
    said = capsys.readouterr().out
    assert arena.is_file() and f"recoverable: start `tiermem serve --config {path.resolve()} --socket " \
        f"{tmp_path / 's.sock'}`" in said, said  # (its socket: not the default)
    assert header["owner"]["state_dir"] == str((tmp_path / "nvme").resolve())
    again = Service(str(path), str(tmp_path / "s.sock"), say=lambda _: None)
    try:
        assert again.run is not None and again.run.state.initialized
    finally:
        again._close_run(keep=False)
        again.release()


def test_a_sighup_that_would_move_the_stores_files_is_refused_with_a_line(tmp_path):
    """A reload that changed tiers.nvme.path (where the run is recorded), the arena's directory or the store's name
    orphaned the run: refused with one line in the log, the running store keeps its files; a change the store can
    follow (a budget) is still taken."""
    said = []
    svc, path, config = _service_on_nvme(tmp_path, said.append)
    try:
        tiers = config["tiers"]
        for key, changed in (("tiers.nvme.path", dict(tiers, nvme=dict(tiers["nvme"], path=str(tmp_path / "n2")))),
                             ("tiers.nvme.path", {k: v for k, v in tiers.items() if k != "nvme"}),
                             ("tiers.dram.path", dict(tiers, dram=dict(tiers["dram"], path=str(tmp_path / "shm2")))),
                             ("name", tiers)):
            path.write_text(yaml.safe_dump(dict(config, tiers=changed, name="other" if key == "name" else "hz")))
            svc.reload()
            assert said[-1].startswith("SIGHUP: config not reloaded: ") and key in said[-1], said[-1]
            assert "\n" not in said[-1] and svc.pending_config is None
        path.write_text(yaml.safe_dump(dict(config, tiers=dict(tiers, dram=dict(tiers["dram"], budget="2MiB")))))
        svc.reload()
        assert said[-1].startswith("SIGHUP: config reloaded") and svc.pending_config is not None
        assert (tmp_path / "nvme" / "hz.run.json").is_file() and (tmp_path / "shm" / "hz.arena").is_file()
    finally:
        with svc.lock:
            svc._close_run(keep=False)
        svc.release()

def test_a_stopped_service_is_told_in_one_line_and_a_slow_one_is_waited_for(env):  # noqa: F811 - the fixture
    """Each update of the service takes seconds (TIERMEM_TEST_SLOW_UPDATE), longer than the trainer's timeout of
    3 s: its commits and version waits outlast the timeout and the run goes on (the service pulses). Then the
    service is stopped with SIGSTOP: the attached trainer and `tiermem stats` had waited for good; each now
    ends with one line naming the socket, exit 2, about the timeout after the stop."""
    import time

    svc = env.service(env={"TIERMEM_TEST_SLOW_UPDATE": "0.7"})  # (5 groups: 3.5 s an update)
    trainer = env.start_train("run", max_steps=50, extra_env={"TIERMEM_SERVICE_TIMEOUT": "3"})
    try:
        _wait_for_steps(trainer, env.tmp / "run" / "trainer_log.jsonl", 2)  # (an update waited for)
        svc.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = trainer.communicate(timeout=120)
        waited = time.monotonic() - stopped
        assert trainer.returncode == 2, err
        lines = [line for line in err.splitlines() if "error" in line]
        assert len(lines) == 1 and f"the tiermem service at {env.sock} does not answer" in lines[0], err
        assert waited < 60  # (a safety net: the timeout is 3 s)
        stats = _tiermem("stats", "--socket", str(env.sock), "--timeout", "3", timeout=120)
        _one_line(stats, "does not answer")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate()
        svc.proc.send_signal(signal.SIGCONT)
        svc.stop()


def test_a_stopped_service_says_what_it_keeps_and_how_to_free_it(tmp_path, capsys):
    """At stop with a run in progress the service names what it keeps (its arena in RAM, its NVMe file on disk, with
    their sizes), how to continue the run (its socket too, not the default) and how to free them; the command it
    gives frees its arena, and not another store's left beside it (another service's run, recoverable)."""
    import json
    import shlex

    from tiermem.cli import main as tiermem
    from tiermem.tiers.dram import HEADER, MAGIC

    said = []
    svc, path, _ = _service_on_nvme(tmp_path, said.append)
    svc.shutdown()
    svc.release()
    line = said[-1]
    arena, nvme = tmp_path / "shm" / "hz.arena", tmp_path / "nvme" / "hz.nvme"
    assert line.startswith("stopped; run ") and "kept at step 0" in line, line
    assert f"its arena {arena} holds " in line and " of RAM" in line and f"{nvme} " in line and " of disk" in line
    assert f"`tiermem serve --config {path.resolve()} --socket {tmp_path / 's.sock'}` continues it" in line, line
    command = line.split("free them: `")[1].split("`")[0]
    assert command == f"tiermem arenas --dir {tmp_path / 'shm'} --clean --force --name hz" and f"rm {nvme}" in line
    other = tmp_path / "shm" / "another.arena"  # (another store's, left behind as this one is)
    other.write_bytes(arena.read_bytes())
    for path in (arena, other):
        with open(path, "r+b") as f:  # its owner gone, as after the service's process ends
            header = json.loads(f.read(HEADER)[len(MAGIC):].rstrip(b"\0"))
            f.seek(0)
            f.write((MAGIC + json.dumps(dict(header, pid=_dead_pid(), name=path.stem)).encode()).ljust(HEADER, b"\0"))
    capsys.readouterr()
    assert tiermem(shlex.split(command)[1:]) == 0
    assert not arena.exists() and other.exists(), capsys.readouterr().out
    assert tiermem(["arenas", "--dir", str(tmp_path / "shm"), "--clean", "--force", "--name", "nothing"]) == 0
    assert "no tiermem arena of store nothing in " in capsys.readouterr().out and other.exists()
