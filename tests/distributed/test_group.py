"""The process group's primitives under a 2-rank torchrun: agreement, partitions, shutdown."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch import results, torchrun

SCRIPT = Path(__file__).resolve().parent / "scenarios.py"


@pytest.fixture(scope="module")
def group_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("group")
    proc = torchrun(SCRIPT, str(out), "agree,partitions", timeout_s=90)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return out


def test_agree_gives_every_rank_the_same_answer(group_run: Path) -> None:
    r0, r1 = results(group_run, "agree")
    assert r0["ok"] and r1["ok"], (r0, r1)
    for r in (r0, r1):
        assert r["sum"] == [3.0, 3 * 2.0 ** -30, 1.0]
        assert r["max"] == [1.0]
        assert r["flag_any"] is True and r["flag_none"] is False
        assert r["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert r["big"] == [3, 100_000]  # larger than the gather's frame on rank 1 only: gathered again, grown
        assert r["after_big"] == [[0, "yyyyy"], [1, "yyyyy"]]  # and the next gather is one frame again
        assert r["shared"] == "from 0"
        assert r["size"] == 2
    assert (r0["writer"], r1["writer"]) == (True, False)


def test_partitions_deal_each_epoch_and_shard_validation_once(group_run: Path) -> None:
    r0, r1 = results(group_run, "partitions")
    assert r0["ok"] and r1["ok"], (r0, r1)
    for r in (r0, r1):
        assert r["train"]["0"] == r["expect0"] and len(r["train"]["0"]) == 6
        assert r["val"] == r["expect_val"]
    assert sorted(r0["val"] + r1["val"]) == list(range(11))  # every row scored exactly once
    assert set(r0["train"]["0"]) | set(r1["train"]["0"]) == set(range(11))
    assert r0["train"]["0"] != r0["train"]["1"]  # seed + epoch


def test_shutdown_destroys_the_group_and_a_second_call_does_nothing(group_run: Path) -> None:
    r0, r1 = results(group_run, "shutdown_ok")
    assert r0 == r1 == {"ok": True, "initialized": False}


def test_shutdown_raises_on_the_others_when_a_rank_never_arrives(tmp_path: Path) -> None:
    proc = torchrun(SCRIPT, str(tmp_path), "shutdown_missing", timeout_s=60)
    r0, r1 = results(tmp_path, "shutdown_missing")
    assert r1 == {"ok": True, "left": True}
    assert r0["raised"] == "RuntimeError", (r0, proc.stdout[-3000:])
    assert "teardown barrier" in r0["message"]
