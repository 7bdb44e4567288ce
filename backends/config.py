"""Per-backend configuration blocks, selected by `backend.type`.

Plain pydantic models (no settings loading here): `pylon.config.Settings`
embeds them as one discriminated section, so each adapter carries only its
own options and a typo in a key fails loudly.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

U32_MAX = 2**32 - 1
"""Dynamo parses the strict tier as a u32."""

MAX_SGLANG_SCALE = 2**31 - 1
"""Bounds level x scale below 2**62, so the emitted priority stays a plain
64-bit JSON integer every engine parser takes."""


class _BackendConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PassthroughConfig(_BackendConfig):
    """Any OpenAI-compatible server; no engine priority is written."""

    type: Literal["passthrough"] = "passthrough"


class DynamoStrictBand(_BackendConfig):
    """Platform levels at or below `max_level` get strict tier `tier`."""

    max_level: int = Field(ge=0)
    tier: int = Field(ge=0, le=U32_MAX)


class DynamoConfig(_BackendConfig):
    type: Literal["dynamo"] = "dynamo"
    strict_priority: int = Field(default=0, ge=0, le=U32_MAX)
    """Router queue tier written on every request (compared before priority);
    with bands, the tier for levels above every band's `max_level`."""
    strict_tier_bands: tuple[DynamoStrictBand, ...] = ()
    """Optional hard tiers by platform level; the first band that matches wins.
    Empty (the default) writes `strict_priority` on every request."""

    @model_validator(mode="after")
    def _bands_keep_urgency_order(self) -> Self:
        """A more urgent level must never land in a lower tier (higher tier wins).

        So bands go from most to least urgent (strictly increasing `max_level`),
        tiers never rise along them, and the fallback is no higher than the last.
        """
        levels = [band.max_level for band in self.strict_tier_bands]
        tiers = [band.tier for band in self.strict_tier_bands] + [self.strict_priority]
        if any(a >= b for a, b in pairwise(levels)):
            raise ValueError("strict_tier_bands: max_level must strictly increase")
        if any(a < b for a, b in pairwise(tiers)):
            raise ValueError(
                "strict_tier_bands: tiers must not increase along the bands, "
                "and strict_priority (the fallback) must not exceed the last tier"
            )
        return self


class VllmConfig(_BackendConfig):
    type: Literal["vllm"] = "vllm"


class SglangConfig(_BackendConfig):
    type: Literal["sglang"] = "sglang"
    priority_scheduling: bool = False
    """Whether the engine runs with --enable-priority-scheduling; when off no
    priority is sent (the engine may answer 503 to one)."""
    low_values_first: bool = False
    """Matches the engine's --schedule-low-priority-values-first."""
    scale: int = Field(default=1, ge=1, le=MAX_SGLANG_SCALE)
    """Multiplier so platform levels can cross the engine's preemption threshold."""


BackendConfig = Annotated[
    PassthroughConfig | DynamoConfig | VllmConfig | SglangConfig,
    Field(discriminator="type"),
]
