"""``python -m kiln.runtime.disagg``: ``kiln worker`` (how the frontend starts its local workers)."""

from kiln.runtime.disagg.worker import worker

worker()
