"""The engine cache: a Hugging Face checkpoint built once per (content, BuildConfig, kiln, torch), then reused.

``cached_engine(checkpoint, build)`` returns the engine directory of that checkpoint and build, building it
(through ``kiln.builder``) into the cache when it is not there yet. The cache lives in ``$KILN_CACHE_DIR``
(default ``~/.cache/kiln/engines``); each entry is ``<checkpoint name>-<key>/``, where the key is a SHA-256
over the checkpoint's content (every file the build reads: config.json, the safetensors shards and index,
the tokenizer files), the resolved BuildConfig, kiln's and torch's versions and the engine format. A
changed weight, flag, kiln or torch gives a new entry; the same ones give the same entry.

Hashing gigabytes of weights on every call would cost seconds, so each file's digest is remembered
(``checkpoint-digests.json`` in the cache) under its path, size, modification time and inode: a file
that was not touched is not read again (as git's index does). Two processes asking for the same entry
at once build it once: the second waits on a lock file, then finds it built. An interrupted build leaves
no entry (the builder writes into a temporary directory it renames at the end).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiln.contract import FORMAT_VERSION, TOKENIZER_FILES, is_engine_dir

CACHE_ENV = "KILN_CACHE_DIR"
DIGESTS_FILE = "checkpoint-digests.json"
KEY_CHARS = 16

logger = logging.getLogger("kiln.ondemand")


def cache_dir() -> Path:
    """Where built engines are kept: $KILN_CACHE_DIR, else ~/.cache/kiln/engines."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kiln" / "engines"


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """The files of a checkpoint that a build reads, sorted by name."""
    names = {"config.json", *TOKENIZER_FILES}
    files = [p for p in checkpoint.iterdir() if p.is_file() and (
        p.name in names or p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json"))]
    return sorted(files, key=lambda p: p.name)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class _Digests:
    """File digests remembered by (path, size, mtime, inode), in the cache directory."""

    def __init__(self, root: Path):
        self.path = root / DIGESTS_FILE
        try:
            self.known: dict[str, Any] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.changed = False

    def digest(self, path: Path) -> str:
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        key = str(path.resolve())
        entry = self.known.get(key)
        if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        digest = _sha256(path)
        self.known[key] = {"stamp": stamp, "sha256": digest}
        self.changed = True
        return digest

    def save(self) -> None:
        if not self.changed:
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.known, indent=0))
        tmp.replace(self.path)   # atomic: a concurrent reader sees the old or the new file


def cache_key(checkpoint: Path, build_dict: dict[str, Any], root: Path | None = None) -> str:
    """The entry key of ``checkpoint`` built with ``build_dict`` (a resolved BuildConfig's to_dict())."""
    import torch

    from kiln.builder.build import kiln_version

    root = root or cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    digests = _Digests(root)
    content = {p.name: digests.digest(p) for p in checkpoint_files(checkpoint)}
    digests.save()
    facts = {"checkpoint": content, "build": build_dict, "kiln": kiln_version(), "torch": torch.__version__,
             "format_version": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:KEY_CHARS]


def entry_dir(checkpoint: Path, key: str, root: Path | None = None) -> Path:
    """The entry of ``key``: an existing one (built from a checkpoint of the same content, wherever it was), else
    ``<checkpoint name>-<key>``."""
    root = root or cache_dir()
    built = sorted(p for p in root.glob(f"*-{key}") if is_engine_dir(p))
    if built:
        return built[0]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", checkpoint.resolve().name) or "checkpoint"
    return root / f"{name}-{key}"


@contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (created), held for the block: one builder per entry."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_engine(checkpoint: Path, build, progress: Callable[[str, str], None] | None = None) -> Path:
    """The engine directory of ``checkpoint`` built with ``build`` (a BuildConfig): from the cache, or built into
    it now (``progress(stage, message)`` as build_engine calls it). Logs which of the two happened."""
    from kiln.builder import build_engine
    from kiln.plugins.openmp_teams import on_own_thread

    build = build.resolved()
    root = cache_dir()
    key = cache_key(checkpoint, build.to_dict(), root)
    out = entry_dir(checkpoint, key, root)
    if is_engine_dir(out):
        logger.info("using the cached engine %s for %s (no build)", out, checkpoint)
        return out
    with _locked(out.with_name(out.name + ".lock")):
        if is_engine_dir(out):   # another process built it while this one waited
            logger.info("using the cached engine %s for %s, built meanwhile by another process", out, checkpoint)
            return out
        logger.info("building an engine for %s into the cache (%s; %s, %s, max_seq_len %d): the next call with "
                    "this checkpoint and build config loads it without building", checkpoint, out, build.backend,
                    build.dtype, build.max_seq_len)
        t0 = time.perf_counter()
        # on a thread that ends with the build: its parallel kernels leave no OpenMP team on this thread, which
        # may go on to serve the engine (kiln.plugins.openmp_teams)
        on_own_thread(build_engine, checkpoint, out, build, progress=progress, name="kiln-build")
        logger.info("engine built in %.1f s: %s", time.perf_counter() - t0, out)
    return out
