"""How every pagedserve process logs: one structured line per event, as text or as JSON objects."""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

from pythonjsonlogger.json import JsonFormatter

TEXT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
JSON_LOG_FIELDS = ["levelname", "name", "message"]  # plus "timestamp" (ISO 8601, UTC)
NOISY_LOGGERS = ("alembic.runtime.plugins", "httpx")
# transformers imports torchao eagerly: on a CPU host torchao's CUDA extensions fail to load and it registers enums
# that torch 2.13 deprecates, four harmless WARNING lines at every process start; their errors still show
IMPORT_NOISE_LOGGERS = ("torchao", "torch.utils._pytree")
# uvicorn gives these their own handlers; they pass their records to the root handler instead, in its format
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
_RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_installed_handler: logging.Handler | None = None


def log_event(logger: logging.Logger, event: str, **fields: Any) -> None:
    """One structured log line: the event name then key=value pairs (in JSON logs, `event` and one key per field)."""
    # a field named like a LogRecord attribute (name, module, ...) would make logging raise; it gets a _ suffix
    extra = {"event": event} | {f"{key}_" if key in _RECORD_ATTRIBUTES else key: value for key, value in fields.items()}
    logger.info("%s %s", event, " ".join(f"{key}={value}" for key, value in fields.items()), extra=extra)


def configure_logging(log_format: Literal["text", "json"]) -> None:
    """Log INFO and up to stderr, as text lines or as one JSON object per line (PAGEDSERVE_LOG_FORMAT)."""
    global _installed_handler
    if log_format not in ("text", "json"):
        raise ValueError(f"log_format must be 'text' or 'json', got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(JSON_LOG_FIELDS, timestamp=True) if log_format == "json"
                         else logging.Formatter(TEXT_LOG_FORMAT))
    root = logging.getLogger()
    if _installed_handler is not None:  # configured before in this process: replace only what we installed
        root.removeHandler(_installed_handler)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    _installed_handler = handler
    for name in UVICORN_LOGGERS:
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in IMPORT_NOISE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
