"""Logging set-up: text for people, one JSON object per line for log pipelines."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
import types
from collections.abc import Mapping

LOG_CONTEXT: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "kvbroker_log_context", default=types.MappingProxyType({}))
"""Fields (transfer id, op, peer, backend) added to every log line written while a transfer runs."""


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ctx = LOG_CONTEXT.get()
        record.kv = ctx
        record.kv_text = "".join(f" {k}={v}" for k, v in ctx.items())
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **getattr(record, "kv", {}),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s%(kv_text)s"))
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
