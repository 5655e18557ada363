"""Running a tensor-parallel engine: rank 0 leads, the other ranks follow its steps.

``Engine.from_dir`` of an engine built with ``tp_size`` N > 1 returns a :class:`TensorParallelEngine`: rank
0's graph in this process, and N - 1 ranks that run theirs in lockstep. Everything above the engine (the
executor's scheduler, KV manager and sampler, ``LLM``, the servers) is unchanged: it sees one engine with
``run(inputs) -> logits``. Each step, rank 0 broadcasts the step's inputs (``tp_wire``: one flat int64
tensor) to the other ranks, then every rank runs its graph on its shard and its own KV pool (its KV
heads); the graphs meet in their collectives (``kiln::all_reduce`` / ``kiln::all_gather``) and every rank
ends with the same logits. Only rank 0's are used.

Where the other ranks come from:

* by default, N - 1 worker processes started here, on this machine, each a fresh interpreter running
  ``python -m kiln.runtime.tp_worker`` (as torchrun starts its ranks; never a multiprocessing child, which
  would re-import the user's main module), rendezvousing through a TCP store on 127.0.0.1;
* under ``torchrun`` (``WORLD_SIZE`` = N set in the environment), the processes torchrun started, through
  its rendezvous (so the ranks may span machines): rank 0's ``LLM(engine_dir)`` leads, and on the other
  ranks the same call serves as a worker until rank 0 shuts down, then exits the process (exit code 0),
  so one script runs on every rank.

Two gloo process groups of their own (no global ``torch.distributed`` state is touched in the spawned
setup, so several engines can live in one process): *control* carries the step broadcast (a worker waits
for it without limit: an idle server sends nothing; rank 0's send waits at most ``KILN_TP_TIMEOUT_S``),
*compute* the graphs' collectives (a collective waits at most ``KILN_TP_TIMEOUT_S`` seconds, default 60,
for a rank that hangs). A GPU backend would run *compute*
on NCCL; the step broadcast stays on the CPU.

Threads: each rank uses ``usable cores // ranks on this machine`` torch threads by default (rank 0 sets it
for this process too); ``KILN_TP_THREADS`` or ``Engine.from_dir(..., threads_per_rank=)`` sets it.

KV memory: all ranks on one machine share its memory, so ``kv_bytes_per_token`` (what the executor sizes
the pool by) is one rank's bytes per token times the ranks on this machine, and ``allocate_kv_cache(n)``
gives every rank a pool of n blocks of its own KV heads.

Failure: a worker that dies closes its sockets and rank 0's next collective fails within milliseconds; a
watchdog thread also notices the dead process while idle. The engine is then *dead*: the step raises
:class:`~kiln.contract.EngineDeadError` naming the rank, its pid and exit code, the executor fails its
requests and refuses new work, the surviving workers are stopped. A new ``LLM`` starts new workers.
``close()`` (``LLM.shutdown``, and an ``atexit`` hook for engines still open) stops every worker.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kiln.contract import (
    ConfigError,
    EngineConfig,
    EngineDeadError,
    EngineInputError,
    EngineLoadError,
    check_inputs,
    check_rank_file,
    kv_cache_shape,
)
from kiln.plugins import collectives
from kiln.runtime.engine import Engine, load_rank_graph
from kiln.runtime.tp_wire import OP_ALLOC, OP_STEP, OP_STOP, StepChannel
from kiln.runtime.zero_pages import zero_pages

logger = logging.getLogger("kiln.runtime")

TIMEOUT_ENV = "KILN_TP_TIMEOUT_S"
THREADS_ENV = "KILN_TP_THREADS"
CONTROL_TIMEOUT = datetime.timedelta(days=3650)   # the step broadcast: workers wait for the next step forever
STOP_WAIT_S = 10.0


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "60")))


def control_timeout(rank: int) -> datetime.timedelta:
    """How long a step broadcast may wait: without limit on a worker (an idle server sends nothing for hours),
    the collectives' limit on rank 0, whose broadcast to a rank that hangs (stopped, not dead: its sockets
    stay open) would otherwise block forever. Gloo's timeouts are each process's own."""
    return collective_timeout() if rank == 0 else CONTROL_TIMEOUT


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_threads(ranks_here: int, threads_per_rank: int | None = None) -> int:
    """Torch threads of each rank: the argument, else KILN_TP_THREADS, else this machine's cores / its ranks."""
    if threads_per_rank is None and os.environ.get(THREADS_ENV):
        threads_per_rank = int(os.environ[THREADS_ENV])
    if threads_per_rank is not None:
        if threads_per_rank < 1:
            raise ConfigError(f"threads_per_rank must be >= 1, got {threads_per_rank}")
        return threads_per_rank
    return max(1, usable_cores() // ranks_here)


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, world size, ranks on this machine) when this process was started by torchrun (or another
    launcher setting torch.distributed's environment) for more than one rank, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


class _Groups:
    """The control and compute process groups of one rank."""

    def __init__(self, control: dist.ProcessGroup, compute: dist.ProcessGroup, registered: bool = False,
                 owns_default: bool = False):
        self.control, self.compute = control, compute
        self._registered = registered       # made through torch.distributed's global state, which holds them
        self._owns_default = owns_default   # the default group is ours to destroy (we created it)

    @classmethod
    def over_store(cls, store: dist.Store, rank: int, world: int) -> _Groups:
        """Gloo groups on a store of our own (the spawned setup: no global torch.distributed state)."""
        return cls(dist.ProcessGroupGloo(dist.PrefixStore("kiln/control", store), rank, world, control_timeout(rank)),
                   dist.ProcessGroupGloo(dist.PrefixStore("kiln/compute", store), rank, world, collective_timeout()))

    @classmethod
    def joined(cls) -> _Groups:
        """Gloo groups over the launcher's rendezvous (torchrun): the default group is created if needed."""
        owns_default = not dist.is_initialized()
        if owns_default:
            dist.init_process_group("gloo", timeout=CONTROL_TIMEOUT)
        return cls(dist.new_group(backend="gloo", timeout=control_timeout(dist.get_rank())),
                   dist.new_group(backend="gloo", timeout=collective_timeout()), registered=True,
                   owns_default=owns_default)

    def release(self) -> None:
        """Close the groups now, while the interpreter is whole. Under torchrun torch.distributed's global state
        holds them (and the default group) until exit, and gloo torn down by the finalizers there, the peers
        gone, aborted rank 0 ("terminate called without an active exception", SIGABRT) in loaded test runs."""
        if self._registered:
            try:
                for group in (self.control, self.compute):
                    dist.destroy_process_group(group)
                if self._owns_default:
                    dist.destroy_process_group()
            except Exception as exc:   # the process exits soon either way
                logger.warning("could not destroy the tensor-parallel process groups: %s", exc)
        self.control = self.compute = None


class _RankRunner:
    """One rank's graph and KV pool; ``step`` runs the graph with this rank's collectives group."""

    def __init__(self, config: EngineConfig, fn: Any, groups: _Groups):
        self.config, self.fn, self.groups = config, fn, groups
        self.pool: torch.Tensor | None = None

    def allocate(self, num_blocks: int) -> torch.Tensor:
        self.pool = None   # drop the old pool before the new one is allocated
        shape = kv_cache_shape(self.config.rank_model, self.config.bounds.tokens_per_block, num_blocks,
                               self.config.kv_cache_dtype)
        self.pool = zero_pages(shape, self.config.torch_kv_dtype)
        return self.pool

    def step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        collectives.set_group(self.groups.compute)
        with torch.inference_mode():
            out = self.fn(**inputs)
        return out[0] if isinstance(out, (list, tuple)) else out


def serve_worker(runner: _RankRunner, channel: StepChannel) -> None:
    """A follower rank's loop: run every step rank 0 broadcasts, until it says stop."""
    while True:
        msg = channel.receive()
        if msg.op == OP_STOP:
            return
        if msg.op == OP_ALLOC:
            runner.allocate(msg.arg)
        elif msg.op == OP_STEP:
            if runner.pool is None:
                raise RuntimeError("rank 0 sent a step before any KV pool was allocated")
            runner.step({**msg.inputs, "kv_cache": runner.pool})
        else:
            raise RuntimeError(f"unknown message {msg.op} from rank 0")


def _exit_without_teardown(code: int) -> None:
    """End a follower rank's process. No interpreter teardown: nothing is left to flush but stdio, and tearing
    down gloo's threads and sockets under the interpreter's finalizers, the peer gone, is what can go wrong
    (it aborted a torchrun follower with SIGABRT once in a loaded test run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_command(directory: Path, rank: int, world: int, port: int, threads: int, status_fd: int) -> list[str]:
    """The command line of follower rank ``rank``: this interpreter on kiln's worker entry point."""
    return [sys.executable, "-m", "kiln.runtime.tp_worker", str(directory), "--rank", str(rank), "--world",
            str(world), "--port", str(port), "--threads", str(threads), "--parent-pid", str(os.getpid()),
            "--status-fd", str(status_fd)]


class _SpawnedRanks:
    """The worker processes of ranks 1..N-1 started by this process (``python -m kiln.runtime.tp_worker``), and
    the watchdog over them."""

    def __init__(self, directory: Path, config: EngineConfig, threads: int):
        self.world = config.tp_size
        self.store = dist.TCPStore("127.0.0.1", 0, self.world, True, timeout=datetime.timedelta(seconds=120),
                                   wait_for_workers=False)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        try:
            for rank in range(1, self.world):
                ours, theirs = os.pipe()
                try:
                    cmd = worker_command(directory, rank, self.world, self.store.port, threads, theirs)
                    self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(theirs,)))
                except BaseException:
                    os.close(ours)
                    raise
                finally:
                    os.close(theirs)
                self.conns.append(multiprocessing.connection.Connection(ours, writable=False))
        except BaseException:
            self.kill()
            raise
        self.death: str | None = None
        self._closing = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _await(self, want: str, directory: Path) -> None:
        """Every worker's next status message (``want``), else EngineLoadError naming the rank and why."""
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.2):
                if p.poll() is not None:
                    raise EngineLoadError(f"{directory}: tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                                          f"{p.returncode} while starting (its error is above, on stderr)")
            try:
                status, detail = conn.recv()
            except EOFError:
                _wait(p, 5)
                raise EngineLoadError(f"{directory}: tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                                      f"{p.returncode} while starting (its error is above, on stderr)") from None
            if status == "error":
                raise EngineLoadError(f"rank {rank}: {detail}")
            if status != want:
                raise EngineLoadError(f"{directory}: tensor-parallel rank {rank} said {status!r}, expected {want!r}")

    def join_groups(self, directory: Path) -> _Groups:
        """Wait until every worker loaded its rank, then form the process groups with them."""
        self._await("loaded", directory)
        groups = _Groups.over_store(self.store, 0, self.world)
        self._await("joined", directory)
        for conn in self.conns:
            conn.close()
        return groups

    def watch(self, on_death) -> None:
        """Call ``on_death(message)`` from a watchdog thread when a worker exits while the engine is open."""

        def run(rank: int, p: subprocess.Popen) -> None:
            p.wait()
            if self._closing or self.death is not None:
                return
            self.death = describe_exit(rank, p.pid, p.returncode)
            on_death(self.death)

        for rank, p in enumerate(self.procs, start=1):
            threading.Thread(target=run, args=(rank, p), name=f"kiln-tp-watchdog-rank{rank}", daemon=True).start()

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Wait for the workers to exit (they were told to stop, or the engine is dead); kill stragglers."""
        self._closing = True
        deadline = time.monotonic() + timeout
        for p in self.procs:
            _wait(p, max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.poll() is None:
                logger.warning("tensor-parallel worker pid %d did not stop; killing it", p.pid)
                p.kill()
                _wait(p, 5)

    def kill(self) -> None:
        self._closing = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            _wait(p, 5)
        for conn in self.conns:
            conn.close()


def _wait(p: subprocess.Popen, timeout: float) -> None:
    """Wait up to ``timeout`` s for ``p`` to exit (reaped when it did)."""
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        pass


def describe_exit(rank: int, pid: int | None, code: int | None) -> str:
    killed = code is not None and code < 0 and -code in signal.valid_signals()
    how = f"killed by {signal.Signals(-code).name}" if killed else f"exit code {code}"
    return f"tensor-parallel rank {rank} (pid {pid}) died ({how})"


_open_engines: weakref.WeakSet[TensorParallelEngine] = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_open_engines):
        engine.close()


class TensorParallelEngine(Engine):
    """Rank 0 of a tensor-parallel engine: its own graph, and the other ranks following its steps."""

    def __init__(self, directory: Path, config: EngineConfig, fn: Any, groups: _Groups,
                 workers: _SpawnedRanks | None, ranks_here: int):
        super().__init__(directory, config, fn)
        self._runner = _RankRunner(config, fn, groups)
        self._channel = StepChannel(groups.control, config.bounds)
        self._workers = workers
        self._ranks_here = ranks_here
        self._lock = threading.Lock()       # one message at a time on the control group
        self._dead: str | None = None
        self._closed = False
        _open_engines.add(self)
        if workers is not None:
            workers.watch(self._on_worker_death)

    # ---- starting -----------------------------------------------------------------------------------------
    @classmethod
    def start(cls, directory: Path, config: EngineConfig, threads_per_rank: int | None = None) -> Engine:
        """Rank 0 with its workers (spawned, or torchrun's); on a follower rank under torchrun, serve and exit."""
        for rank in range(config.tp_size):   # every rank's file, before any process starts
            check_rank_file(directory, config.tensor_parallel, rank, config.engine_files[rank])
        joined = torchrun_world()
        if joined is not None:
            return cls._join(directory, config, threads_per_rank, *joined)
        threads = default_threads(config.tp_size, threads_per_rank)
        torch.set_num_threads(threads)
        logger.info("tensor-parallel engine %s: %d ranks on this machine, %d torch thread(s) each", directory,
                    config.tp_size, threads)
        workers = _SpawnedRanks(directory, config, threads)
        try:
            fn = load_rank_graph(directory, config, 0)
            groups = workers.join_groups(directory)
        except BaseException:
            workers.kill()
            raise
        return cls(directory, config, fn, groups, workers, config.tp_size)

    @classmethod
    def _join(cls, directory: Path, config: EngineConfig, threads_per_rank: int | None, rank: int, world: int,
              ranks_here: int) -> Engine:
        if world != config.tp_size:
            raise EngineLoadError(f"{directory}: launched as {world} ranks (WORLD_SIZE={world}) but the engine has "
                                  f"tp_size={config.tp_size}; start {config.tp_size} processes "
                                  f"(torchrun --nproc-per-node {config.tp_size} ...)")
        torch.set_num_threads(default_threads(ranks_here, threads_per_rank))
        fn = load_rank_graph(directory, config, rank)
        groups = _Groups.joined()
        if rank == 0:
            return cls(directory, config, fn, groups, None, ranks_here)
        serve_worker(_RankRunner(config, fn, groups), StepChannel(groups.control, config.bounds))
        _exit_without_teardown(0)   # rank 0 shut down: this rank's process has nothing else to do

    # ---- the Engine interface -----------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in the pools of all ranks on this machine (they share its memory)."""
        return self.config.kv_bytes_per_token * self._ranks_here

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks this process started (empty under torchrun)."""
        return self._workers.pids if self._workers is not None else []

    def comm_stats(self) -> dict[str, float]:
        """Calls and seconds of rank 0 in the step broadcast and (this process's) collectives since start: the
        collectives' time includes waiting for the slowest rank to arrive (``scripts/bench_tp.py`` reads it)."""
        out = {"broadcast_calls": self._channel.calls, "broadcast_seconds": self._channel.seconds}
        for op, s in collectives.stats().items():
            out.update({f"{op}_calls": s["calls"], f"{op}_seconds": s["seconds"], f"{op}_bytes": s["bytes"]})
        return out

    @property
    def failure(self) -> str | None:
        """Why the engine cannot run (a rank died, or it was closed); None while it can."""
        return self._dead or ("the engine is closed" if self._closed else None)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """A pool of ``num_blocks`` blocks of rank 0's KV heads; every other rank allocates its part. Each reads as
        zeros (fresh zero pages, :mod:`kiln.runtime.zero_pages`). It replaces the previous pool (its steps are
        refused from now on)."""
        if num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}")
        with self._lock:
            self._check_alive()
            self._channel.send(OP_ALLOC, num_blocks)
            return self._runner.allocate(num_blocks)

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step on every rank: ``inputs['kv_cache']`` must be the pool the last ``allocate_kv_cache``
        returned (rank 0's part; the other ranks use theirs)."""
        check_inputs(inputs, self.config)
        if inputs["kv_cache"] is not self._runner.pool:
            raise EngineInputError("kv_cache is not the pool this engine's last allocate_kv_cache returned: the other "
                                   "ranks hold their part of that pool only (a tensor-parallel engine serves one pool, "
                                   "so one LLM, at a time)")
        with self._lock:
            self._check_alive()
            try:
                self._channel.send_step(inputs)
                logits = self._runner.step(inputs)
            except BaseException as exc:
                raise self._declare_dead(exc) from exc
        return logits if logits.dtype == torch.float32 else logits.float()

    __call__ = run

    def close(self) -> None:
        """Stop every other rank (idempotent). The engine cannot run afterwards."""
        if self._closed:
            return
        acquired = self._lock.acquire(timeout=STOP_WAIT_S)   # let a running step end first
        try:
            self._closed = True
            _open_engines.discard(self)
            if self._dead is None:
                try:
                    self._channel.send(OP_STOP)
                except Exception as exc:   # a rank is gone: the workers are stopped below either way
                    logger.warning("could not tell the tensor-parallel ranks to stop: %s", exc)
            if self._workers is not None:
                self._workers.stop()
                self._workers.store = None
            # the groups' sockets and threads go now, not under the interpreter's finalizers at exit
            self._runner.groups.release()
            self._runner.groups = self._channel.group = None
        finally:
            if acquired:
                self._lock.release()

    # ---- failure ------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"{self._dead}; the engine cannot run any more: recreate the LLM")
        if self._closed:
            raise EngineDeadError("the tensor-parallel engine is closed")

    def _on_worker_death(self, message: str) -> None:
        logger.error("%s", message)
        if self._dead is None:
            self._dead = message

    def _declare_dead(self, exc: BaseException) -> EngineDeadError:
        """A step failed after its broadcast: the ranks are out of step for good. Name the rank that died when
        one did (its exit is seen within a second of the failed collective), stop the others."""
        if self._workers is not None:
            deadline = time.monotonic() + 2.0
            while self._workers.death is None and time.monotonic() < deadline:
                time.sleep(0.02)
            self._dead = self._workers.death
        if self._dead is None:   # no rank exited: one hung (a collective timed out), or rank 0's own graph failed
            first = str(exc).splitlines()[0][:300] if str(exc) else ""
            self._dead = (f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {first}); a rank that "
                          f"does not answer fails its collectives after {collective_timeout().total_seconds():g} s "
                          f"({TIMEOUT_ENV})")
        if self._workers is not None:
            self._workers.kill()
        _open_engines.discard(self)
        return EngineDeadError(f"{self._dead}; the engine cannot run any more: recreate the LLM")

    def __repr__(self) -> str:
        return (f"TensorParallelEngine({str(self.directory)!r}, {self.config.model.architecture}, "
                f"backend={self.backend}, tp_size={self.config.tp_size})")
