"""normalize_level: the one priority policy every backend shares."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from backends.priority import (
    DEFAULT_PRIORITY_CEILING,
    MAX_PRIORITY_CEILING,
    AbsentPriority,
    PriorityPolicy,
    normalize_level,
)

U32_MAX = 2**32 - 1

# No deadline: these are pure functions, and a loaded CI box must not flake.
pure = settings(deadline=None)

platform_priorities = st.integers(min_value=0, max_value=U32_MAX)
policies = st.builds(
    PriorityPolicy,
    ceiling=st.integers(min_value=1, max_value=MAX_PRIORITY_CEILING),
    absent=st.sampled_from(AbsentPriority),
)


@pytest.mark.parametrize(
    ("priority", "ceiling", "absent", "expected"),
    [
        (0, 1000, AbsentPriority.LOWEST, 0),
        (1, 1000, AbsentPriority.LOWEST, 1),
        (999, 1000, AbsentPriority.LOWEST, 999),
        (1000, 1000, AbsentPriority.LOWEST, 1000),
        (1001, 1000, AbsentPriority.LOWEST, 1000),
        (U32_MAX, 1000, AbsentPriority.LOWEST, 1000),
        (None, 1000, AbsentPriority.LOWEST, 1000),
        (None, 1000, AbsentPriority.OMIT, None),
        (0, 1000, AbsentPriority.OMIT, 0),
        (7, 5, AbsentPriority.LOWEST, 5),
        (None, 5, AbsentPriority.LOWEST, 5),
        (U32_MAX, MAX_PRIORITY_CEILING, AbsentPriority.LOWEST, MAX_PRIORITY_CEILING),
    ],
)
def test_normalize_level_table(
    priority: int | None, ceiling: int, absent: AbsentPriority, expected: int | None
) -> None:
    policy = PriorityPolicy(ceiling=ceiling, absent=absent)
    assert normalize_level(priority, policy) == expected


def test_default_policy_is_bounded_and_absent_lowest() -> None:
    policy = PriorityPolicy()
    assert policy.ceiling == DEFAULT_PRIORITY_CEILING == 1000
    assert policy.absent is AbsentPriority.LOWEST


@pytest.mark.parametrize("ceiling", [0, -1, MAX_PRIORITY_CEILING + 1])
def test_ceiling_outside_engine_range_is_rejected(ceiling: int) -> None:
    with pytest.raises(ValidationError):
        PriorityPolicy(ceiling=ceiling)


def test_unknown_absent_policy_is_rejected() -> None:
    with pytest.raises(ValidationError):
        PriorityPolicy.model_validate({"absent": "highest"})


@pure
@given(policy=policies, p=platform_priorities)
def test_level_is_bounded(policy: PriorityPolicy, p: int) -> None:
    level = normalize_level(p, policy)
    assert level is not None
    assert 0 <= level <= policy.ceiling


@pure
@given(policy=policies, a=platform_priorities, b=platform_priorities)
def test_level_is_monotonic(policy: PriorityPolicy, a: int, b: int) -> None:
    low, high = sorted((a, b))
    level_low, level_high = normalize_level(low, policy), normalize_level(high, policy)
    assert level_low is not None
    assert level_high is not None
    assert level_low <= level_high


@pure
@given(policy=policies, p=platform_priorities)
def test_level_keeps_order_below_the_ceiling(policy: PriorityPolicy, p: int) -> None:
    """Clamping only merges levels past the ceiling; below it the level is p."""
    if p <= policy.ceiling:
        assert normalize_level(p, policy) == p


@pure
@given(policy=policies, p=platform_priorities)
def test_absent_is_never_more_urgent_than_any_priority(policy: PriorityPolicy, p: int) -> None:
    absent = normalize_level(None, policy)
    if policy.absent is AbsentPriority.OMIT:
        assert absent is None
        return
    level = normalize_level(p, policy)
    assert absent == policy.ceiling
    assert level is not None
    assert absent >= level
