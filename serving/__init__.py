"""kiln.serving: network frontends over ``kiln.runtime.LLM``.

``kiln serve ENGINE_DIR`` (serving/cli.py) starts one; ``--frontend openai`` (the default) is the
OpenAI-compatible HTTP server in serving/openai/. This package imports the runtime, never the builder.
"""
