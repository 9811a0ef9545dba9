"""One request of a short-lived client (``tiermem top``, ``tiermem stats``): connect, ask, read the reply, close.

It needs only the socket and the protocol (no torch, no store: such a client answers at once, even to say that no
service is there). A trainer's long-lived link, with the events a service pushes to it, is ``client.ServiceClient``.
"""

from __future__ import annotations

from pathlib import Path

from tiermem.errors import UserError
from tiermem.service import protocol


def ask(path: str | Path, op: str, timeout: float | None = None, **fields) -> dict:
    """The service's reply to ``op`` (``fields`` with it); one line when there is no service at ``path``, it
    refuses, goes away, or says nothing for ``timeout`` seconds (protocol.service_timeout; a live service pulses
    every second)."""
    wait = protocol.service_timeout(timeout)
    sock = protocol.connect(path)
    try:
        sock.settimeout(wait)
        try:
            protocol.send(sock, {"op": op, "id": 1, **fields})
            while True:
                reply = protocol.recv(sock)
                if reply is None:
                    raise UserError(f"the tiermem service at {path} went away before it answered {op}")
                if "ev" not in reply:  # (its answer, or a refusal of the connection: id None)
                    break
        except TimeoutError:
            raise UserError(f"the tiermem service at {path} does not answer: nothing from it in {wait:g} s (is it "
                            "stopped, by SIGSTOP or a debugger, or stuck?); TIERMEM_SERVICE_TIMEOUT sets how long "
                            "to wait") from None
        except (OSError, protocol.ProtocolError) as e:
            raise UserError(f"the tiermem service at {path} went away before it answered {op} ({e})") from None
    finally:
        sock.close()
    if not reply.get("ok"):
        raise UserError(f"the tiermem service refused {op}: {reply.get('error')}")
    return reply
