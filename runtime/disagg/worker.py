"""``python -m kiln.runtime.disagg.worker``: one prefill or decode worker, its own ``LLM`` (engine, KV pool, step loop).

Started by the frontend (``kiln.runtime.disagg.cluster``) as a fresh interpreter (like a tensor-parallel rank:
nothing of the user's program is imported) with one end of a socket pair (``--ctrl-fd``), on which every
message is a pickled tuple. First the frontend sends ``("init", dict)`` (role, index, worker counts, the store's
address, ExecutorConfig fields, threads, transfer timeout); the worker loads its LLM, joins the transport
(``kiln.runtime.disagg.transport``) and answers ``("ready", info)`` or ``("error", text)``. Then:

frontend -> prefill: ``("prefill", rid, ids, params, priority, arrival, prompt)``, ``("send", rid, decode_index,
tag)``, ``("drop", rid)``, ``("abort", rid)``, ``("stop",)``.
prefill -> frontend: ``("prefilled", rid, ImportMeta)`` (its first token is out, its blocks are held),
``("sent", rid, nbytes, seconds)`` / ``("send_failed", rid, error)``, ``("ended", rid, RequestOutput)`` (ended
before its blocks were exported: aborted or failed), ``("rejected", rid, error)``.
frontend -> decode: ``("import", rid, ids, params, priority, arrival, prompt, ImportMeta, prefill_index, tag)``,
``("abort", rid)``, ``("stop",)``.
decode -> frontend: ``("out", rid, RequestOutput)`` (every output, the final one included), ``("received", rid,
nbytes, seconds)``, ``("rejected", rid, error)``.
Both: ``("stats", dict)`` every STATS_INTERVAL_S.

The worker exits when the frontend is gone (its socket closes, or its pid changes).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

STATS_INTERVAL_S = 0.5
logger = logging.getLogger("kiln.runtime")


class _Channel:
    """The control socket; sends come from several threads (step loop callbacks, transfer lanes, stats)."""

    def __init__(self, conn: Connection):
        self.conn, self._lock = conn, threading.Lock()

    def send(self, *msg) -> None:
        with self._lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError):   # the frontend is gone: the reader loop ends the process
                pass


class Worker:
    def __init__(self, chan: _Channel, init: dict):
        from kiln.runtime import LLM, ExecutorConfig
        from kiln.runtime.disagg import transport

        self.chan, self.role, self.index = chan, init["role"], init["index"]
        self.num_prefill = init["num_prefill"]
        self.llm = LLM(init["engine_dir"], config=ExecutorConfig(**init["options"]))
        self.executor = self.llm.executor
        self.groups = transport.join(init["host"], init["port"], transport.rank_of(self.role, self.index,
                                     self.num_prefill), init["num_prefill"], init["num_decode"],
                                     init["transfer_timeout"])
        self.lanes: dict[int, transport.PeerLane] = {}   # by peer index
        self.held: dict[str, object] = {}                # prefill: exported blocks waiting to be sent, by rid
        self.exported: set[str] = set()
        self.buffers: dict[str, object] = {}             # decode: (meta, peer, tag) of imports, by rid

    def info(self) -> dict:
        e = self.executor
        return {"pid": os.getpid(), "num_blocks": e.kv.num_blocks, "kv_plan": e.kv_plan,
                "max_batch_size": e.scheduler.config.max_batch_size,
                "bytes_per_block": e.engine.kv_bytes_per_token * e.block_size}

    # ---- prefill --------------------------------------------------------------------------------------
    def prefill(self, rid, ids, params, priority, arrival, prompt) -> None:
        first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=None,
                                    include_stop_str_in_output=False)

        def export(exp) -> None:   # in the step loop: keep the blocks, tell the frontend
            self.held[rid] = exp.blocks
            self.exported.add(rid)
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

    def send(self, rid, decode_index, tag) -> None:
        blocks = self.held.pop(rid, None)
        if blocks is None:
            self.chan.send("send_failed", rid, "the prefill worker holds no blocks for this request")
            return
        self._lane(decode_index).put(rid, blocks, tag)

    def _sent(self, rid, result, seconds) -> None:
        if isinstance(result, BaseException):
            self.chan.send("send_failed", rid, f"{type(result).__name__}: {result}")
        else:
            self.chan.send("sent", rid, result.nbytes, seconds)

    # ---- decode ---------------------------------------------------------------------------------------
    def import_(self, rid, ids, params, priority, arrival, prompt, meta, prefill_index, tag) -> None:
        def start(_rid, _blocks) -> None:   # in the step loop: receive into a buffer (the loop copies it in)
            self._lane(prefill_index).put(rid, meta.empty(), tag)

        try:
            self.executor.submit_imported(ids, params, meta, start, request_id=rid, priority=priority,
                                          prompt=prompt, callback=lambda out: self.chan.send("out", rid, out),
                                          arrival_time=arrival)
        except Exception as exc:
            start(rid, [])   # the prefill worker sends them anyway: take them off the wire
            self.chan.send("rejected", rid, f"{type(exc).__name__}: {exc}")

    def _received(self, rid, result, seconds) -> None:
        if not isinstance(result, BaseException):
            self.chan.send("received", rid, result.nbytes, seconds)
        self.executor.land(rid, result)

    # ---- both -----------------------------------------------------------------------------------------
    def _lane(self, peer: int):
        from kiln.runtime.disagg import transport

        lane = self.lanes.get(peer)
        if lane is None:
            if self.role == "prefill":
                group, rank = self.groups[(self.index, peer)], transport.rank_of("decode", peer, self.num_prefill)
                lane = transport.PeerLane(f"kiln-kv-send-{peer}", transport.sender(group, rank), self._sent)
            else:
                group, rank = self.groups[(peer, self.index)], transport.rank_of("prefill", peer, self.num_prefill)
                lane = transport.PeerLane(f"kiln-kv-recv-{peer}", transport.receiver(group, rank), self._received)
            self.lanes[peer] = lane
        return lane

    def report_stats(self) -> None:
        while True:
            time.sleep(STATS_INTERVAL_S)
            s = self.llm.stats()
            self.chan.send("stats", {k: s[k] for k in ("counters", "gauges", "kv_cache")})

    def serve(self) -> None:
        threading.Thread(target=self.report_stats, name="kiln-worker-stats", daemon=True).start()
        handlers = {"prefill": self.prefill, "send": self.send, "drop": lambda rid: self.held.pop(rid, None),
                    "import": self.import_, "abort": self.abort}
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kiln.runtime.disagg.worker",
                                     description="A prefill or decode worker (started by the disaggregated frontend).")
    parser.add_argument("--ctrl-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    _exit_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the frontend decides when workers stop
    chan = _Channel(Connection(args.ctrl_fd))
    code = 0
    try:
        _, init = chan.conn.recv()   # ("init", dict)
        import torch

        torch.set_num_threads(init["threads"])
        logging.basicConfig(level=init.get("log_level", "WARNING").upper())
        worker = Worker(chan, init)
    except BaseException as exc:
        chan.send("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        code = 1
    else:
        chan.send("ready", worker.info())
        try:
            worker.serve()
        finally:
            worker.llm.shutdown()
    from kiln.runtime.tensor_parallel import _exit_without_teardown

    _exit_without_teardown(code)


if __name__ == "__main__":
    main()
