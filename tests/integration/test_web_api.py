"""The JSON API of ``nnx-es serve`` (Starlette's TestClient): each answer equals what ``tools/inspect`` and
``tools/replay`` say of the same runs, paths stay confined to the runs root, and nothing under it changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from events.log import LmdbLog  # noqa: E402
from nnx_es.audit import audit_run  # noqa: E402
from nnx_es.cli.inspect import main as inspect_main  # noqa: E402
from nnx_es.cli.many import first_difference, list_runs  # noqa: E402
from nnx_es.result import load_result  # noqa: E402
from nnx_es.rows.dynamics import cartography  # noqa: E402
from nnx_es.rows.reader import read_rows  # noqa: E402
from nnx_es.web.app import hosts_for, is_loopback  # noqa: E402
from projections import committed  # noqa: E402
from webkit import RUN_IDS, app_client, build_root, get_json as _get, tree_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build_root(tmp_path_factory.mktemp("web"))


@pytest.fixture(scope="module")
def client(root):
    return app_client(root)


def _inspect(capsys, *argv):
    capsys.readouterr()
    inspect_main([str(a) for a in argv])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_the_runs_list_says_what_the_cli_listing_says_and_the_lineage(client, root):
    doc = _get(client, "/api/runs")
    rows = {r["run_id"]: r for r in doc["runs"]}
    assert sorted(rows) == sorted(RUN_IDS)
    for cli in list_runs(root):
        row = rows[cli.run_id]
        assert (row["status"], row["epochs"], row["writer_alive"]) == (cli.status, cli.epochs, cli.writer_alive)
        assert (row["best"] or {}).get("value") == cli.best
    assert rows["killed"]["status"] == "running" and rows["killed"]["writer_alive"] is False
    assert not rows["killed"]["live"] and not doc["live"]
    assert rows["fork"]["lineage"]["source"]["run_id"] == "base" and rows["fork"]["lineage"]["source"]["state"] == "full"
    assert rows["base"]["children"] == ["fork"]
    assert rows["base"]["best"]["value"] == load_result(root / "base").best.value


def test_a_run_is_its_summary_and_its_history_projection(client, root, capsys):
    doc = _get(client, "/api/runs/base")
    (summary,) = _inspect(capsys, root / "base", "summary", "--json")
    assert {k: doc[k] for k in summary} == summary
    assert doc["history"] == msgspec.to_builtins(list(load_result(root / "base").history))
    assert doc["declared"]["optimizers"] == ["sgd"] and doc["declared"]["monitor"]["name"] == "val_loss"


def test_curves_equal_the_history_and_the_committed_receipts(client, root):
    doc = _get(client, "/api/runs/base/curves")
    history = load_result(root / "base").history
    assert doc["epoch"]["x"] == [r.epoch for r in history]
    assert doc["epoch"]["series"]["train/loss"] == [r.train["loss"] for r in history]
    assert doc["epoch"]["series"]["val/val_loss"] == [r.val["val_loss"] for r in history]
    assert doc["epoch"]["series"]["lr/sgd/0"] == [r.lrs["sgd"][0] for r in history]
    with LmdbLog(root / "base" / "events.lmdb", readonly=True) as log:
        receipts = [e for _, e in committed(log.read()) if e.KIND == "update_committed"]
    loss = doc["update"]["series"]["loss/sgd"]
    assert loss["x"] == [float(r.step) for r in receipts] and loss["y"] == [r.loss for r in receipts]
    assert doc["update"]["series"]["lr/sgd"]["y"] == [r.lrs[0] for r in receipts]
    epoch_only = _get(client, "/api/runs/base/curves?per=epoch")  # from the history projection alone
    assert epoch_only == {"epoch": doc["epoch"]}
    assert _get(client, "/api/runs/base/curves?per=update") == {"update": doc["update"]}
    _get(client, "/api/runs/base/curves?per=step", 400)
    assert doc["update"]["complete"] and doc["update"]["steps_per_bucket"] == 1  # 36 updates: not downsampled


def test_the_per_update_curves_are_read_a_bounded_part_an_answer_until_complete(root, client):
    """Each answer reads at most ``curve_budget`` events: the page asks again until ``complete``, and the last
    answer equals the whole log read in one (``tests/integration/test_web_curves.py`` checks the values)."""
    from nnx_es.web.app import create_app
    from starlette.testclient import TestClient

    whole = _get(client, "/api/runs/resumed/curves?per=update")["update"]
    small = TestClient(create_app(root, curve_budget=16), base_url="http://127.0.0.1")
    answers = []
    while not (answers and answers[-1]["complete"]):
        answers.append(_get(small, "/api/runs/resumed/curves?per=update")["update"])
    assert len(answers) == -(-whole["total"] // 16)  # one part (the log is short), 16 events an answer
    assert [a["complete"] for a in answers] == [False] * (len(answers) - 1) + [True]
    assert answers[-1] == whole


def test_event_pages_are_inspects_rows_filtered_and_chained(client, root, capsys):
    lines = _inspect(capsys, root / "resumed", "--json")
    pages, start = [], 0
    while start is not None:
        page = _get(client, f"/api/runs/resumed/events?from={start}&limit=7")
        assert len(page["events"]) <= 7 and page["total"] == len(lines)
        pages += page["events"]
        start = page["next"]
    assert [(r["seq"], r["kind"]) for r in pages] == [(line["seq"], line["kind"]) for line in lines]
    wanted = _inspect(capsys, root / "resumed", "--json", "--kind", "last_committed,run_resumed", "--epoch", "1:1")
    page = _get(client, "/api/runs/resumed/events?kind=last_committed,run_resumed&epoch=1:1")
    assert [r["seq"] for r in page["events"]] == [line["seq"] for line in wanted] and wanted
    partial = _get(client, "/api/runs/resumed/events?kind=run_finalized&limit=5")  # the last event: a full scan
    assert [r["kind"] for r in partial["events"]] == ["run_finalized"] and partial["next"] is None


def test_each_event_has_its_fields_and_the_commit_that_holds_it(client, root, capsys):
    lines = {line["seq"]: line for line in _inspect(capsys, root / "resumed", "--json")}
    with LmdbLog(root / "resumed" / "events.lmdb", readonly=True) as log:
        events = list(log.read())
    kept = {seq for seq, _ in committed(events)}
    resume = next(e for _, e in events if e.KIND == "run_resumed")
    discarded = 0
    for seq, e in events:
        doc = _get(client, f"/api/runs/resumed/events/{seq}")
        assert doc["event"] == lines[seq]
        state = doc["commit"]["state"]
        assert (state in ("committed", "closing")) == (seq in kept), (seq, e.KIND, state)
        if resume.discard_from <= seq < resume.discard_to and seq not in kept:  # (its range may hold a LAST's group)
            assert state == "discarded"
            discarded += 1
        by = doc["commit"]["by"]
        if state == "committed" and by is not None:  # the LAST named commits it: it lies at or before it, or in its group
            assert by["kind"] == "last_committed" and (seq <= by["seq"] or seq in [g["seq"] for g in by["group"]])
            if e.KIND == "best_committed":
                assert by["seq"] < seq and events[by["seq"]][1].KIND == "last_committed"
    assert discarded > 0
    _get(client, f"/api/runs/resumed/events/{len(events)}", 404)


def test_time_travel_prints_what_inspect_at_prints(client, root, capsys):
    total = _get(client, "/api/runs/resumed")["events"]
    for seq in (0, total // 3, total // 2, total - 1, total + 5):
        (cli,) = _inspect(capsys, root / "resumed", "--at", seq, "--json")
        doc = _get(client, f"/api/runs/resumed/at?seq={seq}")
        assert {k: doc[k] for k in cli} == cli
    assert _get(client, "/api/runs/resumed/at?seq=3")["event"]["seq"] == 3


def test_the_audit_is_tools_replays_verdict_with_each_violation_at_its_event(client, root):
    clean = _get(client, "/api/runs/base/audit")
    assert clean["ok"] and clean["violations"] == []
    doc = _get(client, "/api/runs/broken/audit")
    report = audit_run(root / "broken")
    assert not doc["ok"] and doc["violations"] == msgspec.to_builtins(report.violations)
    assert any(v["seq"] is not None for v in doc["violations"])
    assert doc["invariants"]["6"].startswith("each scheduler")


def test_diff_starts_at_the_first_difference(client, root):
    doc = _get(client, "/api/diff?a=base&b=other")
    assert doc["first_difference"] == first_difference(root / "base", root / "other")
    seq = doc["first_difference"]["seq"]
    assert seq in [r["seq"] for r in doc["a_events"]] and seq in [r["seq"] for r in doc["b_events"]]
    assert _get(client, "/api/diff?a=base&b=base")["same"] is True


def test_rows_are_the_cartography_of_the_records(client, root):
    doc = _get(client, "/api/runs/base/rows")
    state = cartography(read_rows(root / "base"))
    order = state.hardest(state.row_id.size)
    assert doc["rows"] == doc["shown"] == 96
    assert doc["columns"]["row_id"] == state.row_id[order].tolist()
    assert np.allclose(doc["columns"]["confidence"], state.confidence[order], rtol=0, atol=0)
    assert _get(client, "/api/runs/resumed/rows")["rows"] == 0


def test_paths_stay_inside_the_runs_root(client, root, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "zz-link").symlink_to(root / "base", target_is_directory=True)
    try:
        assert _get(client, "/api/runs/zz-link", 403)["error"]["type"] == "UnsafePathError"
        rows = {r["run_id"]: r for r in _get(client, "/api/runs")["runs"]}
        assert rows["zz-link"]["status"] == "unreadable" and "symbolic link" in rows["zz-link"]["error"]
    finally:
        (root / "zz-link").unlink()
    assert client.get("/api/runs/..%2F..%2Fetc").status_code in (400, 404)
    assert _get(client, "/api/runs/a%20b", 400)["error"]["type"] == "InvalidRunIdError"
    assert _get(client, "/api/runs/nope", 404)["error"]["type"] == "NotARunError"
    assert _get(client, "/api/runs/base/events?limit=0", 400)["error"]["type"] == "ValueError"
    assert _get(client, "/api/runs/base/events?kind=nope", 400)["error"]["message"].startswith("kind: unknown")
    assert _get(client, "/api/runs/base/at?seq=-1", 400)
    assert _get(client, f"/api/runs/base/events?from={2**64}", 400)["error"]["message"].startswith("from:")
    assert _get(client, f"/api/runs/base/events/{2**70}", 404)["error"]["type"] == "NoSuchEventError"
    assert client.get("/static/../webkit.py").status_code == 404


@pytest.mark.parametrize("text", ["0", "1001", "-1", "abc", "1.5", "1_0", " 5", str(2**64)])
def test_every_integer_parameter_is_refused_in_one_message_naming_the_value_and_the_range(client, text):
    from urllib.parse import quote

    from events.lmdbfile import MAX_SEQ
    from nnx_es.web.api import MAX_LIMIT

    asks = [("/api/runs/base/events?limit=", "limit", 1, MAX_LIMIT), ("/api/runs/base/events?from=", "from", 0, MAX_SEQ - 1),
            ("/api/runs/base/at?seq=", "seq", 0, MAX_SEQ - 1)]
    for path, name, lo, hi in asks:
        r = client.get(path + quote(text))
        if text in ("0", "1001") and name != "limit":  # in range there
            assert r.status_code == 200, r.text
            continue
        assert r.status_code == 400 and r.json()["error"] == {
            "type": "ValueError", "message": f"{name}: expected an integer in {lo}..{hi}, got {text!r}"}, (path, r.text)
    assert _get(client, "/api/runs/base/at", 400)["error"]["message"] == f"seq: expected an integer in 0..{MAX_SEQ - 1}, got nothing"


def test_only_reads_from_this_machine_with_a_strict_policy(client, root):
    assert client.get("/api/runs", headers={"host": "attacker.example"}).status_code == 400
    assert client.post("/api/runs").status_code == 405
    r = client.get("/")
    assert "script-src 'self'" in r.headers["content-security-policy"] and r.headers["x-frame-options"] == "DENY"
    assert hosts_for("127.0.0.1")[:2] == ("127.0.0.1", "localhost") and hosts_for("0.0.0.0") == ("*",)
    assert is_loopback("127.0.0.2") and is_loopback("::1") and not is_loopback("0.0.0.0")


def test_nnx_es_serve_refuses_a_runs_root_that_is_not_a_directory(tmp_path, capsys):
    from nnx_es.cli.main import main

    assert main(["serve", str(tmp_path / "nope"), "--port", "0"]) == 2
    assert "does not exist or is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path), "--port", "70000"])


def test_serving_every_page_changes_nothing_under_the_root_lock_files_included(client, root):
    before = tree_state(root)
    assert any(k.endswith("lock.mdb") for k in before)  # the runs' writers left them: they must stay byte-identical
    for run_id in RUN_IDS:
        for path in ("", "/curves", "/events", "/events/3", "/at?seq=5", "/audit", "/rows"):
            client.get(f"/api/runs/{run_id}{path}")
    client.get("/api/runs")
    client.get("/api/diff?a=base&b=other")
    assert tree_state(root) == before


_SLOW_WRITER = """
import sys, time, torch
sys.path[:0] = {paths!r}
from torch import nn
from nnx_es import Trainer
from nnx_es.callbacks import Callback
from trainkit import loaders
class Slow(Callback):
    def on_epoch_end(self, ctx):
        time.sleep(0.3)
torch.manual_seed(0)
net = nn.Linear(4, 3)
Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root={root!r}, run_id="live",
        callbacks=[Slow()], progress=False).fit(*loaders(), epochs=6)
"""


def test_a_live_run_is_read_beside_its_writer_and_listed_live(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    tests = str(Path(__file__).resolve().parent.parent)
    code = _SLOW_WRITER.format(paths=[str(Path(tests).parent), tests], root=str(root))
    writer = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    client = app_client(root)
    seen: list[tuple[bool, int]] = []
    try:
        deadline = time.monotonic() + 60
        while writer.poll() is None and time.monotonic() < deadline:
            rows = _get(client, "/api/runs")["runs"]
            if rows and rows[0]["status"] != "unreadable":
                seen.append((rows[0]["live"], rows[0]["epochs"]))
                _get(client, "/api/runs/live/curves")
                _get(client, "/api/runs/live/events?limit=50")
            time.sleep(0.2)
        assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
    live_epochs = [e for live, e in seen if live]
    assert len(set(live_epochs)) >= 2, seen  # listed live, its epochs growing while it trains
    final = _get(client, "/api/runs")["runs"][0]
    assert (final["status"], final["live"], final["epochs"]) == ("completed", False, 6)
    followed = _get(client, "/api/runs/live/curves?per=update")["update"]  # read on while the run grew
    assert followed["complete"] and followed == _get(app_client(root), "/api/runs/live/curves?per=update")["update"]
