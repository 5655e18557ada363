"""The batch store: uploaded files, batches and every line's answer in one SQLite database (WAL mode) in the
store directory, so a server killed at any instant resumes from what was committed.

Exactly once: a line's answer is written only while the line has none (``answer``), the output and error
files are assembled from the lines table in input order when the batch ends, and a batch's final status
is committed in the same transaction as its files. A line answered but not committed when the process
died simply runs again.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from pathlib import Path

from kiln.serving.batch.lines import BatchLine, LineError, error_line, is_error, response_line

DB_NAME = "batches.sqlite3"
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, created_at INTEGER NOT NULL, seq INTEGER NOT NULL, obj TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT, url TEXT, body TEXT,
    result TEXT, is_error INTEGER, PRIMARY KEY (batch_id, line_no));
"""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class BatchStore:
    """One connection, used from the server's event loop (each call is short: a few rows)."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / DB_NAME
        self.db = sqlite3.connect(self.path, isolation_level=None)   # explicit transactions below
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")   # a process kill loses nothing committed (an OS crash may)
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def _tx(self):
        return _Transaction(self.db)

    # ---- files ------------------------------------------------------------------------------------------
    def add_file(self, data: bytes, filename: str, purpose: str) -> dict:
        fid = new_id("file")
        self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", (fid, purpose, filename, len(data), now(), data))
        return self.file(fid)

    def file(self, fid: str) -> dict | None:
        row = self.db.execute("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ?",
                              (fid,)).fetchone()
        if row is None:
            return None
        return {"id": row[0], "object": "file", "purpose": row[1], "filename": row[2], "bytes": row[3],
                "created_at": row[4], "status": "processed", "status_details": None, "expires_at": None}

    def files(self) -> list[dict]:
        ids = [r[0] for r in self.db.execute("SELECT id FROM files ORDER BY created_at DESC, rowid DESC")]
        return [self.file(i) for i in ids]

    def file_content(self, fid: str) -> bytes | None:
        row = self.db.execute("SELECT data FROM files WHERE id = ?", (fid,)).fetchone()
        return None if row is None else bytes(row[0])

    # ---- batches ----------------------------------------------------------------------------------------
    def add_batch(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None) -> dict:
        bid = new_id("batch")
        created = now()
        obj = {"id": bid, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
               "completion_window": completion_window, "status": "validating", "output_file_id": None,
               "error_file_id": None, "created_at": created, "in_progress_at": None,
               "expires_at": created + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
               "expired_at": None, "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}
        seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
        self.db.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?)",
                        (bid, "validating", created, seq, json.dumps(obj)))
        return self.batch(bid)

    def _obj(self, bid: str) -> dict | None:
        row = self.db.execute("SELECT obj FROM batches WHERE id = ?", (bid,)).fetchone()
        return None if row is None else json.loads(row[0])

    def batch(self, bid: str) -> dict | None:
        """The OpenAI Batch object, its request counts as of now."""
        obj = self._obj(bid)
        if obj is not None and obj["status"] not in ("validating", "failed"):
            total, answered, failed = self.db.execute(
                "SELECT COUNT(*), COUNT(result), COALESCE(SUM(is_error), 0) FROM lines WHERE batch_id = ?",
                (bid,)).fetchone()
            obj["request_counts"] = {"total": total, "completed": answered - failed, "failed": failed}
        return obj

    def batches(self, limit: int, after: str | None) -> tuple[list[dict], bool]:
        """Newest first, ``limit`` of them after the batch ``after``; and whether more follow."""
        start = None
        if after is not None:
            row = self.db.execute("SELECT seq FROM batches WHERE id = ?", (after,)).fetchone()
            start = row[0] if row is not None else None
        sql, args = "SELECT id FROM batches", []
        if start is not None:
            sql, args = sql + " WHERE seq < ?", [start]
        ids = [r[0] for r in self.db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1))]
        return [self.batch(i) for i in ids[:limit]], len(ids) > limit

    def _set(self, bid: str, status: str, **fields) -> None:
        obj = self._obj(bid)
        obj.update(fields, status=status)
        self.db.execute("UPDATE batches SET status = ?, obj = ? WHERE id = ?", (status, json.dumps(obj), bid))

    def next_active(self) -> dict | None:
        """The oldest batch that is not finished (what the worker runs next)."""
        row = self.db.execute(f"SELECT id FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))}) "
                              "ORDER BY seq LIMIT 1", ACTIVE).fetchone()
        return None if row is None else self.batch(row[0])

    def status(self, bid: str) -> str | None:
        row = self.db.execute("SELECT status FROM batches WHERE id = ?", (bid,)).fetchone()
        return None if row is None else row[0]

    def cancel(self, bid: str) -> None:
        if self.status(bid) in ("validating", "in_progress"):
            self._set(bid, "cancelling", cancelling_at=now())

    # ---- lines ------------------------------------------------------------------------------------------
    def start(self, bid: str, items: list[BatchLine | LineError]) -> None:
        """validating -> in_progress with every line stored (line errors answered at once), or -> failed."""
        with self._tx():
            if self.status(bid) != "validating":
                return
            if not items:
                self._set(bid, "failed", failed_at=now(), errors={"object": "list", "data": [
                    {"code": "empty_file", "message": "the input file has no lines", "param": "input_file_id",
                     "line": None}]})
                return
            for it in items:
                if isinstance(it, BatchLine):
                    self.db.execute("INSERT INTO lines VALUES (?, ?, ?, ?, ?, NULL, NULL)",
                                    (bid, it.line_no, it.custom_id, it.url, json.dumps(it.body)))
                else:
                    self.db.execute("INSERT INTO lines VALUES (?, ?, ?, NULL, NULL, ?, 1)",
                                    (bid, it.line_no, it.custom_id, json.dumps(error_line(it))))
            self._set(bid, "in_progress", in_progress_at=now())

    def pending(self, bid: str) -> list[BatchLine]:
        rows = self.db.execute("SELECT line_no, custom_id, url, body FROM lines WHERE batch_id = ? AND result IS NULL "
                               "ORDER BY line_no", (bid,))
        return [BatchLine(n, c, u, json.loads(b)) for n, c, u, b in rows]

    def answer(self, bid: str, line: BatchLine, status_code: int, body: dict) -> None:
        """Record a line's answer unless it has one (a line is answered exactly once)."""
        record = response_line(line.custom_id, status_code, body)
        self.db.execute("UPDATE lines SET result = ?, is_error = ? WHERE batch_id = ? AND line_no = ? "
                        "AND result IS NULL", (json.dumps(record), int(is_error(record)), bid, line.line_no))

    def finish(self, bid: str) -> None:
        """in_progress -> finalizing -> completed, or cancelling -> cancelled: the output file (answers with a
        2xx status) and the error file (the others), in input order, committed with the final status."""
        status = self.status(bid)
        if status == "in_progress":
            self._set(bid, "finalizing", finalizing_at=now())
            status = "finalizing"
        final = {"finalizing": ("completed", "completed_at"), "cancelling": ("cancelled", "cancelled_at")}.get(status)
        if final is None:
            return
        with self._tx():
            rows = self.db.execute("SELECT result, is_error FROM lines WHERE batch_id = ? AND result IS NOT NULL "
                                   "ORDER BY line_no", (bid,)).fetchall()
            out = "".join(r + "\n" for r, e in rows if not e).encode()
            err = "".join(r + "\n" for r, e in rows if e).encode()
            ids = {}
            for key, data in (("output_file_id", out), ("error_file_id", err)):
                if data:
                    kind = "output" if key == "output_file_id" else "errors"
                    ids[key] = self.add_file(data, f"{bid}_{kind}.jsonl", "batch_output")["id"]
            self._set(bid, final[0], **{final[1]: now()}, **ids)


class _Transaction:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, *exc) -> None:
        self.db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
