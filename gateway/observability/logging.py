"""Structured logs: one JSON object per line, the request id on every line logged while a request
is served, and secrets scrubbed before anything is written.

kvgate never logs prompt text unless `log_prompts` is on; the scrubber is the second line of
defence for keys: any `kvg-` gateway key, `sk-` style provider key, bearer token, or a configured
secret (admin key, upstream keys) is replaced by `[redacted]` in the message and its arguments.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from gateway.settings import Settings

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvgate_request_id", default=None)

REDACTED = "[redacted]"
_KEY_PATTERN = re.compile(r"(?i)(bearer\s+)\S+|\bkvg-[A-Za-z0-9_-]{8,}|\bsk-[A-Za-z0-9_-]{8,}")
# LogRecord attributes that are not `extra=` fields.
_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return _KEY_PATTERN.sub(lambda m: (m.group(1) or "") + REDACTED, text)


class RedactingFilter(logging.Filter):
    """Scrubs keys from the fully formatted message; attached to handlers, so it sees every line."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s and len(s) >= 6]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = scrub(message, self.secrets)
        if cleaned != message or record.args:
            record.msg, record.args = cleaned, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text, self.secrets)
        for name, value in list(record.__dict__.items()):
            if name not in _STANDARD_ATTRS and isinstance(value, str):
                setattr(record, name, scrub(value, self.secrets))
        return True


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", "request_id", ...extra fields, "exc"}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name, value in record.__dict__.items():
            if name not in _STANDARD_ATTRS and not name.startswith("_") and value is not None:
                entry[name] = value
        if record.exc_text:
            entry["exc"] = record.exc_text
        elif record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configured_secrets(settings: Settings) -> list[str]:
    secrets = [settings.admin_key or ""]
    secrets += [os.environ.get(u.api_key_env, "") for u in settings.upstreams if u.api_key_env]
    return [s for s in secrets if s]


def configure_logging(settings: Settings, stream: Any = None) -> logging.Handler:
    """Replace the root logger's handlers with one that writes JSON (or text) lines to stderr.
    Uvicorn's loggers propagate to it (run uvicorn with `log_config=None`)."""
    # transformers' and huggingface_hub's progress bars ("Loading weights ...") write to the same
    # stderr and would break the one-object-per-line stream; the engine logs its load instead.
    # Read when those libraries are first imported, which happens after this (in the lifespan).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    handler = logging.StreamHandler(stream or sys.stderr)
    if settings.observability.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    handler.addFilter(RequestIdFilter())
    handler.addFilter(RedactingFilter(configured_secrets(settings)))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    return handler
