"""A service's control socket: listening (the user's alone), accepting peers, serving each one's requests, and
detaching a trainer whose connection closes. A mixin of ``tiermem.service.server.Service``."""

from __future__ import annotations

import os
import socket
import threading
import time

from tiermem.errors import UserError
from tiermem.service import protocol
from tiermem.service.runs import Client, label_of


class Listening:
    def listen(self) -> None:
        path = protocol.check_socket_path(self.socket_path)
        protocol.make_way(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(str(path))
        except OSError as e:
            s.close()
            raise UserError(f"cannot listen on {path}: {e.strerror or e}") from None
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        s.listen(socket.SOMAXCONN)  # many peers at once wait to be accepted, not refused
        self._listener = s
        threading.Thread(target=self._accept, name="tiermem-accept", daemon=True).start()
        threading.Thread(target=self._pulse, name="tiermem-pulse", daemon=True).start()

    def _pulse(self) -> None:
        """Tell the peers that wait on this service that it is alive (protocol.PULSE_SECONDS), from a thread of its
        own: a request worked on for minutes (a commit waiting for an update) is not silence."""
        while not self._stopping:
            time.sleep(protocol.PULSE_SECONDS)
            now = time.monotonic()
            with self._peers_lock:
                due = [c for c in self._peers.values() if c.due_pulse(now)]
            for c in due:
                c.pulse()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="tiermem-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        client = Client(conn)
        with self._peers_lock:
            self._peers[id(client)] = client
        try:
            uid = protocol.peer_uid(conn)
            if not protocol.peer_allowed(uid):
                client.send({"id": None, "ok": False, "error": f"refused: uid {uid} is not the service's user"})
                return
            while not self._stopping:
                try:
                    msg = protocol.recv(conn)
                except protocol.ProtocolError as e:
                    client.send({"id": None, "ok": False, "error": f"bad message: {e}"})
                    return
                if msg is None:
                    return
                client.busy_since = time.monotonic()
                reply = self.dispatch(client, msg)
                client.greeted = client.greeted or (msg.get("op") == "hello" and reply.get("ok") is True)
                client.busy_since = None
                client.send(reply)
        except OSError:
            pass
        finally:
            with self._peers_lock:
                self._peers.pop(id(client), None)
            with self.lock:
                run = self.run
                lost_peer = run is not None and run.peers.get(client.rank) is client and not client.done
                if run is not None and (run.trainer is client or lost_peer):
                    self._detach(run)
                    who = f"rank {client.rank}" if lost_peer else "trainer"
                    self.say(f"{who} pid {client.pid} detached from "
                             f"run {label_of(run)} (step {run.state.committed} committed)"
                             + ("; the run's other ranks with it" if lost_peer or run.world > 1 else ""))
                    if not run.state.initialized:  # nothing of value yet: do not block other runs
                        self._close_run(keep=False)
                elif run is not None and run.peers.get(client.rank) is client:
                    del run.peers[client.rank]  # (done: its share of the last update is whole)
            conn.close()
