"""The OpenAI-compatible HTTP frontend of ``kiln serve``: protocol (pydantic bodies), app (FastAPI routes),
generation (the bridge to ``LLM``), metrics, and server (uvicorn, with the drain on SIGTERM)."""
