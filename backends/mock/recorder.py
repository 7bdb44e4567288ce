"""What the mock engine saw: one record per request, served at GET /test-control.

Strategy: a `RequestRecord` is created when a request's body is complete and
filled in as the request moves through the engine (resolved priority, slot
start, finish, abort); it is the one mutable value here, owned by the
request's handler. `Recorder` keeps the bounded history and the indexes the
snapshot exposes. Times are monotonic seconds passed in by the caller.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

MAX_RECORDS = 10_000
"""History bound: a long benchmark must not grow the mock without limit."""


@dataclass
class RequestRecord:
    """One request as the engine saw it (mutable: filled in as the request proceeds)."""

    method: str
    path: str
    model: str
    request_id: str
    x_request_id: str | None
    headers: list[list[str]]
    body_bytes: int
    body_sha256: str
    arrival_s: float
    priority_inputs: dict[str, Any] = field(default_factory=dict)
    routing_inputs: dict[str, Any] = field(default_factory=dict)
    resolved: dict[str, Any] | None = None
    stream: bool = False
    status: int | None = None
    start_s: float | None = None
    finish_s: float | None = None
    tokens_sent: int = 0
    aborted: bool = False

    @property
    def route(self) -> str:
        return f"{self.method} {self.path}"

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "model": self.model,
            "request_id": self.request_id,
            "x_request_id": self.x_request_id,
            "headers": self.headers,
            "priority_inputs": self.priority_inputs,
            "routing_inputs": self.routing_inputs,
            "resolved": self.resolved,
            "body_bytes": self.body_bytes,
            "body_sha256": self.body_sha256,
            "stream": self.stream,
            "status": self.status,
            "arrival_s": self.arrival_s,
            "start_s": self.start_s,
            "finish_s": self.finish_s,
            "tokens_sent": self.tokens_sent,
            "aborted": self.aborted,
        }


class Recorder:
    """Bounded request history plus the indexes GET /test-control returns."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=MAX_RECORDS)
        self._latest: dict[str, dict[str, RequestRecord]] = {}
        self._aborted: deque[str] = deque(maxlen=MAX_RECORDS)
        self._admin_calls: deque[str] = deque(maxlen=MAX_RECORDS)
        self._started: deque[str] = deque(maxlen=MAX_RECORDS)

    def arrived(self, record: RequestRecord) -> None:
        self._records.append(record)
        self._latest.setdefault(record.route, {})[record.model] = record

    def admin_call(self, path: str) -> None:
        self._admin_calls.append(path)

    def started(self, record: RequestRecord, now: float) -> None:
        record.start_s = now
        self._started.append(record.request_id)

    def finished(self, record: RequestRecord, now: float, *, aborted: bool = False) -> None:
        record.finish_s = now
        if aborted and not record.aborted:
            record.aborted = True
            self._aborted.append(record.request_id)

    def snapshot(self, *, queued: int, running: int) -> dict[str, Any]:
        latest = {
            route: {model: rec.to_json() for model, rec in by_model.items()}
            for route, by_model in self._latest.items()
        }
        return {
            "latest": latest,
            "requests": [rec.to_json() for rec in self._records],
            "aborted": list(self._aborted),
            "admin_calls": list(self._admin_calls),
            "started_order": list(self._started),
            "queued": queued,
            "running": running,
        }
