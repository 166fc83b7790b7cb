"""Readers of a damaged log say so: ``inspect`` in every mode, ``replay``'s errors as JSON, ``plot``'s destination.

A key changed on disk (bit rot in a key, :func:`crashkit.change_key`) past the range a bounded
read asks for used to end that read there without a word: ``inspect --json`` printed the events
before it and exited 0. The read now goes on by position (``events.chunks.ends_read``) and
``inspect`` names the damaged key on stderr, suggests ``tools/replay`` and exits 2; in a
``--json`` mode the error is also the last line of stdout, ``{"error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers_runs import Run, clean, template  # noqa: F401 (fixtures)

from crashkit import change_key
from events.log import LmdbLog
from nnx_es.cli import inspect as inspect_cli
from nnx_es.cli import replay as replay_cli
from nnx_es.errors import MissingDirectoryError
from nnx_es.plotting import plot_run

DAMAGED = 20
HIGH = DAMAGED | 1 << 40  # one high bit flipped: a key far past the log's end


def _damaged(run: Run) -> int:
    """Change key 20 of ``run`` to a key past the log's end; return how many events it holds."""
    n = len(run.events)
    assert n > 30
    change_key(run.log_path, DAMAGED, HIGH)
    return n


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _error_line(out: str) -> dict[str, Any]:
    last = _json_lines(out)[-1]
    assert set(last) == {"error"} and set(last["error"]) == {"type", "message"}, last
    return last["error"]


def test_a_bounded_read_of_a_log_with_a_changed_key_reads_every_entry(clean: Run):
    n = _damaged(clean)
    with LmdbLog(clean.log_path, readonly=True) as log:
        assert log.next_seq == n
        assert [s for s, _ in log.read_raw(0, n)] == [*range(DAMAGED), HIGH, *range(DAMAGED + 1, n)]
        assert sum(len(values) for _, values in log.read_chunks(0, n)) == n


@pytest.mark.parametrize("argv, lists", [
    ([], True), (["--json"], True), (["--to", str(DAMAGED + 5), "--json"], True), (["--follow"], True),
    (["summary"], False), (["summary", "--json"], False), (["--at", "30"], False), (["--at", "30", "--json"], False),
])
def test_inspect_on_a_damaged_log_says_so_and_exits_nonzero(clean: Run, capsys, argv: list[str], lists: bool):
    n = _damaged(clean)
    assert inspect_cli.main([str(clean.run_dir), *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert f"damaged at seq {DAMAGED}: changed key: key {HIGH} follows key {DAMAGED - 1}" in err
    assert f"run tools/replay {clean.run_dir}" in err
    if "--json" in argv:
        error = _error_line(captured.out)
        assert error["type"] == "SequenceGapError" and error["message"] in err
        rows = _json_lines(captured.out)[:-1]
    else:
        rows = captured.out.splitlines()[1:]  # under the header
    if lists:  # every stored event listed, the damaged key as stored: none dropped after it
        shown = n if "--to" not in argv else DAMAGED + 6
        assert len(rows) == shown
        if "--json" in argv:
            assert [r["seq"] for r in rows] == [*range(DAMAGED), HIGH, *range(DAMAGED + 1, shown)]
    else:  # nothing is projected from a log whose keys are damaged
        assert rows == []


def test_inspect_at_a_seq_before_the_damage_still_answers(clean: Run, capsys):
    _damaged(clean)
    assert inspect_cli.main([str(clean.run_dir), "--at", str(DAMAGED - 5), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["events"] == DAMAGED - 4


def test_plot_into_a_missing_directory_is_refused_naming_it_and_creates_nothing(clean: Run, tmp_path, capsys):
    out = tmp_path / "no" / "such" / "dir" / "x.png"
    assert inspect_cli.main([str(clean.run_dir), "plot", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"its directory {str(out.parent)!r} does not exist" in err
    assert not (tmp_path / "no").exists()
    with pytest.raises(MissingDirectoryError, match="does not exist; create it first"):
        plot_run(clean.run_dir, out)
    with pytest.raises(FileNotFoundError):  # the matching built-in
        plot_run(clean.run_dir, out)
    assert not (tmp_path / "no").exists()


# --- --json modes print their errors as JSON too ---------------------------------------------


@pytest.mark.parametrize("argv, error_type", [
    (["{missing}", "--json"], "NotARunError"),
    (["{missing}", "summary", "--json"], "NotARunError"),
    (["{run}", "summary", "--json", "--at", "3"], "UsageError"),  # an option summary would ignore
    (["{run}", "--json", "--to", "2", "--from", "5"], "UsageError"),
    (["{run}", "--json", "--kind", "no_such_kind"], "UsageError"),
    (["{run}", "--json", "--from", "minus"], "UsageError"),
])
def test_inspect_json_modes_print_an_error_object_on_stdout(clean: Run, tmp_path, capsys, argv, error_type):
    names = {"missing": str(tmp_path / "nowhere"), "run": str(clean.run_dir)}
    assert inspect_cli.main([a.format(**names) for a in argv]) == 2
    captured = capsys.readouterr()
    error = _error_line(captured.out)
    assert error["type"] == error_type and error["message"] and error["message"] in captured.err
    assert len(_json_lines(captured.out)) == 1


def test_inspect_without_json_prints_errors_on_stderr_only(clean: Run, tmp_path, capsys):
    assert inspect_cli.main([str(tmp_path / "nowhere")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "does not exist" in captured.err


@pytest.mark.parametrize("case", ["missing run directory", "bad option", "damaged log"])
def test_replay_json_prints_an_error_object_on_stdout(clean: Run, tmp_path, capsys, case):
    if case == "missing run directory":
        argv, error_type = [str(tmp_path / "nowhere"), "--json"], "NotARunError"
    elif case == "bad option":
        argv, error_type = [str(clean.run_dir), "--json", "--kind", "x"], "UsageError"
    else:  # LMDB cannot read it at all: unusable (a damaged key is a violation replay reports, exit 1)
        data = clean.log_path / "data.mdb"
        data.write_bytes(data.read_bytes()[: 3 * 4096])
        argv, error_type = [str(clean.run_dir), "--json"], "TruncatedLogError"
    assert replay_cli.main(argv) == 2
    captured = capsys.readouterr()
    error = _error_line(captured.out)
    assert error["type"] == error_type and error["message"] in captured.err
    assert replay_cli.main([a for a in argv if a != "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err  # plain text on stderr, as before


def test_replay_json_reports_a_damaged_key_as_a_violation_not_an_error(clean: Run, capsys):
    _damaged(clean)
    assert replay_cli.main([str(clean.run_dir), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert "error" not in report and any(v["seq"] == DAMAGED for v in report["violations"])
