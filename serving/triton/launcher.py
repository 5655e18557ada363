"""Run the ``tritonserver`` bundled in the ``nvidia-pytriton`` wheel (the ``kiln-llm[triton]`` extra) on a repository.

The wheel ships the server, its Python backend and one backend stub per Python version. The launcher gives the
server a backend folder whose stub matches the running Python, the library path that stub needs (the bundled
libraries and this Python's libpython) and this environment's ``bin`` first on ``PATH`` (so the stub imports
kiln and torch from here). It starts the server in its own session, relays its log, waits for readiness
while checking that it is alive, and on stop sends SIGTERM, kills what is left of the session after a
deadline, and removes the Python backend's shared-memory files (named with a per-server prefix, so other
servers on the machine are never touched).
"""

from __future__ import annotations

import collections
import importlib.util
import itertools
import os
import re
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region_"
_ERROR_LINE = re.compile(r"^E\d{4} |Traceback|Error|error:")
_NO_GPU_NOISE = re.compile(r"cuda|nvml|dcgm", re.IGNORECASE)   # harmless on a machine without a GPU
_servers = itertools.count()
# tritonserver's line once the requests in flight are done after SIGTERM, and kiln's model's line when its unload
# begins (serving/triton/model.py finalize)
_UNLOADING = "All models are stopped, unloading models"
_FINALIZE_BEGINS = "kiln: finalize: stopping the step loop"


class LauncherError(RuntimeError):
    """The server cannot be started (not installed, failed to load the model, not ready in time)."""

    def __init__(self, message: str, log_lines: list[str] | None = None):
        super().__init__(message)
        self.log_lines = log_lines or []


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backends: Path          # the wheel's backends folder (holds python/)
    stubs: Path             # python_backend_stubs/<X.Y>/triton_python_backend_stub
    libs: Path              # bundled shared libraries


def find_triton() -> TritonInstall:
    """The server bundled in nvidia-pytriton, or LauncherError saying how to install it."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise LauncherError("tritonserver is not installed: install the extra with `pip install 'kiln-llm[triton]'` "
                            "(it bundles the server in the nvidia-pytriton wheel)")
    root = Path(list(spec.submodule_search_locations)[0])
    server = root / "tritonserver"
    install = TritonInstall(server / "bin" / "tritonserver", server / "backends", server / "python_backend_stubs",
                            root.parent / "nvidia_pytriton.libs")
    if not install.binary.is_file():
        raise LauncherError(f"{install.binary}: missing from the nvidia-pytriton install; reinstall `kiln-llm[triton]`")
    return install


def prepare_backends(install: TritonInstall, workdir: Path) -> Path:
    """``workdir/backends/python`` with the Python backend (links) and the stub of the running Python."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = install.stubs / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in install.stubs.iterdir()) if install.stubs.is_dir() else []
        raise LauncherError(f"nvidia-pytriton has no Python-backend stub for Python {version} (it has {have})")
    backends = workdir / "backends"
    python = backends / "python"
    python.mkdir(parents=True, exist_ok=True)
    for src in (install.backends / "python" / "libtriton_python.so",
                install.backends / "python" / "triton_python_backend_utils.py"):
        link = python / src.name
        if not link.exists():
            link.symlink_to(src)
    # the stub runs the engine: it gets glibc's default (dynamic) mmap threshold back, not the one set for the server
    wrapper = python / stub.name
    wrapper.unlink(missing_ok=True)
    if _MMAP_THRESHOLD in os.environ:   # the user's own choice, for both
        wrapper.symlink_to(stub)
    else:
        wrapper.write_text(f"#!/bin/sh\nunset {_MMAP_THRESHOLD}\nexec '{stub}' \"$@\"\n")
        wrapper.chmod(0o755)
    return backends


_MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"


def server_environment(install: TritonInstall) -> dict[str, str]:
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(install.libs), libdir, env.get("LD_LIBRARY_PATH")) if p)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.prefix) / "bin"), env.get("PATH")) if p)
    # tritonserver holds each request's body, its parsed JSON and its tensors in buffers as large as the prompt; with
    # glibc's dynamic threshold those land in the heap and stay (RSS swung 50-190 MB after bursts of 15 MB prompts,
    # 2026-12-03), with a fixed one they are mapped and given back on free
    env.setdefault(_MMAP_THRESHOLD, str(1 << 20))
    return env


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def _session_pids(sid: int) -> list[int]:
    """Processes in session ``sid`` (the server and the backend stubs it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


class TritonServer:
    """One tritonserver process on a model repository.

    ``log`` receives each line the server prints (None: keep them only for error reports).
    """

    def __init__(self, repository: str | Path, workdir: str | Path, ports: Ports = Ports(), host: str = "127.0.0.1",
                 exit_timeout_s: int = 5, log: Callable[[str], None] | None = None, extra_args: tuple[str, ...] = ()):
        self.repository = Path(repository)
        self.workdir = Path(workdir)
        self.ports = ports
        self.host = host
        self.exit_timeout_s = exit_timeout_s
        self.log = log
        self.extra_args = extra_args
        self.shm_prefix = f"{SHM_PREFIX}kiln{os.getpid()}_{next(_servers)}_"
        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self.process: subprocess.Popen | None = None
        self._relay: threading.Thread | None = None
        self.unloading_since: float | None = None   # when the server said its requests were done and it unloads
        self.finalize_began = False                 # a kiln model instance's unload (finalize) has begun

    @property
    def urls(self) -> dict[str, str]:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return {"http": f"http://{host}:{self.ports.http}", "grpc": f"{host}:{self.ports.grpc}",
                "metrics": f"http://{host}:{self.ports.metrics}/metrics"}

    def start(self) -> None:
        install = find_triton()
        backends = prepare_backends(install, self.workdir)
        cmd = [
            str(install.binary), f"--model-repository={self.repository}", f"--backend-directory={backends}",
            f"--http-port={self.ports.http}", f"--grpc-port={self.ports.grpc}", f"--metrics-port={self.ports.metrics}",
            f"--http-address={self.host}", f"--grpc-address={self.host}", f"--metrics-address={self.host}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}", *self.extra_args,
        ]
        self.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        env=server_environment(install), start_new_session=True, text=True,
                                        errors="replace", bufsize=1)
        self._relay = threading.Thread(target=self._relay_output, name="tritonserver-log", daemon=True)
        self._relay.start()

    def _relay_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            self.watch_line(line)
            if self.log is not None:
                self.log(line)

    def watch_line(self, line: str) -> None:
        """Follow the shutdown in the server's log."""
        if self.unloading_since is None and _UNLOADING in line:
            self.unloading_since = time.monotonic()
        elif _FINALIZE_BEGINS in line:
            self.finalize_began = True

    def unload_stalled(self, after_s: float) -> bool:
        """True when, ``after_s`` seconds after the server began unloading, no kiln model's unload (finalize) has
        begun although no kiln model has a request in flight (its metrics): tritonserver itself still holds a
        reference to the model, and would hold it until its exit timeout, then exit with code 1. (A decoupled
        model's streams are not "in flight" to Triton: it unloads at once and waits for them to end, which is
        why the model's own count is read.)"""
        if (self.unloading_since is None or self.finalize_began
                or time.monotonic() - self.unloading_since <= after_s):
            return False
        active = self.requests_in_flight()
        return active == 0

    def requests_in_flight(self) -> float | None:
        """Requests in flight in kiln's model instances (``nv_trt_llm_request_metrics{request_type="active"}``
        summed), or None when the metrics cannot be read."""
        try:
            with urllib.request.urlopen(self.urls["metrics"], timeout=2) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        values = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                  if sample.name == "nv_trt_llm_request_metrics" and sample.labels.get("request_type") == "active"]
        return sum(values) if values else None

    def kill(self) -> None:
        """SIGKILL the server's session (the server and its backend stubs)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)

    def error_lines(self) -> list[str]:
        """The server's own error lines (model load failures, tracebacks), or its last lines if none."""
        lines = list(self.lines)
        errors = [ln for ln in lines if _ERROR_LINE.search(ln) and not _NO_GPU_NOISE.search(ln)]
        return errors or lines[-20:]

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.urls['http']}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Return once the server reports ready; LauncherError (with its error lines) if it exits or the deadline
        passes (then it is stopped)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                self._drain()
                code = self.process.returncode
                self.stop()
                raise LauncherError(f"tritonserver exited with code {code} before it was ready", self.error_lines())
            if self.is_ready():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise LauncherError(f"tritonserver was not ready within {timeout_s:.0f} s", self.error_lines())
            time.sleep(0.25)

    def _drain(self) -> None:
        if self._relay is not None:
            self._relay.join(timeout=5)

    def terminate(self) -> None:
        """Ask the server to exit (SIGTERM): it refuses new requests, lets those in flight finish for up to
        ``exit_timeout_s``, then unloads the model."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float | None = None) -> int | None:
        assert self.process is not None
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL to everything left in the server's session after ``timeout_s``; removes this
        server's shared-memory files. Safe to call twice. Returns the server's exit code."""
        if self.process is None:
            return None
        sid = self.process.pid
        self.terminate()
        code = self.wait(timeout_s)
        deadline = time.monotonic() + 5.0   # backend stubs exit on their own once the server is gone
        while (left := _session_pids(sid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if code is None:
            code = self.process.wait()
        self._drain()
        self.remove_shm()
        return code

    def processes(self) -> list[int]:
        """The server and its backend stubs (its session), while any is alive."""
        return _session_pids(self.process.pid) if self.process is not None else []

    def shm_files(self) -> list[Path]:
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*")) if SHM_DIR.is_dir() else []

    def remove_shm(self) -> None:
        for path in self.shm_files():
            path.unlink(missing_ok=True)
