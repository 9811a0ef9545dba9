"""A fuzz of the service's socket: random and mutated messages (every op with fields of random JSON, deep
nesting, random bytes, truncated frames), one connection after another and then 200 connections at once,
against a live service. Every reply is an error or an answer, the service stays up and logs no traceback,
and a run trained through it afterwards ends bit-identical to the same run embedded."""

from __future__ import annotations

import json
import random
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_service import _frame, env, same  # noqa: F401 - the fixture
from tiermem.service import protocol

pytestmark = pytest.mark.slow  # services in subprocesses: `pytest -m "not slow"` skips them

OPS = ["hello", "init", "commit", "alloc", "flip", "layout", "progress", "finish", "stats", "stop", "leave"]
FIELDS = ["run", "step", "group", "label", "specs", "optim", "live", "store", "places", "lr", "grad_scale",
          "names", "reason", "pid", "rank", "world", "owns"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16)
messages = st.builds(lambda op, mid, extra: {"op": op, "id": mid, **extra},
                     st.sampled_from(OPS) | json_values, st.integers(0, 10**6) | json_values,
                     st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6))


def _raw(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


frames = st.one_of(
    messages.map(lambda m: (_frame(m), True)),
    messages.map(lambda m: (_frame(m)[: max(5, len(_frame(m)) // 2)], False)),  # truncated: no reply to wait for
    st.binary(max_size=64).map(lambda b: (_raw(b), True)),  # random bytes in a well-sized frame
    st.integers(65, 3000).map(lambda d: (_raw(b'{"op": "stats", "x": ' + b"[" * d + b"]" * d + b"}"), True)),
)


def _send(path, raw: bytes, answered: bool) -> dict | None:
    """Send one frame on a new connection; the reply when one is due (None when the service closed)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(20)
    s.connect(str(path))
    try:
        s.sendall(raw)
        return protocol.recv(s) if answered else None
    except (BrokenPipeError, ConnectionResetError, protocol.ProtocolError):
        return None
    finally:
        s.close()


def _valid(reply) -> bool:
    """An answer, or an error that says what was wrong."""
    return isinstance(reply, dict) and reply.get("ok") in (True, False) and (reply["ok"] or
                                                                           isinstance(reply.get("error"), str))


def test_random_and_mutated_messages_never_take_the_service_down(env):  # noqa: F811 - the fixture
    ref = env.reference()
    svc = env.service()
    try:
        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(frames)
        def one_connection(frame):
            raw, answered = frame
            reply = _send(env.sock, raw, answered)
            assert _valid(reply) or not answered, reply
            assert svc.proc.poll() is None

        one_connection()

        rng = random.Random(0)  # 200 connections at once, each with a frame of its own
        conns = []
        for _ in range(200):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(env.sock))
            s.settimeout(30)
            conns.append(s)
        for i, s in enumerate(conns):
            msg = {"op": rng.choice(OPS + ["nope", 7]), "id": i, rng.choice(FIELDS): rng.choice([1, "x", [1], {}])}
            s.sendall(_frame(msg) if i % 4 else _raw(json.dumps(msg).encode()[:-1]))  # every 4th: bad JSON
        for s in conns:
            try:
                assert _valid(protocol.recv(s))
            finally:
                s.close()
        assert svc.proc.poll() is None

        run = env.train("run")
        assert run.returncode == 0, run.stderr
        assert same(env.weights("run"), ref)
    finally:
        assert svc.stop() == 0
    assert "Traceback" not in svc.text and "internal error" not in svc.text, svc.text
