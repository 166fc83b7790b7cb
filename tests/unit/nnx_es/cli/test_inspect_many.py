"""inspect over several runs: a runs root lists its runs; diff names where two runs first differ."""

from __future__ import annotations

import json

import torch
from torch import nn

from nnx_es import Trainer
from nnx_es.cli.inspect import main
from trainkit import loaders, small_net


def _run(root, run_id, *, lr=0.1, epochs=2):
    net = small_net(0)
    Trainer(net, torch.optim.SGD(net.parameters(), lr=lr), nn.CrossEntropyLoss(), monitor="val_loss",
            runs_root=root, run_id=run_id, progress=False).fit(*loaders(), epochs=epochs)


def test_a_runs_root_lists_each_run_with_status_epochs_best_and_size(tmp_path, capsys):
    _run(tmp_path, "a")
    _run(tmp_path, "b", epochs=3)
    assert main([str(tmp_path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["run_id"], r["status"], r["epochs"]) for r in rows] == [("a", "completed", 2), ("b", "completed", 3)]
    assert all(r["bytes"] > 0 and r["best"] is not None and r["started"].endswith("Z") for r in rows)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["run", "status", "epochs", "best", "started", "size"] and out[2].startswith("b ")


def test_an_empty_runs_root_lists_no_runs_and_says_so(tmp_path, capsys):
    """A fresh user's runs root with no run yet read "'X' is not a run: expected an event log"."""
    root = tmp_path / "runs"
    root.mkdir()
    assert main([str(root)]) == 0
    assert capsys.readouterr().out == f"no runs under {root} yet (a run's directory appears here when it starts)\n"
    (root / ".leases").mkdir()  # what a runs root keeps beside its runs
    assert main([str(root), "--json"]) == 0
    got = capsys.readouterr()
    assert got.out == "" and f"no runs under {root} yet" in got.err  # --json: zero rows, the note on stderr


def test_a_directory_holding_other_things_is_not_taken_for_an_empty_runs_root(tmp_path, capsys):
    (tmp_path / "data.csv").write_text("x\n")
    (tmp_path / "notes").mkdir()
    assert main([str(tmp_path)]) == 2
    assert "is not a run" in capsys.readouterr().err


def test_diff_names_the_first_event_where_two_runs_differ(tmp_path, capsys):
    _run(tmp_path, "a")
    _run(tmp_path, "same")
    _run(tmp_path, "faster", lr=0.2)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "same")]) == 0  # ids, clocks and hashes aside
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "faster"), "--json"]) == 1
    found = json.loads(capsys.readouterr().out)["first_difference"]
    assert found["kind_a"] == found["kind_b"] == "update_committed" and found["field"] == "lrs[0]"
    assert (found["a"], found["b"]) == (0.1, 0.2)
    assert main(["diff", str(tmp_path / "a")]) == 2


def test_diff_finds_two_identical_journal_runs_the_same(tmp_path, capsys):
    # found in review: a journal manifest names its run, so the `previous` manifest chained in
    # each journal_published differed between two identical runs and diff reported them different
    from torch.utils.data import DataLoader, TensorDataset

    from nnx_es import HistoryJournal, with_row_ids

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g))
    for run_id in ("a", "b"):
        torch.manual_seed(0)
        net = nn.Linear(4, 3)
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
                run_id=run_id, seed=0, progress=False, history=HistoryJournal(window=1, chunk_rows=16)).fit(
            DataLoader(with_row_ids(data), batch_size=8, shuffle=True), epochs=3)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"same": True, "first_difference": None}


def test_diff_of_a_run_with_itself_under_two_spellings_is_the_same(tmp_path, capsys):
    # found in review: LMDB opens an environment once per process, so `diff runs/a runs/a` (or
    # `./runs/a/`, or a symlink to it) failed with "already open in this process", exit 2
    _run(tmp_path, "a")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    for other in (tmp_path / "a", f"{tmp_path}/./a/", tmp_path / "link"):
        assert main(["diff", str(tmp_path / "a"), str(other)]) == 0
        assert "hold the same events" in capsys.readouterr().out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "link"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"same": True, "first_difference": None}


def test_a_runs_root_flags_a_run_no_process_writes_any_more(tmp_path, capsys):
    # found in review: a killed run was listed "running", like a live one; summary flags it
    import os
    import subprocess
    import sys

    script = f"""
import os, torch
from torch import nn
from nnx_es import LambdaCallback, Trainer
from trainkit import loaders, small_net
def die(ctx):
    if ctx.epoch == 1:
        os._exit(0)  # killed mid-run: the lease goes with the process
net = small_net(0)
Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root={str(tmp_path)!r},
        run_id="killed", progress=False, callbacks=[LambdaCallback(on_epoch_end=die)]).fit(*loaders(), epochs=3)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    _run(tmp_path, "done")
    assert main([str(tmp_path), "--json"]) == 0
    rows = {r["run_id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert (rows["killed"]["status"], rows["killed"]["writer_alive"]) == ("running", False)
    assert (rows["done"]["status"], rows["done"]["writer_alive"]) == ("completed", None)
    assert main([str(tmp_path)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "running (no writer)" in lines["killed"] and "no writer" not in lines["done"]


def test_a_runs_root_says_why_a_run_is_unreadable_and_what_to_do(tmp_path, capsys):
    # left alone before: a damaged run was listed "unreadable" with no reason anywhere; a fresh user then
    # found runs whose log was deleted left out of the listing without a word, and advice that led nowhere
    import shutil

    for run_id in ("good", "torn", "gone", "no-log"):
        _run(tmp_path, run_id)
    (tmp_path / "torn" / "events.lmdb" / "data.mdb").write_bytes(b"")  # a truncated copy
    (tmp_path / "gone" / "events.lmdb" / "data.mdb").unlink()  # its lock file stays
    shutil.rmtree(tmp_path / "no-log" / "events.lmdb")  # blobs and views stay
    assert main([str(tmp_path), "--json"]) == 1  # a script reading the listing learns of the damage
    rows = {r["run_id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert sorted(rows) == ["gone", "good", "no-log", "torn"]
    assert rows["good"]["error"] is None and rows["good"]["epochs"] == 2
    assert rows["torn"]["error"].startswith("TruncatedLogError: ") and "empty" in rows["torn"]["error"]
    assert "data.mdb" in rows["gone"]["error"] and "missing" in rows["gone"]["error"]
    assert rows["no-log"]["error"].startswith("NotARunError: ") and "no event log" in rows["no-log"]["error"]
    for run_id in ("torn", "gone", "no-log"):
        assert (rows[run_id]["status"], rows[run_id]["epochs"]) == ("unreadable", None)
    assert "restore the run directory from a copy" in rows["torn"]["advice"]
    for run_id in ("gone", "no-log"):  # the error says what to do itself: no second advice repeating it
        assert rows[run_id]["advice"] is None and "restore the directory from a copy" in rows[run_id]["error"]
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    reasons = [line for line in out if ": unreadable: " in line]
    assert [line.split(":")[0] for line in reasons] == ["gone", "no-log", "torn"]
    assert "TruncatedLogError" in reasons[2] and "restore the run directory from a copy" in reasons[2]
    table = {line.split()[0]: line.split() for line in out[1:5]}
    assert table["torn"][1:3] == ["unreadable", "-"]


def test_a_run_whose_log_is_gone_is_named_even_when_no_run_is_readable(tmp_path, capsys):
    import shutil

    _run(tmp_path, "only")
    shutil.rmtree(tmp_path / "only" / "events.lmdb")
    assert main([str(tmp_path)]) == 1
    assert "only: unreadable: NotARunError" in capsys.readouterr().out
    assert main([str(tmp_path / "only")]) == 2  # the run itself: the same words, not "is not a run"
    err = capsys.readouterr().err
    assert "no event log" in err and "restore the directory from a copy" in err and "is not a run" not in err


def test_a_runs_root_refuses_the_options_of_one_run_naming_what_to_pass(tmp_path, capsys):
    _run(tmp_path, "a")
    assert main([str(tmp_path), "--at", "3"]) == 2
    err = capsys.readouterr().err
    assert "is a directory of runs" in err and str(tmp_path / "<id>") in err


def test_a_runs_root_listing_ends_quietly_when_its_reader_leaves(tmp_path, monkeypatch):
    # left alone before: `inspect runs/ --json | head` ended in a BrokenPipeError traceback, exit 1
    import io
    import os
    import sys

    _run(tmp_path, "a")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    out = io.TextIOWrapper(io.FileIO(write_end, "w"), line_buffering=True)
    monkeypatch.setattr(sys, "stdout", out)
    try:
        assert main([str(tmp_path), "--json"]) == 0
        assert main([str(tmp_path)]) == 0
        out.write("dropped\n")  # the stream now leads nowhere, quietly
        _run(tmp_path, "torn")
        (tmp_path / "torn" / "events.lmdb" / "data.mdb").write_bytes(b"")
        assert main([str(tmp_path), "--json"]) == 1  # the damage's exit status stands when the reader left early
        assert main([str(tmp_path)]) == 1
    finally:
        monkeypatch.undo()
        out.close()


def test_diff_help_prints_its_usage_and_exit_statuses_exit_0(capsys):
    for flag in ("--help", "-h"):
        assert main(["diff", flag]) == 0
        said = capsys.readouterr()
        assert said.err == ""
        assert said.out.startswith("usage: inspect diff RUN_A RUN_B [--json]\n")
        assert "Exit status: 0 the same, 1 they differ, 2 unusable input or a damaged log" in said.out
