"""``python -m kiln.runtime.tp_worker``: one follower rank (>= 1) of a tensor-parallel engine, in a fresh interpreter.

Rank 0 (``kiln.runtime.tensor_parallel``) starts each follower as its own ``python -m`` process, as torchrun
does, never as a multiprocessing child: a spawned child re-imports the user's main module, so a plain script
``llm = LLM("engines/tp2")`` without an ``if __name__ == "__main__":`` guard started every rank's LLM again
and died. Here nothing of the user's program is imported: a script with or without the guard, ``python -c``,
a REPL and a notebook all start the same workers.

Status goes back to rank 0 on a pipe (``--status-fd``, pickled tuples): ``("loaded", pid)`` once the rank's
graph is loaded, ``("joined", None)`` once its process groups exist, or ``("error", text)``. After that the
rank serves rank 0's steps until told to stop, and exits when its parent process is gone.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

logger = logging.getLogger("kiln.runtime")


def _exit_with_parent(parent_pid: int) -> None:
    """A follower outlives no leader: it exits when its parent process is gone (even if the leader was killed
    before the process groups existed, so no socket would tell)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="kiln-tp-parent-watch", daemon=True).start()


def serve_rank(directory: str, rank: int, world: int, port: int, threads: int, status: Connection) -> int:
    """Load rank ``rank``, join rank 0's process groups, serve its steps; the process's exit code."""
    import torch
    import torch.distributed as dist

    from kiln.contract import read_engine_config
    from kiln.plugins.native import native_kernels_available
    from kiln.runtime.engine import load_rank_graph
    from kiln.runtime.tensor_parallel import _Groups, _RankRunner, serve_worker
    from kiln.runtime.tp_wire import StepChannel

    torch.set_num_threads(threads)
    try:
        config = read_engine_config(directory)
        native_kernels_available()   # now, not in the first step (rank 0 compiled them if they were missing)
        fn = load_rank_graph(Path(directory), config, rank)
    except BaseException as exc:   # reported to rank 0, which names it in its EngineLoadError
        status.send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    status.send(("loaded", os.getpid()))
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=120))
    groups = _Groups.over_store(store, rank, world)
    status.send(("joined", None))
    status.close()
    try:
        serve_worker(_RankRunner(config, fn, groups), StepChannel(groups.control, config.bounds))
    except BaseException:
        # rank 0 is gone (its sockets closed) or this rank's step failed: rank 0 learns it from the
        # collectives / the exit code; say why here
        logger.error("kiln tensor-parallel rank %d stops: %s", rank, traceback.format_exc())
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kiln.runtime.tp_worker",
                                     description="A follower rank of a tensor-parallel engine (started by rank 0).")
    parser.add_argument("engine_dir")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="rank 0's TCP store on 127.0.0.1")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--status-fd", type=int, required=True)
    args = parser.parse_args(argv)
    _exit_with_parent(args.parent_pid)
    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides when the ranks stop (it tells them)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    status = Connection(args.status_fd, readable=False)
    code = serve_rank(args.engine_dir, args.rank, args.world, args.port, args.threads, status)
    from kiln.runtime.tensor_parallel import _exit_without_teardown

    _exit_without_teardown(code)


if __name__ == "__main__":
    main()
