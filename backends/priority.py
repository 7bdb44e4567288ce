"""One priority policy for every backend: clamp, and normalize the absent case.

Platform priority `p` is a u32 where LOWER is MORE urgent and 0 is the most
urgent. It is clamped into [0, ceiling]: a bounded ceiling keeps the ordering
while leaving unconfigured traffic in a sane place (anchoring at i32::MAX made
every request with a priority outrank every request without one, forever,
because Dynamo reads priority as seconds of queue jump).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_PRIORITY_CEILING = 1000
"""Wide enough for many platform classes, small enough that Dynamo's
seconds-of-head-start reading stays within a working day's queue."""

MAX_PRIORITY_CEILING = 2**31 - 1
"""Every engine reads priority as a signed 32-bit integer at most."""


class AbsentPriority(StrEnum):
    LOWEST = "lowest"
    """Absent x-priority is treated as p = ceiling, the least urgent level."""
    OMIT = "omit"
    """Absent x-priority emits nothing; the engine applies its own default."""


class PriorityPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ceiling: int = Field(default=DEFAULT_PRIORITY_CEILING, ge=1, le=MAX_PRIORITY_CEILING)
    """Least urgent platform level; larger platform priorities clamp to it."""
    absent: AbsentPriority = AbsentPriority.LOWEST
    """How a request without x-priority is normalized."""


def normalize_level(platform_priority: int | None, policy: PriorityPolicy) -> int | None:
    """Normalized level in [0, ceiling] (lower = more urgent), or None to emit nothing."""
    if platform_priority is None:
        return policy.ceiling if policy.absent is AbsentPriority.LOWEST else None
    return min(max(platform_priority, 0), policy.ceiling)
