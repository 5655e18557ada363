"""kiln.bench: load replay against an engine or a server (``kiln bench``) and capacity planning (``kiln plan``).

Imports the runtime (an in-process target, the pool-sizing function the planner shares with it), never the
builder. Plotting, HTTP and progress bars come from the ``bench`` extra: ``pip install 'kiln-llm[bench]'``.
"""
