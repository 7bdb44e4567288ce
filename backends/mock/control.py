"""The test-control plane of a mock engine: GET/DELETE/PUT /test-control.

Strategy: the engine's mutable state (behaviour, slot scheduler, recorder)
lives in one `ControlPlane`; both the HTTP route and `MockEngine`'s methods
go through it, so a test sees the same thing either way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from backends.mock.options import Behaviour, MockEngineOptions, apply_changes, initial_behaviour
from backends.mock.queue import SlotScheduler
from backends.mock.recorder import Recorder


class ControlPlane:
    """Behaviour, queue and records of one mock engine."""

    def __init__(self, options: MockEngineOptions) -> None:
        self._options = options
        self.behaviour: Behaviour = initial_behaviour(options)
        self.scheduler = SlotScheduler(options.slots)
        self.recorder = Recorder()

    def snapshot(self) -> dict[str, Any]:
        scheduler = self.scheduler
        return self.recorder.snapshot(queued=scheduler.waiting, running=scheduler.running)

    def clear(self) -> None:
        self.recorder.clear()

    def set_behaviour(self, changes: Mapping[str, Any]) -> None:
        """Apply PUT /test-control fields; `"reset": true` first restores the start-up values."""
        fields = dict(changes)
        base = initial_behaviour(self._options) if fields.pop("reset", False) else self.behaviour
        self.behaviour = apply_changes(base, fields)
        self.scheduler.set_slots(self.behaviour.slots)

    def handle(self, method: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if method == "GET":
            return 200, self.snapshot()
        if method == "DELETE":
            self.clear()
            return 200, {"cleared": True}
        if method == "PUT":
            return self._put(body)
        return 405, {"error": f"method {method} not allowed on /test-control"}

    def _put(self, body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            changes = json.loads(body)
            if not isinstance(changes, dict):
                raise ValueError("expected a JSON object")
            self.set_behaviour(changes)
        except (ValueError, TypeError) as exc:
            return 400, {"error": str(exc)}
        return 200, {"behaviour": _behaviour_json(self.behaviour)}


def _behaviour_json(behaviour: Behaviour) -> dict[str, Any]:
    return dict(vars(behaviour))
