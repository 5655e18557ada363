"""What every ``kiln serve`` frontend is given: the server options common to all of them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000                    # 0: any free port (the URL printed at startup says which)
    served_model_name: str | None = None   # default: the engine directory's name
    api_key: str | None = None
    max_waiting: int = 256
    chat_template: Path | None = None
    shutdown_timeout: float = 30.0
    log_level: str = "info"
