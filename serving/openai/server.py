"""Run the OpenAI-compatible server: load the LLM, bind, serve with uvicorn, drain on SIGTERM/SIGINT.

uvicorn's own signal handling is switched off (it would stop at once and re-raise the signal after
``serve`` returns, so the process would die by SIGTERM instead of exiting 0). Here the first SIGTERM or
SIGINT stops accepting (/v1 and /health answer 503), lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, aborts the rest (their clients get a 503 or an error event), then stops
uvicorn and the step loop; the process exits 0. A second signal skips the wait.

Connections: uvicorn's h11 protocol with deadlines for each request's headers and body (http_protocol.py), its
keep-alive timeout, and its concurrency limit (connections and requests in flight; beyond it new requests get
503).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import uvicorn

from kiln.contract.summary import format_table, summary_rows
from kiln.runtime.disagg.config import DisaggConfig
from kiln.serving.openai.http_protocol import DeadlineH11Protocol

logger = logging.getLogger("kiln.serving")


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000                        # 0: any free port (the URL printed at startup says which)
    served_model_name: str | None = None    # default: the engine directory's name
    api_key: str | None = None
    max_waiting: int = 256
    chat_template: Path | None = None
    tool_call_parser: str | None = None     # default: the one the chat template's tool-call format needs
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    timeout_keep_alive: float = 5.0         # an idle kept-alive connection is closed after this
    timeout_request_headers: float = 10.0   # a request's headers must arrive within this
    timeout_request_body: float = 30.0      # and its body within this after them
    max_connections: int = 1024             # connections + requests in flight beyond which requests get 503
    metrics_require_key: bool = False       # /metrics needs the API key too
    prompt_workers: int = 1                 # threads that parse, render and tokenize large prompts
    lora_modules: tuple[str, ...] = ()      # "name=path" of each LoRA adapter loaded at start
    enable_lora_runtime_loading: bool = False
    batch_store: Path | None = None         # /v1/files + /v1/batches, state in DIR/batches.sqlite3
    batch_window: int | None = None         # batch lines in the engine at once; default max_batch_size
    disagg: DisaggConfig = DisaggConfig()   # prefill_workers > 0: disaggregated prefill/decode workers


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: kiln's drain decides when it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets; without it the body written
    # after the headers waits for the client's delayed ACK (~40 ms per response, and per stream's first event)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _print_summary(llm, engine_dir: Path, chat_template: bool, tool_call_parser: str | None) -> None:
    """The engine summary `kiln inspect` prints, the KV pool plan, whether chat has a template and how
    tool calls are parsed."""
    report = engine_dir / "build_report.json"
    rows = summary_rows(llm.engine.config, json.loads(report.read_text()) if report.is_file() else None)
    rows.append(("chat template",
                 "yes" if chat_template else "none: /v1/chat/completions answers 400 (see --chat-template)"))
    rows.append(("tool-call parser", tool_call_parser or "none: tool_choice 'auto' answers 400 (see "
                                                         "--tool-call-parser); 'required' and named calls work"))
    click.echo(format_table(rows))
    click.echo(llm.executor.kv_plan)


async def _serve(server: _Server, sock: socket.socket, state, shutdown_timeout: float, url: str,
                 batch=None) -> None:
    loop = asyncio.get_running_loop()
    drain: asyncio.Task | None = None
    if batch is not None:
        batch.start()

    async def drain_then_stop(sig: str) -> None:
        state.accepting = False
        if batch is not None:   # unfinished batch lines stay in the store for the next start
            await batch.stop()
        busy = len(state.streams)
        click.echo(f"kiln serve: {sig}: no new requests; waiting up to {shutdown_timeout:g} s for {busy} in flight",
                   err=True)
        if not await state.wait_idle(shutdown_timeout):
            click.echo(f"kiln serve: aborting {len(state.streams)} requests still running", err=True)
            state.abort_all()
            await state.wait_idle(10.0)
        server.should_exit = True

    def on_signal(sig: signal.Signals) -> None:
        nonlocal drain
        if drain is None:
            drain = loop.create_task(drain_then_stop(sig.name))
        else:   # a second signal: stop waiting
            state.abort_all()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        click.echo(f"kiln serve: listening on {url} (OpenAI API at {url}/v1)")

    announcer = loop.create_task(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def lora_modules(specs: tuple[str, ...]) -> dict[str, str]:
    """``--lora-modules name=path ...`` as LLM's lora_modules (a ClickException naming a malformed one)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise click.ClickException(f"--lora-modules {spec!r}: give NAME=PATH (a PEFT adapter directory)")
        if name in out:
            raise click.ClickException(f"--lora-modules names {name!r} twice")
        out[name.strip()] = path.strip()
    return out


def _batch_api(app, llm, settings: ServeSettings, name: str, template, parser):
    from kiln.serving.batch.api import add_batch_api
    from kiln.serving.batch.store import BatchStore
    from kiln.serving.openai.app import engine_fingerprint

    window = settings.batch_window or int(llm.stats()["config"]["max_batch_size"])
    store = BatchStore(settings.batch_store)
    click.echo(f"kiln serve: batch store {store.path} (window {window})")
    return add_batch_api(app, llm, store, window=window, model_name=name, fingerprint=engine_fingerprint(llm),
                         chat_template=template, tool_call_parser=parser)


def run(model_dir: Path, settings: ServeSettings, executor_options: dict,
        build: tuple[dict | None, Path | None] = (None, None)) -> int:
    """Serve until SIGTERM/SIGINT; the process exit code. ``model_dir``: an engine directory or a Hugging Face
    checkpoint (built into the engine cache with ``build``: the given BuildConfig fields and YAML path);
    ``executor_options``: ExecutorConfig's fields."""
    from kiln.build_flags import resolve
    from kiln.contract import AdapterLoadError
    from kiln.runtime import ConfigError, EngineLoadError, ExecutorConfig
    from kiln.serving.chat_template import ChatTemplateError, load_chat_template
    from kiln.serving.openai.app import create_app
    from kiln.serving.openai.tool_parsers import detect_parser

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ExecutorConfig(**executor_options)   # option errors before the engine takes seconds to load
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    engine_dir = resolve(model_dir, *build)
    try:
        template = load_chat_template(engine_dir, settings.chat_template)
    except ChatTemplateError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"kiln serve: loading {engine_dir}")
    try:
        pd = settings.disagg
        if pd.enabled and (settings.lora_modules or settings.batch_store):
            raise click.ClickException("--prefill-workers serves no LoRA adapters and no Batch API yet")
        if pd.worker_listen:
            click.echo(f"kiln serve: waiting for {pd.prefill_workers} prefill and {pd.decode_workers} decode "
                       f"workers on {pd.worker_listen}")
        llm = pd.llm(engine_dir, config, lora_modules(settings.lora_modules))
    except (EngineLoadError, ConfigError, AdapterLoadError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        parser = settings.tool_call_parser or detect_parser(template.source if template is not None else None)
        _print_summary(llm, engine_dir, template is not None, parser)
        name = settings.served_model_name or model_dir.resolve().name
        app = create_app(llm, model_name=name, api_key=settings.api_key, max_waiting=settings.max_waiting,
                         chat_template=template, tool_call_parser=parser,
                         metrics_require_key=settings.metrics_require_key, prompt_workers=settings.prompt_workers,
                         enable_lora_runtime_loading=settings.enable_lora_runtime_loading)
        sock = _bind(settings.host, settings.port)
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        protocol = functools.partial(DeadlineH11Protocol, header_timeout=settings.timeout_request_headers,
                                     body_timeout=settings.timeout_request_body)
        config = uvicorn.Config(app, http=protocol, log_level=settings.log_level, lifespan="off",
                                timeout_graceful_shutdown=10, timeout_keep_alive=settings.timeout_keep_alive,
                                limit_concurrency=settings.max_connections)
        server = _Server(config)
        batch = _batch_api(app, llm, settings, name, template, parser) if settings.batch_store else None
        try:
            asyncio.run(_serve(server, sock, app.state.serving, settings.shutdown_timeout, url, batch))
        finally:
            app.state.serving.workers.shutdown()
        sock.close()
    finally:
        llm.shutdown()
    click.echo("kiln serve: stopped")
    return 0
