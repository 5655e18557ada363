"""``kiln worker --role prefill|decode --connect HOST:PORT ENGINE``: one prefill or decode worker, its own ``LLM``
(engine, KV pool, step loop), serving the disaggregated frontend at HOST:PORT (``kiln serve ... --worker-listen``,
or the frontend that started it as ``python -m kiln.runtime.disagg``).

The control channel is ``multiprocessing.connection`` over TCP, authenticated with the shared secret in
``KILN_WORKER_KEY`` (HMAC challenge both ways before anything is unpickled); every message is a tuple. The worker
says ``("hello", {role, engine fingerprint, pid, host})``; the frontend answers ``("init", dict)`` (index, uid,
the TCPStore's port, ExecutorConfig fields, transfer timeout) or ``("refused", text)``; the worker loads its LLM and
answers ``("ready", info)`` or ``("error", text)``. Then:

frontend -> prefill: ``("prefill", rid, ids, params, priority, arrival, prompt)``, ``("send", rid, decode_uid,
tag)``, ``("drop", rid)``, ``("abort", rid)``, ``("peer", uid)`` (build the KV pair with that decode worker now),
``("forget", uid)`` (that peer is gone), ``("stop",)``.
prefill -> frontend: ``("kv_events", [(cached, hash), ...])`` (what its prefix cache cached and evicted, in
order: with the stats, and before each ``prefilled``; ``kiln.runtime.disagg.router``),
``("prefilled", rid, ImportMeta)`` (its first token is out, its blocks are held),
``("send_failed", rid, error)``, ``("ended", rid, RequestOutput)`` (ended
before its blocks were exported: aborted or failed), ``("rejected", rid, error)``.
frontend -> decode: ``("import", rid, ids, params, priority, arrival, prompt, ImportMeta, prefill_uid, tag, paced)``,
``("abort", rid)``, ``("peer", uid)``, ``("forget", uid)``, ``("stop",)``.
decode -> frontend: ``("received", rid, nbytes, seconds)`` (the transfer is in: on this pipe before any of the
request's outputs, so a request's transfer is counted before its end is seen), ``("out", rid, RequestOutput)``
(every output, the final one included), ``("rejected", rid, error)``.
Both: ``("stats", dict)`` every STATS_INTERVAL_S (the frontend's liveness check too).

The worker exits when the frontend is gone (the connection closes; or, when started by it, its pid changes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import signal
import socket
import threading
import time
import traceback
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path

import click

STATS_INTERVAL_S = 0.5
KEY_ENV = "KILN_WORKER_KEY"
logger = logging.getLogger("kiln.runtime")


def engine_fingerprint(engine_dir: Path) -> str:
    """What must match between the frontend's engine and a worker's: its config.json (engines built from one
    checkpoint with one build config are the same file)."""
    from kiln.contract import CONFIG_FILE

    return hashlib.sha256((Path(engine_dir) / CONFIG_FILE).read_bytes()).hexdigest()


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); a ConfigError naming the form otherwise."""
    from kiln.contract import ConfigError

    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{text!r}: give HOST:PORT (e.g. 10.0.0.5:7100)")
    return host, int(port)


def worker_key() -> bytes:
    from kiln.contract import ConfigError

    key = os.environ.get(KEY_ENV, "")
    if len(key) < 16:
        raise ConfigError(f"set {KEY_ENV} to the same secret (16+ characters) on the frontend and every worker: it "
                          "authenticates the control connection (e.g. export "
                          f"{KEY_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))'))")
    return key.encode()


class _Channel:
    """The control connection; sends come from several threads (step loop callbacks, transfer lanes, stats)."""

    def __init__(self, conn: Connection):
        self.conn, self._lock = conn, threading.Lock()

    def send(self, *msg) -> None:
        with self._lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, ValueError):   # the frontend is gone: the reader loop ends the process
                pass


class Worker:
    def __init__(self, chan: _Channel, engine_dir: Path, init: dict, store_host: str):
        from kiln.runtime import LLM, ExecutorConfig
        from kiln.runtime.disagg import transport

        self.chan, self.role, self.uid = chan, init["role"], init["uid"]
        self.llm = LLM(engine_dir, config=ExecutorConfig(**init["options"]))
        self.executor = self.llm.executor
        self.store = transport.connect_store(store_host, init["store_port"])
        self.timeout = init["transfer_timeout"]
        self.lanes: dict[int, transport.PairLane] = {}   # by peer uid (made by the control or the step-loop thread)
        self._lanes_lock = threading.Lock()
        self.held: dict[str, object] = {}                # prefill: exported blocks waiting to be sent, by rid
        self.exported: set[str] = set()
        self._events_lock = threading.Lock()             # one drainer at a time: events reach the frontend in order
        if self.role == "prefill" and self.executor.config.enable_prefix_reuse:
            self.executor.kv.record_events()

    def info(self) -> dict:
        e = self.executor
        return {"num_blocks": e.kv.num_blocks, "kv_plan": e.kv_plan,
                "max_batch_size": e.scheduler.config.max_batch_size,
                "bytes_per_block": e.engine.kv_bytes_per_token * e.block_size}

    # ---- prefill --------------------------------------------------------------------------------------
    def prefill(self, rid, ids, params, priority, arrival, prompt) -> None:
        first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=None,
                                    include_stop_str_in_output=False)

        def export(exp) -> None:   # in the step loop: keep the blocks, tell the frontend (what is cached first)
            self.held[rid] = exp.blocks
            self.exported.add(rid)
            self.send_kv_events()
            self.chan.send("prefilled", rid, exp.meta())

        def on_output(out) -> None:
            if out.finished and rid not in self.exported:
                self.chan.send("ended", rid, out)
            if out.finished:
                self.exported.discard(rid)

        try:
            self.executor.submit(ids, first, request_id=rid, priority=priority, prompt=prompt, callback=on_output,
                                 arrival_time=arrival, kv_export=export)
        except Exception as exc:
            self.chan.send("rejected", rid, f"{type(exc).__name__}: {exc}")

    def send(self, rid, decode_uid, tag) -> None:
        blocks = self.held.pop(rid, None)
        if blocks is None:
            self.chan.send("send_failed", rid, "the prefill worker holds no blocks for this request")
            return
        self._lane(decode_uid).put(rid, blocks, tag)

    def _sent(self, rid, result, seconds) -> None:
        """(A success is the decode side's to report: its report comes before the request's outputs.)"""
        if isinstance(result, BaseException):
            self.chan.send("send_failed", rid, f"{type(result).__name__}: {result}")

    # ---- decode ---------------------------------------------------------------------------------------
    def import_(self, rid, ids, params, priority, arrival, prompt, meta, prefill_uid, tag, paced=True) -> None:
        def start(_rid, _blocks) -> None:   # in the step loop: receive into a buffer (the loop copies it in)
            self._lane(prefill_uid).put(rid, meta.empty(), tag)

        try:
            self.executor.submit_imported(ids, params, meta, start, request_id=rid, priority=priority,
                                          prompt=prompt, callback=lambda out: self.chan.send("out", rid, out),
                                          arrival_time=arrival, paced=paced)
        except Exception as exc:
            start(rid, [])   # the prefill worker sends them anyway: take them off the wire
            self.chan.send("rejected", rid, f"{type(exc).__name__}: {exc}")

    def _received(self, rid, result, seconds) -> None:
        if not isinstance(result, BaseException):
            self.chan.send("received", rid, result.nbytes, seconds)
        self.executor.land(rid, result)

    # ---- both -----------------------------------------------------------------------------------------
    def _lane(self, peer_uid: int):
        from kiln.runtime.disagg import transport

        with self._lanes_lock:
            lane = self.lanes.get(peer_uid)
            if lane is None:
                if self.role == "prefill":
                    lane = transport.PairLane(self.store, f"{self.uid}-{peer_uid}", 0, self.timeout, self._sent)
                else:
                    lane = transport.PairLane(self.store, f"{peer_uid}-{self.uid}", 1, self.timeout, self._received)
                self.lanes[peer_uid] = lane
        return lane

    def forget(self, peer_uid: int) -> None:
        with self._lanes_lock:
            lane = self.lanes.pop(peer_uid, None)
        if lane is not None:
            lane.close()

    def send_kv_events(self) -> None:
        with self._events_lock:
            events = self.executor.kv.drain_events()
            if events:
                self.chan.send("kv_events", events)

    def report_stats(self) -> None:
        while True:
            time.sleep(STATS_INTERVAL_S)
            self.send_kv_events()
            s = self.llm.stats()
            self.chan.send("stats", {k: s[k] for k in ("counters", "gauges", "kv_cache")})

    def serve(self) -> None:
        threading.Thread(target=self.report_stats, name="kiln-worker-stats", daemon=True).start()
        handlers = {"prefill": self.prefill, "send": self.send, "drop": lambda rid: self.held.pop(rid, None),
                    "import": self.import_, "abort": self.abort, "forget": self.forget, "peer": self._lane}
        while True:
            try:
                msg = self.chan.conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "stop":
                return
            handlers[msg[0]](*msg[1:])

    def abort(self, rid) -> None:
        self.held.pop(rid, None)
        self.executor.abort(rid)


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="kiln-worker-parent-watch", daemon=True).start()


def run_worker(role: str, address: str, engine_dir: Path, threads: int | None = None,
               connect_timeout: float = 60.0) -> int:
    """Connect to the frontend, load the LLM, serve until the frontend stops it or goes; the exit code."""
    from kiln.contract import ConfigError

    host, port = parse_address(address)
    key = worker_key()
    deadline = time.monotonic() + connect_timeout
    while True:   # the frontend may still be starting
        try:
            conn = Client((host, port), authkey=key)
            break
        except AuthenticationError:
            raise ConfigError(f"the frontend at {address} refused this worker's {KEY_ENV} (it differs from the "
                              "frontend's)") from None
        except OSError as exc:
            if time.monotonic() > deadline:
                raise ConfigError(f"cannot reach the disaggregated frontend at {address} within "
                                  f"{connect_timeout:g} s: {exc}") from None
            time.sleep(0.2)
    chan = _Channel(conn)
    chan.send("hello", {"role": role, "engine": engine_fingerprint(engine_dir), "pid": os.getpid(),
                        "host": socket.gethostname()})
    kind, init = conn.recv()
    if kind != "init":
        raise ConfigError(f"the frontend at {address} refused this worker: {init}")
    import torch

    torch.set_num_threads(threads or init["threads"] or os.cpu_count() or 1)
    logging.basicConfig(level=init.get("log_level", "WARNING").upper())
    try:
        worker = Worker(chan, engine_dir, init, host)
    except BaseException as exc:
        chan.send("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 1
    chan.send("ready", worker.info())
    try:
        worker.serve()
    finally:
        worker.llm.shutdown()
    return 0


@click.command("worker")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--role", type=click.Choice(["prefill", "decode"]), required=True, help="What this worker runs.")
@click.option("--connect", "address", required=True, metavar="HOST:PORT",
              help="The frontend's worker address (kiln serve ... --worker-listen HOST:PORT).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads (default: the frontend's --worker-threads, else every CPU here).")
@click.option("--connect-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds to keep trying to reach the frontend.")
@click.option("--parent-pid", type=int, default=None, hidden=True)   # started by the frontend: exit with it
def worker(engine_dir: Path, role: str, address: str, threads: int | None, connect_timeout: float,
           parent_pid: int | None) -> None:
    """A prefill or decode worker of a disaggregated server (KILN_WORKER_KEY: the frontend's secret)."""
    from kiln.contract import ConfigError
    from kiln.runtime.tensor_parallel import _exit_without_teardown

    if parent_pid is not None:
        _exit_with_parent(parent_pid)
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # the frontend decides when its workers stop
    try:
        code = run_worker(role, address, engine_dir, threads, connect_timeout)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    except (EOFError, ConnectionError) as exc:
        raise click.ClickException(f"the frontend at {address} closed the connection ({exc or 'EOF'})") from None
    _exit_without_teardown(code)

