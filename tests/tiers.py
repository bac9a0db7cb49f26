"""The test tiers: `make test` runs the fast tier (every module, on a few cases), `make test-all` adds the slow one."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def tiered(values: Iterable, fast: Iterable) -> list:
    """`values` as pytest parameters, each not in `fast` marked for the slow tier (a parametrized test keeps a case
    or two in the fast tier and runs the rest in `make test-all`)."""
    fast = list(fast)
    return [pytest.param(value, marks=() if value in fast else pytest.mark.slow) for value in values]
