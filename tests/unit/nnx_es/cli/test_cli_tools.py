"""replay / inspect command lines: exit codes, output shapes, and the tools/ launchers."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_runs import RUN_ID, Run, clean, find, template  # noqa: F401 (fixtures)

from events.codec import KINDS
from events.log import LmdbLog
from nnx_es.cli import inspect as inspect_cli
from nnx_es.cli import replay as replay_cli

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture
def broken(clean: Run) -> Run:
    """The clean run with its finalization order swapped (invariant 8)."""
    first = find(clean.events, "callback_finalized", 0)
    with LmdbLog(clean.log_path) as log:
        a, b = (raw for _, raw in log.read_raw(first, first + 2))
        log.put_raw(first, b)
        log.put_raw(first + 1, a)
    return clean


# --- replay --------------------------------------------------------------------------------


def test_replay_clean_run_exits_0_with_a_readable_report(clean: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_cli.main([str(clean.run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: run 'r1' (completed), 0 violations")
    assert "events: 46" in out and "committed epoch: 1" in out and "tail: 0" in out


def test_replay_json_has_the_report_shape(clean: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_cli.main([str(clean.run_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["events"] == 46 and doc["committed_epoch"] == 1 and doc["tail"] == 0
    assert doc["violations"] == []


def test_replay_violation_exits_1_and_names_seq_and_invariant(broken: Run, capsys: pytest.CaptureFixture[str]) -> None:
    seq = find(broken.events, "callback_finalized", 0)
    assert replay_cli.main([str(broken.run_dir)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED")
    assert f"seq {seq}  invariant 8  callbacks are not finalized in reverse order" in out
    assert "(expected saver#1, found logger#0)" in out


def test_replay_json_violation_fields(broken: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_cli.main(["--json", str(broken.run_dir)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    (v,) = doc["violations"]
    assert set(v) >= {"seq", "invariant", "message", "expected", "found"}
    assert (v["seq"], v["invariant"], v["expected"], v["found"]) == (
        find(broken.events, "callback_finalized", 0), 8, "saver#1", "logger#0")


@pytest.mark.parametrize("make", ["missing", "empty_dir", "a_file"])
def test_replay_unusable_input_exits_2(make: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "x"
    if make == "empty_dir":
        target.mkdir()
    elif make == "a_file":
        target.write_text("not a run")
    assert replay_cli.main([str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("replay: ") and str(target) in captured.err


def test_replay_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_cli.main([]) == 2
    assert "usage" in capsys.readouterr().err


# --- inspect -------------------------------------------------------------------------------


def test_inspect_json_lines_carry_seq_kind_and_every_field(clean: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_cli.main([str(clean.run_dir), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["seq"] for r in rows] == list(range(46))
    assert [r["kind"] for r in rows] == [e.KIND for e in clean.events]
    receipt = rows[find(clean.events, "update_committed")]
    assert receipt["version"] == 2
    assert {"step", "epoch", "microbatches", "local_examples", "global_examples", "loss", "grad_norm",
            "clipped", "lrs", "optimizer", "data_parallel_size", "precision"} <= set(receipt)


def test_inspect_filters_by_kind_range_and_limit(clean: Run, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(clean.run_dir), "--json", "--kind", "last_committed", "--kind", "best_committed,epoch_began"]
    assert inspect_cli.main(argv) == 0
    kinds = [json.loads(line)["kind"] for line in capsys.readouterr().out.splitlines()]
    assert kinds == ["last_committed", "epoch_began", "last_committed", "best_committed", "epoch_began",
                     "last_committed", "last_committed"]
    assert inspect_cli.main([str(clean.run_dir), "--json", "--from", "6", "--to", "9"]) == 0
    assert [json.loads(x)["seq"] for x in capsys.readouterr().out.splitlines()] == [6, 7, 8, 9]
    assert inspect_cli.main([str(clean.run_dir), "--json", "--kind", "microbatch_done", "--limit", "3"]) == 0
    assert [json.loads(x)["seq"] for x in capsys.readouterr().out.splitlines()] == [7, 8, 11]


def test_inspect_plain_table_is_aligned(clean: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_cli.main([str(clean.run_dir), "--to", "9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["seq", "kind", "fields"]
    assert len(lines) == 11
    column = lines[0].index("kind")
    assert all(line[column:].split()[0] in KINDS for line in lines[1:])
    assert "manifest=" in lines[6] and "epoch=-1" in lines[6]  # last_committed, hash shortened
    assert "step=1" in lines[10] and "lrs=[0.1]" in lines[10]


def test_inspect_shows_an_undecodable_value_without_failing(clean: Run, capsys: pytest.CaptureFixture[str]) -> None:
    with LmdbLog(clean.log_path) as log:
        log.put_raw(3, b"\xc1")
    assert inspect_cli.main([str(clean.run_dir), "--from", "3", "--to", "3"]) == 0
    assert "<undecodable>" in capsys.readouterr().out
    assert inspect_cli.main([str(clean.run_dir), "--json", "--from", "3", "--to", "3"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["seq"] == 3 and row["kind"] is None and row["error"]


def test_inspect_summary(clean: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_cli.main([str(clean.run_dir), "summary"]) == 0
    out = capsys.readouterr().out
    for needle in ("status", "completed", "epochs", "2 committed", "LAST", "BEST", "value=0.8", "lr sgd",
                   "counters", "batch=8", "tail", "0 uncommitted"):
        assert needle in out
    assert inspect_cli.main([str(clean.run_dir), "summary", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "completed" and doc["epochs"] == 2 and doc["tail"] == 0 and doc["events"] == 46
    assert doc["last"]["epoch"] == 1 and doc["best"]["epoch"] == 0 and doc["lrs"] == {"sgd": [0.0729]}
    assert doc["counters"]["step"] == 3


@pytest.mark.parametrize(
    "argv",
    [["{missing}"], ["{run}", "--kind", "no_such_kind"], ["{run}", "plot-nothing"], ["{run}", "--from", "-1"],
     ["{run}", "summary", "--kind", "epoch_began"]],
)
def test_inspect_unusable_input_exits_2(argv: list[str], clean: Run, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    args = [a.format(missing=tmp_path / "nope", run=clean.run_dir) for a in argv]
    assert inspect_cli.main(args) == 2
    assert capsys.readouterr().err


# --- the executables -----------------------------------------------------------------------


def test_tools_replay_runs_as_an_executable(clean: Run) -> None:
    tool = REPO / "tools" / "replay"
    assert os.access(tool, os.X_OK)
    done = subprocess.run([str(tool), str(clean.run_dir), "--json"], capture_output=True, text=True, timeout=120,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
    missing = subprocess.run([sys.executable, str(tool), "/nonexistent/run"], capture_output=True, text=True,
                             timeout=120, cwd="/")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_tools_inspect_runs_as_an_executable(clean: Run) -> None:
    tool = REPO / "tools" / "inspect"
    assert os.access(tool, os.X_OK)
    done = subprocess.run([str(tool), str(clean.run_dir), "summary", "--json"], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["run_id"] == RUN_ID


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_inspect_on_a_terminal_renders_with_rich(clean: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    screen = _Tty()
    monkeypatch.setattr(sys, "stdout", screen)
    assert inspect_cli.main([str(clean.run_dir), "--to", "5"]) == 0
    assert inspect_cli.main([str(clean.run_dir), "summary"]) == 0
    text = screen.getvalue()
    assert "run_started" in text and "last_committed" in text and "completed" in text and "BEST" in text


def test_replay_interrupted_by_ctrl_c_exits_130_without_a_traceback(monkeypatch, tmp_path, capsys):
    import nnx_es.cli.replay as replay_cli

    def interrupted(run_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(replay_cli, "audit_run", interrupted)
    assert replay_cli.main([str(tmp_path)]) == 130
    assert capsys.readouterr().err == ""
