"""The server's batch worker: an asyncio task that runs the store's unfinished batches one at a time, oldest
first (also those a killed server left), feeding each line through the ``Feeder`` and committing each
answer as it arrives."""

from __future__ import annotations

import asyncio
import logging

from kiln.serving.batch.feeder import Feeder
from kiln.serving.batch.lines import parse_lines
from kiln.serving.batch.store import BatchStore

logger = logging.getLogger("kiln.serving")


class BatchWorker:
    def __init__(self, store: BatchStore, feeder: Feeder):
        self.store, self.feeder = store, feeder
        self.current: str | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        """Start on the running event loop (the server's)."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """The store marked ``batch_id`` cancelling: abort its lines in flight (they stay unanswered)."""
        if self.current == batch_id:
            self.feeder.cancel()
        self.wake()

    async def stop(self) -> None:
        """Stop feeding and abort what is in flight; the store keeps every unfinished batch for the next start."""
        self._stopping = True
        self.feeder.dispatcher.state.accepting = False
        self.feeder.cancel()
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while not self._stopping:
            batch = self.store.next_active()
            if batch is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                if not await self._run(batch["id"]) and not self._stopping:
                    await asyncio.sleep(0.5)   # lines left unanswered (the engine refused them): try again
            except Exception:   # a store or programming error: logged, the batch stays for a restart
                logger.exception("batch worker: batch %s failed", batch["id"])
                await asyncio.sleep(1.0)

    async def _run(self, bid: str) -> bool:
        """Run one batch as far as it goes; True if it ended."""
        self.current = bid
        try:
            if self.store.status(bid) == "validating":
                batch = self.store.batch(bid)
                data = self.store.file_content(batch["input_file_id"]) or b""
                items = parse_lines(data)
                self.store.start(bid, [_check_endpoint(it, batch["endpoint"]) for it in items])
            if self.store.status(bid) == "in_progress":
                await self.feeder.run(self.store.pending(bid),
                                      lambda line, status, body: self.store.answer(bid, line, status, body))
            if self._stopping or (self.store.status(bid) == "in_progress" and self.store.pending(bid)):
                return False
            self.store.finish(bid)
            return True
        finally:
            self.current = None


def _check_endpoint(item, endpoint: str):
    """A line whose url is not the batch's endpoint is a line error (OpenAI: one endpoint per batch)."""
    from kiln.serving.batch.lines import BatchLine, LineError

    if isinstance(item, BatchLine) and item.url != endpoint:
        return LineError(item.line_no, item.custom_id, "invalid_url",
                         f"line {item.line_no} (custom_id {item.custom_id!r}): url {item.url!r} is not this "
                         f"batch's endpoint {endpoint!r}")
    return item
