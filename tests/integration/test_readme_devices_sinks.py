"""The live-logging guide's sinks snippet (once the README's "Devices and live logging"), run as written:
its device choice, its sinks' files. (tests/docs runs every snippet; this checks what this one promises.)"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

from nnx_es import load_result

README = Path(__file__).resolve().parents[2] / "docs" / "guides" / "live-logging.md"


def _snippet(section: str) -> str:
    text = README.read_text()
    body = text.split(f"## {section}\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", body, re.S)
    assert match is not None, f"no python block under '## {section}'"
    return match.group(1)


def test_the_readmes_devices_and_sinks_snippet_trains_and_its_sinks_write_what_the_log_committed(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(_snippet("Live sinks"), str(README), "exec"), {})
    views = tmp_path / "runs" / "devices-demo" / "views"
    printed = capsys.readouterr().out
    assert {"epochs.csv", "updates.csv", "tensorboard"} <= set(os.listdir(views)), printed
    result = load_result(tmp_path / "runs" / "devices-demo")
    with open(views / "epochs.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [rec.epoch for rec in result.history] == [0, 1]
    with open(views / "updates.csv") as f:
        assert len(list(csv.DictReader(f))) == result.counters.step == 8
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(views / "tensorboard"))
