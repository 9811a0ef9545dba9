"""The service's control protocol: length-prefixed JSON over a Unix-domain socket. Never pickle.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (one object, nested at
most MAX_DEPTH deep: deeper is refused before anything walks it). Requests
carry ``op`` and ``id``; replies echo ``id`` with ``ok`` true (and fields) or false with ``error`` (one
line). The service also pushes events (``ev``) to an attached trainer (to each rank of a run of several): a
group's new version, a failure.
Bulk data never travels here: it moves through the shared DRAM arena and the NVMe files.

The socket lives in an owner-only directory (0700) and is itself 0600; the service also checks the
peer's uid (SO_PEERCRED) and refuses any other user.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from pathlib import Path

from tiermem.errors import UserError
from tiermem.files import kind_of

MAX_MESSAGE = 8 << 20  # a 70B model's layout is ~0.3 MiB of JSON; anything near this is not ours
MAX_DEPTH = 64  # ours nest 5 deep at most
# Liveness. A request may take long on a live service (hello plans a run and makes its arena; commit waits for the
# last update, and after a SIGHUP moves state between tiers; finish waits for the last update), so a client bounds
# no request's time: it bounds the silence. The service sends ``{"ev": "alive"}`` every PULSE_SECONDS to each
# trainer attached to it and to any peer whose request it has worked on that long; a client that hears nothing for
# its timeout (TIERMEM_SERVICE_TIMEOUT seconds, default 30: thirty missed pulses) says the service does not answer
# (stopped, as by SIGSTOP or a debugger, or stuck) in one line.
PULSE_SECONDS = 1.0
DEFAULT_TIMEOUT = 30.0
HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """The peer sent something that is not a well-formed message; the connection cannot continue."""


def send(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE}-byte limit")
    sock.sendall(HEADER.pack(len(data)) + data)


def _exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if buf:
                raise ProtocolError("connection closed in the middle of a message")
            return None
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> dict | None:
    """The next message, or None when the peer closed the connection between messages."""
    head = _exact(sock, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_MESSAGE:
        raise ProtocolError(f"message length {n} exceeds the {MAX_MESSAGE}-byte limit")
    body = _exact(sock, n)
    if body is None:
        raise ProtocolError("connection closed in the middle of a message")
    try:
        obj = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ProtocolError("message is not UTF-8 JSON") from None
    except RecursionError:  # the decoder refuses at the interpreter's recursion limit
        raise ProtocolError(f"message nested too deep (more than {MAX_DEPTH} levels)") from None
    if not isinstance(obj, dict):
        raise ProtocolError("message is not a JSON object")
    if _depth(obj) > MAX_DEPTH:
        raise ProtocolError(f"message nested too deep (more than {MAX_DEPTH} levels)")
    return obj


def _depth(obj) -> int:
    """How deep lists and objects nest in ``obj`` (without recursion: the walk is as deep as the data)."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        o, d = todo.pop()
        deepest = max(deepest, d)
        if deepest > MAX_DEPTH:
            break
        inner = o.values() if isinstance(o, dict) else o
        todo.extend((v, d + 1) for v in inner if isinstance(v, (dict, list)))
    return deepest


def service_timeout(value: float | str | None = None) -> float:
    """Seconds of silence after which a client gives up on the service: ``value``, else $TIERMEM_SERVICE_TIMEOUT,
    else DEFAULT_TIMEOUT; at least three pulses (a shorter one would give up on a live service)."""
    raw = value if value is not None else os.environ.get("TIERMEM_SERVICE_TIMEOUT")
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not 3 * PULSE_SECONDS <= seconds <= 1e6:
        raise UserError(f"the service timeout must be from {3 * PULSE_SECONDS:g} to 1e6 seconds, got {raw!r} "
                        "(--timeout or TIERMEM_SERVICE_TIMEOUT)")
    return seconds


def pulse(sock: socket.socket) -> None:
    """Send the liveness event unless the peer's receive buffer is filling (a stopped peer must not block the
    service): a Unix socket polls writable only while it is at most a quarter full, so the small frame fits.
    Call with the connection's send lock held."""
    import select

    try:
        if select.select([], [sock], [], 0)[1]:
            send(sock, {"ev": "alive"})
    except (OSError, ValueError):
        pass


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def peer_allowed(uid: int, own_uid: int | None = None) -> bool:
    """Only the service's own user may talk to it."""
    return uid == (os.getuid() if own_uid is None else own_uid)


def runtime_dir() -> Path:
    """A per-user, owner-only directory for sockets: $XDG_RUNTIME_DIR/tiermem, else /tmp/tiermem-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "tiermem" if base and Path(base).is_dir() else Path(f"/tmp/tiermem-{os.getuid()}")
    return private_dir(path)


def private_dir(path: Path) -> Path:
    """Create ``path`` 0700 if missing; refuse one that another user owns or others can enter."""
    try:
        path.mkdir(mode=0o700, parents=False, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the socket directory {path}: {os.strerror(e.errno)}") from None
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise UserError(f"socket directory {path} is not a directory owned by this user; remove it or pass --socket")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def make_way(path: Path) -> None:
    """Clear ``path`` for a service's socket: nothing there, or a socket no process answers on (left by a
    service that is gone), which is removed. Anything else is refused with one line and left as it is."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserError(f"cannot listen on {path}: {os.strerror(e.errno)}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise UserError(f"cannot listen on {path}: {kind_of(st.st_mode)} is there; remove it or choose another "
                        "--socket")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(str(path))
    except ConnectionRefusedError:  # nobody listens: left by a service that is gone
        path.unlink(missing_ok=True)
        return
    except OSError as e:
        raise UserError(f"cannot listen on {path}: a socket is there that does not answer properly "
                        f"({e.strerror or 'timed out'}); remove it if no service uses it") from None
    finally:
        s.close()
    raise UserError(f"a tiermem service is already listening on {path}")


# the longest path a Unix-domain socket may have (sun_path: 108 bytes on Linux, 104 on macOS, with its NUL)
SOCKET_PATH_BYTES = 107 if os.uname().sysname == "Linux" else 103


def check_socket_path(path: str | Path) -> Path:
    """``path`` if a Unix socket can be bound or reached there, else one line saying why (too long for the OS)."""
    n = len(os.fsencode(str(path)))
    if n > SOCKET_PATH_BYTES:
        raise UserError(f"socket path {path} is {n} bytes long; the OS takes at most {SOCKET_PATH_BYTES} for a Unix "
                        "socket: choose a shorter --socket (or tiermem_server) path")
    return Path(path)


def default_socket() -> Path:
    return runtime_dir() / "tiermem.sock"


def server_socket(server: str | Path) -> Path:
    """The socket a trainer's ``tiermem_server`` names (``default``: this user's default socket)."""
    return default_socket() if str(server) == "default" else Path(server)


def connect(path: str | Path, timeout: float | None = 10.0) -> socket.socket:
    """A connected socket to the service at ``path``; one clear line when nobody listens there."""
    path = check_socket_path(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
    except FileNotFoundError:
        s.close()
        raise UserError(f"no tiermem service at {path}: start one with `tiermem serve --config CONFIG`") from None
    except (TimeoutError, ConnectionRefusedError):
        s.close()
        raise UserError(f"the tiermem service at {path} does not answer (it is gone or stuck); "
                        "start it again with `tiermem serve --config CONFIG`") from None
    except PermissionError:
        s.close()
        raise UserError(f"no permission to connect to {path}: the service belongs to another user") from None
    s.settimeout(None)
    return s
