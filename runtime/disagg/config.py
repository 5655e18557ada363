"""The disaggregated mode's options, defined once: ``kiln serve`` (both frontends) derives its command-line options
from these fields (``kiln.clikit``), the Triton model reads them back from its config.pbtxt parameters, and
``llm`` turns them into the LLM a server runs (a colocated ``LLM`` when ``prefill_workers`` is 0)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln.contract import ConfigError


@dataclass(frozen=True)
class DisaggConfig:
    prefill_workers: int = field(default=0, metadata={"help": (
        "Disaggregated serving: this many prefill worker processes (and --decode-workers decode ones), each with "
        "its own LLM; KV blocks move from prefill to decode workers over torch.distributed. 0: one colocated LLM.")})
    decode_workers: int = field(default=1, metadata={"help": "Decode worker processes (with --prefill-workers)."})
    worker_threads: int | None = field(default=None, metadata={"help": (
        "Torch threads per prefill/decode worker; default: the CPUs shared evenly (local workers), every CPU of "
        "the worker's host (--worker-listen).")})
    worker_listen: str | None = field(default=None, metadata={"help": (
        "HOST:PORT. Start no workers: wait for --prefill-workers and --decode-workers to connect here with "
        "`kiln worker --role ROLE --connect HOST:PORT ENGINE` (KILN_WORKER_KEY: the same secret on both); "
        "restarted workers rejoin, extra ones add capacity. See docs/disaggregated.md.")})
    kv_store_port: int = field(default=0, metadata={"help": (
        "Port of the TCPStore the workers' KV transfer pairs meet on (0: a free one).")})
    transfer_timeout: float = field(default=30.0, metadata={"help": (
        "Seconds one request's KV transfer may take before only that request fails.")})

    def __post_init__(self) -> None:
        for name, low in (("prefill_workers", 0), ("decode_workers", 1), ("kv_store_port", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.kv_store_port > 65535:
            raise ConfigError(f"kv_store_port must be a port number (0..65535), got {self.kv_store_port}")
        if self.worker_threads is not None and not (isinstance(self.worker_threads, int) and self.worker_threads >= 1):
            raise ConfigError(f"worker_threads must be an integer >= 1, got {self.worker_threads!r}")
        if not (isinstance(self.transfer_timeout, (int, float)) and self.transfer_timeout > 0):
            raise ConfigError(f"transfer_timeout must be > 0 seconds, got {self.transfer_timeout!r}")
        if self.worker_listen and not self.prefill_workers:
            raise ConfigError("worker_listen needs prefill_workers N (how many prefill workers to wait for; "
                              "decode_workers likewise)")

    @property
    def enabled(self) -> bool:
        return self.prefill_workers > 0

    def llm(self, engine_dir: str | Path, config, lora_modules: dict[str, str] | None = None):
        """The LLM a server runs: ``DisaggLLM`` with these workers, or a colocated ``LLM`` (prefill_workers 0)."""
        from kiln.runtime import LLM
        from kiln.runtime.disagg.cluster import DisaggLLM

        if not self.enabled:
            return LLM(engine_dir, config=config, lora_modules=lora_modules)
        if lora_modules:
            raise ConfigError("disaggregated serving (prefill_workers > 0) serves no LoRA adapters yet")
        return DisaggLLM(engine_dir, config=config, prefill_workers=self.prefill_workers,
                         decode_workers=self.decode_workers, worker_threads=self.worker_threads,
                         transfer_timeout=self.transfer_timeout, listen=self.worker_listen,
                         kv_store_port=self.kv_store_port)
