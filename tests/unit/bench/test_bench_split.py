"""``bench.ddp_split`` separates what nnx_es DDP pays per fit from what it pays per epoch, and splits the
per-epoch part by thread: the arithmetic is checked here on numbers built from a known split (the
timings themselves belong to the benchmark)."""

from __future__ import annotations

import pytest

from bench.ddp_split import fit_line, main, report


def test_fit_line_recovers_a_line_and_refuses_one_epoch_count() -> None:
    assert fit_line([(2, 7.0), (10, 31.0)]) == pytest.approx((1.0, 3.0))
    assert fit_line([(1, 2.5), (3, 6.5), (5, 10.5)]) == pytest.approx((0.5, 2.0))
    with pytest.raises(ValueError, match=r"two distinct epoch counts, got \[4\]"):
        fit_line([(4, 1.0), (4, 2.0)])


def test_the_report_splits_a_known_excess_by_fit_epoch_and_thread() -> None:
    # nnx_es over the floor: 5 ms a fit on the training thread; per epoch 3 ms of epoch end, 2.9 ms of
    # microbatches (100 us each over 29), 1 ms on the other threads
    def row(epochs: int, nnx: bool) -> dict[str, float]:
        base = {"process": 0.05 * epochs + 0.02, "main": 0.03 * epochs + 0.01, "end": 0.001 * epochs}
        if nnx:
            base = {"process": base["process"] + 0.005 + epochs * (0.003 + 0.0029 + 0.001),
                    "main": base["main"] + 0.005 + epochs * (0.003 + 0.0029), "end": base["end"] + 0.003 * epochs}
        return base

    rows = {f"{name}@{e}": [row(e, name == "nnx_es")] * 3 for e in (2, 10) for name in ("floor", "nnx_es")}
    text = report({"ranks": [rows, rows], "batches": 29}, [2, 10], 3)
    table = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("0", "1"):
            table[cells[0], cells[1]] = tuple(float(c) for c in cells[2:])
    for rank in ("0", "1"):
        assert table[rank, "all threads"] == pytest.approx((5.0, 6.9, 238), abs=0.5)
        assert table[rank, "the training thread"] == pytest.approx((5.0, 5.9, 203), abs=0.5)
        assert table[rank, "its epoch ends"] == pytest.approx((0.0, 3.0, 103), abs=0.5)
        assert table[rank, "its microbatches"] == pytest.approx((5.0, 2.9, 100), abs=0.5)
        assert table[rank, "other threads (gloo)"] == pytest.approx((0.0, 1.0, 34), abs=0.5)


def test_one_epoch_count_is_refused_before_any_launch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--epochs", "5"])
    assert info.value.code == 2 and "two or more distinct counts >= 1, got [5]" in capsys.readouterr().err
