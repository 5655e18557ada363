"""``kiln triton-repo`` (render a Triton model repository) and ``kiln serve --frontend triton`` (render one and run
the bundled tritonserver on it; serving/cli.py dispatches to :func:`serve`)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import click

from kiln.build_flags import build_config_from, build_options, resolve
from kiln.clikit import dataclass_options, given
from kiln.contract import ConfigError, EngineLoadError
from kiln.runtime import ExecutorConfig
from kiln.runtime.disagg.config import DisaggConfig
from kiln.serving.triton.repository import OptionError, RepoOptions, render_repository

_EXECUTOR_EXCLUDE = ("metrics_window",)
# Triton has one exit timeout for requests in flight and for unloading; unloading one instance took 2.5-3.5 s
# here (Triton's 1 s poll, finalize, then the backend stub's interpreter teardown with torch loaded)
UNLOAD_S_PER_INSTANCE = 5
# After SIGTERM, a model with no request in flight whose unload (finalize) has not begun this long after the
# server began unloading is held by tritonserver itself: waiting for its exit timeout would only delay the exit
UNLOAD_STALL_S = 4.0


def repository_options(fn):
    """The options both commands render a repository with: the model's, and ExecutorConfig's (kiln.clikit)."""
    options = [
        click.option("--model-name", default="kiln", show_default=True,
                     help="Triton model name; 'ensemble' makes a drop-in for clients of TensorRT-LLM's backend."),
        click.option("--instances", type=int, default=1, show_default=True,
                     help="Model instances (instance_group count): each is a process with its own LLM and KV pool."),
        click.option("--decoupled/--no-decoupled", default=True, show_default=True,
                     help="Decoupled: streaming (gRPC stream, /generate_stream). Not: one response per request "
                          "(/infer)."),
        click.option("--max-queue-size", type=int, default=0, show_default=True,
                     help="Refuse new requests ('overloaded') while this many wait for their first token; 0: no "
                          "limit."),
        click.option("--copy-engine", is_flag=True,
                     help="Copy the engine into the repository (a self-contained folder to mount in a container)."),
        click.option("--lora-modules", multiple=True, metavar="NAME=PATH",
                     help="A PEFT LoRA adapter the model loads as NAME (requests send lora_name NAME, or "
                          "lora_task_id N for the name 'N'); repeat for more. The engine must take adapters."),
        click.option("--int64-inputs", is_flag=True,
                     help="Declare the integer inputs INT64: JSON clients' numbers arrive as sent (an INT32 input "
                          "takes 2**32+5 as 5) and out-of-range ones are refused by name; typed clients must send "
                          "INT64 (TensorRT-LLM's send INT32, which tritonserver then refuses)."),
        dataclass_options(DisaggConfig),
        dataclass_options(ExecutorConfig, exclude=_EXECUTOR_EXCLUDE),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _repo_options(kw: dict) -> RepoOptions:
    try:
        runtime = ExecutorConfig(**given(ExecutorConfig, kw, exclude=_EXECUTOR_EXCLUDE))
        disagg = DisaggConfig(**given(DisaggConfig, kw))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    return RepoOptions(model_name=kw.pop("model_name"), instances=kw.pop("instances"), decoupled=kw.pop("decoupled"),
                       copy_engine=kw.pop("copy_engine"), max_queue_size=kw.pop("max_queue_size"), runtime=runtime,
                       lora_modules=tuple(_absolute(spec) for spec in kw.pop("lora_modules")),
                       int64_inputs=kw.pop("int64_inputs"), disagg=disagg)


def _absolute(spec: str) -> str:
    """NAME=PATH with PATH absolute (tritonserver runs elsewhere); a spec without '=' is left to be refused."""
    name, sep, path = spec.partition("=")
    return f"{name}={Path(path).resolve()}" if sep and path else spec


def _render(engine_dir: Path, output: Path, options: RepoOptions) -> Path:
    try:
        return render_repository(engine_dir, output, options)
    except EngineLoadError as exc:
        raise click.BadParameter(str(exc), param_hint="'ENGINE_DIR'") from None
    except OptionError as exc:
        hint = "'ENGINE_DIR'" if exc.option == "engine_dir" else f"'--{exc.option.replace('_', '-')}'"
        raise click.BadParameter(f"{exc.value!r}: allowed values are {exc.allowed}", param_hint=hint) from None


@click.command("triton-repo")
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="Model repository folder.")
@repository_options
def triton_repo(engine_dir: Path, output: Path, **kw) -> None:
    """Render a Triton Inference Server model repository (Python backend) serving ENGINE_DIR with kiln."""
    model_dir = _render(engine_dir, output, _repo_options(kw))
    click.echo(f"wrote {model_dir}/config.pbtxt and {model_dir}/1/model.py")
    click.echo(f"run: tritonserver --model-repository={output.resolve()}  (its Python needs kiln-llm installed)")


@click.command("serve")
@click.argument("model_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the HTTP, gRPC and metrics ports listen on.")
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@repository_options
@click.option("--work-dir", type=click.Path(path_type=Path), default=None,
              help="Render the repository here and keep it (default: a temporary folder removed at exit).")
@click.option("--startup-timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the model to load (a first run may compile kiln's kernels).")
@click.option("--shutdown-timeout", type=int, default=5, show_default=True,
              help="On SIGTERM/SIGINT, seconds requests in flight get to finish before they are aborted; "
                   f"unloading the model gets {UNLOAD_S_PER_INSTANCE} s per instance more.")
@click.option("--quiet", is_flag=True, help="Do not relay the server's log (errors are still printed).")
@build_options
def serve(model_dir: Path, host: str, http_port: int, grpc_port: int, metrics_port: int,
          work_dir: Path | None, startup_timeout: float, shutdown_timeout: int, quiet: bool, **kw) -> None:
    """Serve MODEL_DIR with NVIDIA Triton Inference Server (`kiln serve --frontend triton`): render a model
    repository and run the tritonserver of the kiln-llm[triton] extra on it until SIGINT/SIGTERM. MODEL_DIR is
    an engine directory or a Hugging Face checkpoint (built on first use into the engine cache with the
    [checkpoint build] flags, as for the openai frontend)."""
    from kiln.serving.triton.launcher import LauncherError, Ports, TritonServer

    build = build_config_from(kw)
    options = _repo_options(kw)
    engine_dir = resolve(model_dir, *build)
    workdir = work_dir if work_dir is not None else Path(tempfile.mkdtemp(prefix="kiln-triton-"))
    try:
        repository = workdir / "repository"
        if repository.exists() and work_dir is not None:
            shutil.rmtree(repository / options.model_name, ignore_errors=True)
        _render(engine_dir, repository, options)
        server = TritonServer(repository, workdir, Ports(http_port, grpc_port, metrics_port), host=host,
                              exit_timeout_s=shutdown_timeout + UNLOAD_S_PER_INSTANCE * options.instances,
                              log=None if quiet else functools.partial(click.echo, err=True))
        received = []

        def on_signal(signum, _frame) -> None:
            received.append(signum)
            if len(received) == 1:
                click.echo(f"kiln: {signal.Signals(signum).name}: stopping tritonserver "
                           f"(requests in flight get {shutdown_timeout} s)", err=True)
                server.terminate()
            elif server.process is not None:   # a second signal: do not wait
                os.killpg(server.process.pid, signal.SIGKILL)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            click.echo(f"kiln: starting tritonserver for {engine_dir} (model {options.model_name!r})", err=True)
            try:
                server.start()
                if received:   # a signal before the server existed: stop it as soon as it does
                    server.terminate()
                server.wait_ready(startup_timeout)
            except LauncherError as exc:
                if received and server.process is not None and server.process.poll() in (0, -signal.SIGTERM):
                    # SIGTERM/SIGINT before this loop saw the server ready (it polls every 0.25 s; a client
                    # polling on its own can be done by then): a stop that was asked for; tritonserver exits 0, or
                    # of the SIGTERM itself while it is still loading the model (wait_ready removed what was left)
                    click.echo(f"kiln: {signal.Signals(received[0]).name} while tritonserver was starting: stopped",
                               err=True)
                    return
                click.echo(f"kiln: {exc}; the server said:", err=True)
                for line in exc.log_lines:
                    click.echo(f"  {line}", err=True)
                sys.exit(1)
            urls = server.urls
            mode = "streaming" if options.decoupled else "one response per request"
            click.echo(f"kiln: Triton is ready: HTTP {urls['http']}  gRPC {urls['grpc']}  metrics {urls['metrics']}  "
                       f"(model {options.model_name!r}, {mode})")
            stalled = False
            while server.wait(0.25) is None:
                if server.unload_stalled(UNLOAD_STALL_S):
                    click.echo(f"kiln: warning: no request is in flight, but tritonserver has not begun unloading "
                               f"the model {UNLOAD_STALL_S:g} s after it said it would (it still holds a reference "
                               "to it); stopping it", err=True)
                    server.kill()
                    stalled = True
                    break
            code = server.stop()
            if stalled:
                code = 0   # nothing was lost: its requests had all ended, and stop() removed what was left
        finally:
            if server.process is not None and server.process.poll() is None:
                server.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
        if code != 0:
            click.echo(f"kiln: tritonserver exited with code {code}", err=True)
            sys.exit(1)
    finally:
        if work_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
