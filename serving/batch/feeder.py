"""Feeding batch lines to the engine through a bounded window: at most ``window`` lines are in the runtime at
once (so the scheduler's waiting queue stays short and online requests, at a higher priority, are admitted
ahead of a small set rather than a backlog of thousands)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from kiln.serving.batch.dispatch import Dispatcher, Unanswered
from kiln.serving.batch.lines import BatchLine

OnAnswer = Callable[[BatchLine, int, dict], None]


class Feeder:
    """Runs lines ``window`` at a time; ``on_answer(line, status, body)`` for each answered line. Lines the
    runtime aborted (``cancel``, shutdown) are not answered: whoever owns the batch runs them again."""

    def __init__(self, dispatcher: Dispatcher, window: int):
        if window < 1:
            raise ValueError(f"the batch window must be at least 1, got {window}")
        self.dispatcher, self.window = dispatcher, window
        self.tasks: set[asyncio.Task] = set()
        self.num_unanswered = 0

    async def run(self, lines: Iterable[BatchLine], on_answer: OnAnswer) -> None:
        """Answer every line (returns when the last one is answered, or at ``cancel``)."""
        slots = asyncio.Semaphore(self.window)
        self._cancelled = False

        async def one(line: BatchLine) -> None:
            try:
                status, body = await self.dispatcher.answer(line.url, line.body)
            except Unanswered:
                self.num_unanswered += 1
                return
            on_answer(line, status, body)

        def done(task: asyncio.Task) -> None:   # also for a task cancelled before it started
            self.tasks.discard(task)
            slots.release()

        for line in lines:
            await slots.acquire()
            if self._cancelled:
                slots.release()
                break
            task = asyncio.ensure_future(one(line))
            self.tasks.add(task)
            task.add_done_callback(done)
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    def cancel(self) -> None:
        """Stop feeding and abort the lines in flight (their runtime requests end; they stay unanswered)."""
        self._cancelled = True
        for task in list(self.tasks):
            task.cancel()

    @property
    def in_flight(self) -> int:
        return len(self.tasks)
