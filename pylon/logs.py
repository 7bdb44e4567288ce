"""Logging set-up: JSON lines for machines, a readable line for `--dev`.

Access lines carry their fields as `extra=`; both formats include every field
a record carries beyond the standard ones. Bodies are never logged.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

_STANDARD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRIBUTES}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extra_fields(record),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class HumanFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in _extra_fields(record).items() if v is not None)
        base = f"{record.levelname.lower():7} {record.name}: {record.getMessage()}"
        text = f"{base} {fields}".rstrip()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure_logging(*, level: str, human: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(HumanFormatter() if human else JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aioquic and httpx are chatty at info; their warnings still show.
    for noisy in ("quic", "httpx", "httpcore", "aioquic"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
