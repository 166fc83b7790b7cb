"""Scenario script under torchrun for user metrics: the cases of :mod:`scenarios` plus ``user_metrics``.

    python -m torch.distributed.run ... tests/distributed/metrics_scenarios.py OUT_DIR user_metrics
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenario_base  # noqa: E402
import scenarios  # noqa: E402
from nnx_es.runtime.run_state import World  # noqa: E402


def max_logit(outputs: Any, targets: Any) -> Any:
    """A per-row metric whose value differs row by row: the row's largest logit."""
    return outputs.max(dim=1).values


@scenario_base.case
def user_metrics(world: World, out: Path) -> dict[str, Any]:
    _, _, result = scenario_base.train(world, out, "umetrics", metrics={"max_logit": max_logit})
    return {"train": [dict(r.train) for r in result.history]}


if __name__ == "__main__":
    scenarios.main()
