"""The progress display shows only on a terminal; structlog renders JSON off a terminal."""

from __future__ import annotations

import io
import json

import structlog

from nnx_es.logs import configure_logging
from nnx_es.progress import Progress


def test_progress_is_off_when_stderr_is_not_a_terminal(capsys):
    p = Progress()  # pytest captures stderr: not a terminal
    assert p.enabled is False
    p.start_epoch(0, 10)
    p.advance(0.5, 1, 32)
    p.close()
    assert capsys.readouterr().err == ""


def test_forced_progress_reports_epoch_step_loss_and_rows_per_second_on_stderr(monkeypatch, capsys):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)  # not a terminal: forced on, it is drawn there all the same
    p = Progress(enabled=True)
    p.start_epoch(3, 4)
    for i in range(4):
        p.advance(0.25, i + 1, 32)
    task = p._bar.tasks[0]
    assert task.fields["epoch"] == 3 and task.fields["step"] == 4 and task.fields["loss"] == "0.2500"
    assert task.completed == 4 and p._rows == 128 and task.fields["rate"] != "-"
    p._bar.refresh()
    p.close()
    assert "epoch 3" in err.getvalue() and "loss 0.2500" in err.getvalue()
    assert capsys.readouterr().out == ""  # stdout stays the program's own


def test_prints_while_the_display_is_on_stay_on_a_redirected_stdout(monkeypatch, capsys):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    p = Progress(enabled=True)
    p.start_epoch(0, 2)
    print("the program's own line")  # stdout is no terminal here (captured): it is not taken into the display
    p.advance(0.5, 1, 8)
    p.close()
    assert capsys.readouterr().out == "the program's own line\n"
    assert "the program's own line" not in err.getvalue()


def test_progress_other_than_a_bool_or_none_is_refused_by_name():
    import pytest

    from nnx_es.errors import ConfigError

    with pytest.raises(ConfigError, match="progress must be True, False or None.*'yes'"):
        Progress("yes")  # type: ignore[arg-type]


def test_structlog_renders_json_lines_when_asked(capsys):
    configure_logging("info", json=True)
    try:
        structlog.get_logger("nnx_es").info("epoch committed", epoch=3)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        doc = json.loads(line)
        assert doc["event"] == "epoch committed" and doc["epoch"] == 3 and doc["level"] == "info"
    finally:
        configure_logging("warning")


def test_logs_follow_the_current_stderr_not_the_one_at_configuration(monkeypatch):
    import io

    configure_logging("info", json=True)
    try:
        first = io.StringIO()
        monkeypatch.setattr("sys.stderr", first)
        structlog.get_logger("nnx_es").info("one")
        first.close()  # e.g. a test's captured stream, closed after it
        second = io.StringIO()
        monkeypatch.setattr("sys.stderr", second)
        structlog.get_logger("nnx_es").info("two")  # no "I/O operation on closed file"
        assert json.loads(second.getvalue())["event"] == "two"
    finally:
        configure_logging("warning")
