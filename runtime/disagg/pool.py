"""The disaggregated frontend's workers: who is connected, in which role and slot, and who died.

Workers connect to the frontend (like Dynamo's workers registering with their frontend): the pool listens on a
TCP address (``multiprocessing.connection`` messages, authenticated with ``KILN_WORKER_KEY``), and each worker,
local (started by the pool on 127.0.0.1 with a fresh random key) or remote (``kiln worker --connect``), says
hello, gets its slot and the executor options, loads its LLM and says ready. A slot is (role, index): a worker
takes the lowest slot of its role with no live worker, so a restarted worker takes back the slot of the one that
died (rejoins), and one beyond the configured count adds a slot. Each worker also gets a uid, never reused: the
KV pairs (``transport``) are keyed by uids, so a rejoined worker's pairs are new groups.

Death: the control connection closing (the process died, the host dropped the TCP connection) or no message for
LIVENESS_S (workers report stats every 0.5 s). The pool then calls ``on_death(worker, reason)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path

from kiln.contract import ConfigError, EngineLoadError
from kiln.runtime.disagg.worker import KEY_ENV, engine_fingerprint, parse_address, worker_key

logger = logging.getLogger("kiln.runtime")

START_TIMEOUT_S = 300.0   # a worker's hello to its ready (it loads the engine meanwhile)
HELLO_TIMEOUT_S = 10.0
LIVENESS_S = 15.0
ROLES = ("prefill", "decode")


@dataclass
class PoolWorker:
    role: str
    index: int
    uid: int
    conn: Connection
    pid: int
    host: str
    proc: subprocess.Popen | None = None   # started by this pool
    info: dict = field(default_factory=dict)
    stats: dict | None = None
    death: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return f"{self.role} worker {self.index} (pid {self.pid} on {self.host})"

    def send(self, *msg) -> bool:
        with self.lock:
            try:
                self.conn.send(msg)
                return True
            except (OSError, EOFError, ValueError):
                return False


class WorkerPool:
    """Listen, admit workers into slots, watch them. ``init(role)``: the executor options a joining worker gets;
    ``on_message(worker, msg)`` runs in the worker's reader thread; ``on_join(worker)`` once it holds its slot
    (before its reader starts); ``on_death(worker, reason)`` once."""

    def __init__(self, directory: Path, init: Callable[[str], dict], on_message: Callable[[PoolWorker, tuple], None],
                 on_join: Callable[[PoolWorker], None], on_death: Callable[[PoolWorker, str], None],
                 listen: str | None = None, store_port: int = 0):
        from kiln.runtime.disagg import transport

        self.directory, self._init = directory, init
        self._on_message, self._on_join, self._on_death = on_message, on_join, on_death
        self.fingerprint = engine_fingerprint(directory)
        if listen is None:   # local workers only: loopback, a key of our own
            self.key, address = secrets.token_hex(16).encode(), ("127.0.0.1", 0)
        else:
            self.key, address = worker_key(), parse_address(listen)
        try:
            self.listener = socket.create_server(address, family=socket.AF_INET6 if ":" in address[0]
                                                 else socket.AF_INET)
        except OSError as exc:
            raise ConfigError(f"cannot listen for workers on {listen}: {exc.strerror or exc}") from None
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.store = transport.serve_store(store_port)
        self.slots: dict[tuple[str, int], PoolWorker] = {}
        self.start_errors: list[str] = []
        self.spawned: list[subprocess.Popen] = []
        self.readers: set[threading.Thread] = set()
        self._joining: set[tuple[str, int]] = set()
        self._uids = itertools.count()
        self._lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, name="kiln-disagg-accept", daemon=True).start()

    # ---- membership -------------------------------------------------------------------------------------
    def workers(self) -> list[PoolWorker]:
        with self._lock:
            return sorted(self.slots.values(), key=lambda w: (ROLES.index(w.role), w.index))

    def alive(self, role: str) -> list[PoolWorker]:
        return [w for w in self.workers() if w.role == role and w.death is None]

    def by_uid(self, uid: int) -> PoolWorker | None:
        return next((w for w in self.workers() if w.uid == uid), None)

    def spawn(self, role: str, threads: int) -> None:
        """A local worker process connecting to this pool (this interpreter, kiln's worker entry point)."""
        host, port = self.address
        cmd = [sys.executable, "-m", "kiln.runtime.disagg", "--role", role, "--connect", f"{host}:{port}",
               "--threads", str(threads), "--parent-pid", str(os.getpid()), str(self.directory)]
        env = {**os.environ, KEY_ENV: self.key.decode()}
        self.spawned.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env))

    def wait_for(self, counts: dict[str, int], timeout: float = START_TIMEOUT_S) -> None:
        """Until ``counts[role]`` workers of each role are ready; an EngineLoadError when a local worker exits or
        fails to start, or the time is up."""
        deadline = time.monotonic() + timeout
        while any(len(self.alive(r)) < n for r, n in counts.items()):
            if self.start_errors and self.spawned:
                raise EngineLoadError(f"{self.directory}: {self.start_errors[0]}")
            for p in self.spawned:
                if p.poll() is not None:
                    raise EngineLoadError(f"{self.directory}: a worker exited with code {p.returncode} while "
                                          "starting (its error is above, on stderr)")
            if time.monotonic() > deadline:
                have = ", ".join(f"{len(self.alive(r))} of {n} {r}" for r, n in counts.items())
                raise EngineLoadError(f"{self.directory}: workers did not join within {timeout:g} s ({have}; "
                                      f"they connect to {self.address[0]}:{self.address[1]})")
            time.sleep(0.05)

    # ---- admission --------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return   # the listener was closed
            threading.Thread(target=self._admit, args=(sock,), name="kiln-disagg-admit", daemon=True).start()

    def _admit(self, sock: socket.socket) -> None:
        """One connection, in its own thread (a slow or hostile peer holds up no other): the HMAC challenge
        both ways (multiprocessing.connection's, as its Listener does), then hello, init and ready."""
        slot, conn = None, Connection(sock.detach())
        try:
            try:
                deliver_challenge(conn, self.key)
                answer_challenge(conn, self.key)
            except AuthenticationError as exc:
                raise ConnectionError(f"authentication failed ({exc}): its {KEY_ENV} differs") from None
            if not conn.poll(HELLO_TIMEOUT_S):
                raise ConnectionError(f"no hello within {HELLO_TIMEOUT_S:g} s")
            kind, hello = conn.recv()
            role = hello.get("role") if kind == "hello" and isinstance(hello, dict) else None
            if role not in ROLES:
                raise ConnectionError(f"not a kiln worker's hello: {kind!r}")
            if hello.get("engine") != self.fingerprint:
                conn.send(("refused", f"its engine is not this server's {self.directory} (config.json differs): "
                                      "build both from the same checkpoint and build config"))
                raise ConnectionError(f"a {role} worker on {hello.get('host')} serves another engine")
            with self._lock:
                if self.closed:
                    raise ConnectionError("the pool is closed")
                index = next(i for i in itertools.count() if (role, i) not in self._joining
                             and ((role, i) not in self.slots or self.slots[(role, i)].death is not None))
                slot, uid = (role, index), next(self._uids)
                self._joining.add(slot)
            proc = next((p for p in self.spawned if p.pid == hello.get("pid")), None)
            w = PoolWorker(role, index, uid, conn, int(hello.get("pid", -1)), str(hello.get("host", "?")), proc)
            conn.send(("init", {"role": role, "index": index, "uid": uid, "store_port": self.store.port,
                                **self._init(role)}))
            if not conn.poll(START_TIMEOUT_S):
                raise ConnectionError(f"the {w.name} did not load its engine within {START_TIMEOUT_S:g} s")
            status, detail = conn.recv()
            if status != "ready":
                self.start_errors.append(f"the {w.name} failed to start: {detail}")
                raise ConnectionError(self.start_errors[-1])
            w.info = detail
            with self._lock:
                self.slots[slot] = w
                self._joining.discard(slot)
            self._on_join(w)
            logger.info("%s joined (uid %d)", w.name, uid)
            t = threading.Thread(target=self._read, args=(w,), name=f"kiln-disagg-{role}{index}", daemon=True)
            self.readers.add(t)
            t.start()
        except (OSError, EOFError, ConnectionError, ValueError, TypeError) as exc:
            if slot is not None:
                with self._lock:
                    self._joining.discard(slot)
            if not self.closed:
                logger.warning("a worker did not join: %s", exc)
            conn.close()

    # ---- watching ---------------------------------------------------------------------------------------
    def _read(self, w: PoolWorker) -> None:
        reason = "its connection closed"
        while True:
            try:
                if not w.conn.poll(LIVENESS_S):
                    reason = f"it sent nothing for {LIVENESS_S:g} s"
                    break
                msg = w.conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._on_message(w, msg)
            except Exception:
                logger.exception("handling %r from %s failed", msg[0], w.name)
        if not self.closed:   # dead from now on: routing skips it, health says so, its slot is free to rejoin
            w.death = f"{w.name} died ({reason})"
        if w.proc is not None:   # ours: say how it ended (its exit code may take up to 5 s)
            try:
                code = w.proc.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            killed = code is not None and code < 0 and -code in signal.valid_signals()
            reason = f"killed by {signal.Signals(-code).name}" if killed else f"exit code {code}"
        w.conn.close()
        self.readers.discard(threading.current_thread())
        if self.closed:
            w.death = f"{w.name} stopped"
            return
        w.death = f"{w.name} died ({reason})"
        logger.error("%s; its requests fail, the others serve on", w.death)
        self._on_death(w, w.death)

    def close(self, stop_timeout: float = 10.0) -> None:
        """Stop every worker (local ones are killed if they do not stop within ``stop_timeout``). Each
        connection is closed by its reader thread only, when the worker hangs up; one that does not is shut down."""
        if self.closed:
            return
        self._stop_listening()
        for w in self.workers():
            w.send("stop")
        deadline = time.monotonic() + stop_timeout
        for p in self.spawned:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        while self.readers and time.monotonic() < deadline:
            time.sleep(0.02)
        for w in self.workers():
            if w.death is None:
                try:   # wakes its reader (EOF), which closes the connection
                    socket.socket(fileno=os.dup(w.conn.fileno())).shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _stop_listening(self) -> None:
        self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the accept loop
        except OSError:
            pass
        self.listener.close()

    def kill(self) -> None:
        self._stop_listening()
        for p in self.spawned:
            if p.poll() is None:
                p.kill()
            p.wait(5)


def worker_options(options, n_local: int) -> dict:
    """ExecutorConfig fields for a worker: local workers share this machine's memory fraction evenly."""
    fields = dataclasses.asdict(options)
    if n_local and options.kv_cache_memory_fraction is not None:
        fields["kv_cache_memory_fraction"] = options.kv_cache_memory_fraction / n_local
    return fields
