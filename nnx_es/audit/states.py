"""How the audit compares a value stored in a checkpoint with the one the log projects."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["same_float", "same_scheduler_state"]


def same_float(a: Any, b: Any) -> bool:
    """Exact equality where two NaNs are the same value."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return a == b
    return a == b or (math.isnan(a) and math.isnan(b))


def same_scheduler_state(want: dict[str, Any], got: Any) -> bool:
    """Whether a stored scheduler state equals the projected one.

    Before its first step the log says nothing of a scheduler's learning rates
    or plateau state (``run_started`` declares neither), so only ``steps`` is compared.
    """
    if not isinstance(got, dict) or got.get("steps") != want["steps"]:
        return False
    if want["steps"] == 0:
        return True
    lrs = got.get("lrs")
    if not isinstance(lrs, list) or len(lrs) != len(want["lrs"]):
        return False
    if not all(isinstance(a, (int, float)) and same_float(float(a), b) for a, b in zip(lrs, want["lrs"])):
        return False
    wp, gp = want["plateau"], got.get("plateau")
    if wp is None or gp is None:
        return wp is None and gp is None
    return (
        isinstance(gp, dict)
        and same_float(gp.get("best"), wp["best"])
        and gp.get("num_bad_epochs") == wp["num_bad_epochs"]
        and gp.get("cooldown_counter") == wp["cooldown_counter"]
    )
