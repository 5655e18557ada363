"""kiln.serving: network frontends over ``kiln.runtime.LLM``.

``kiln serve ENGINE_DIR`` (serving/cli.py) starts one; ``--frontend openai`` (the default) is the
OpenAI-compatible HTTP server in serving/openai/, ``--frontend triton`` runs NVIDIA Triton Inference Server
on a model repository rendered for the engine (serving/triton/). This package imports the runtime, never
the builder.
"""
