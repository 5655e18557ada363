"""Batch work on the serving engine: OpenAI's batch file format, ``kiln run-batch``, and ``/v1/files`` +
``/v1/batches`` on ``kiln serve`` (state in SQLite). Batch requests run the endpoints' own handlers at the
lowest priority, fed through a bounded window, so online requests go first."""
