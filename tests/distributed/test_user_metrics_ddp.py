"""A per-row user metric under a 2-rank torchrun equals one process's on the union of the ranks' batches
(its sums join the epoch's one agreement)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ddpkit
from launch import results, torchrun

SCRIPT = Path(__file__).resolve().parent / "metrics_scenarios.py"


def test_a_weighted_row_metric_is_the_unions_on_every_rank(tmp_path):
    from metrics_scenarios import max_logit

    model = ddpkit.net()
    t = ddpkit.trainer(model, runs_root=tmp_path / "ref", run_id="ref", metrics={"max_logit": max_logit})
    ref = t.fit(ddpkit.UnionLoader(ddpkit.dataset()), epochs=2)
    out = tmp_path / "ddp"
    out.mkdir()
    proc = torchrun(SCRIPT, str(out), "user_metrics", timeout_s=180)
    assert proc.returncode == 0, proc.stdout[-6000:]
    r0, r1 = results(out, "user_metrics")
    assert r0.get("ok"), r0.get("traceback") or r0
    assert r0["train"] == r1["train"]  # every rank the same records
    for got, want in zip(r0["train"], ref.history):
        assert got["max_logit"] == pytest.approx(want.train["max_logit"], rel=1e-5)
