"""inspect's command line as a user meets it: --schema agrees with --json, summary of a run whose
writer died, options that would be ignored are refused, Ctrl-C, unwritable plot formats, exporting twice."""

from __future__ import annotations

import fcntl
import json
import math
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_runs import RUN_ID, Run, RunBuilder, clean, template, write_run  # noqa: F401 (fixtures)
from torch import nn

from events.codec import CURRENT_TYPES, EVENT_TYPES
from events.log import LmdbLog
from events.schema import MicrobatchDone, UpdateCommittedV1, UpdateSkipped
from nnx_es import Trainer
from nnx_es.cli.inspect import main
from nnx_es.storage import Lease
from trainkit import loaders, small_net

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real run (2 epochs, a plateau scheduler): every kind a plain fit writes."""
    runs = tmp_path_factory.mktemp("runs")
    net = small_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)
    Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", schedulers=[plateau], runs_root=runs,
            run_id="r", progress=False).fit(*loaders(), epochs=2)
    return runs / "r"


def _lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def _schema(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["--schema"]) == 0
    return json.loads(capsys.readouterr().out)


# --- --schema describes what --json prints ---------------------------------------------------


def _validator(schema: dict[str, Any]) -> Any:
    """A JSON Schema 2020-12 validator of ``schema`` (the jsonschema package, a test dependency)."""
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _assert_valid(schema: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    validator = _validator(schema)
    for row in rows:
        errors = list(validator.iter_errors(row))
        assert not errors, (row, [e.message for e in errors])


def test_schema_discriminator_accepts_the_kind_and_version_of_every_json_line_of_a_real_run(real_run, capsys):
    schema = _schema(capsys)
    assert main([str(real_run), "--json"]) == 0
    rows = _lines(capsys)
    assert "update_committed" in {r["kind"] for r in rows}
    event = schema["$defs"]["Event"]
    assert event["discriminator"]["propertyName"] == "kind"
    mapping = event["discriminator"]["mapping"]
    for row in rows:
        target = schema["$defs"][mapping[row["kind"]].rsplit("/", 1)[1]]  # KeyError: a kind the schema lacks
        assert target["properties"]["kind"] == {"const": row["kind"]}
        assert target["properties"]["version"] == {"const": row["version"]}
    _assert_valid(schema, rows)


def test_schema_describes_every_kind_a_legacy_version_non_finite_floats_and_an_undecodable_value(
        tmp_path, capsys, sample_events):
    """Every decodable type fully populated (legacy ones print upcast), NaN/inf (printed as null), a bad value."""
    run = tmp_path / "runs" / "x"
    with LmdbLog(run / "events.lmdb") as log:
        for t in EVENT_TYPES:
            log.append(sample_events[t])
        log.append(MicrobatchDone(epoch=0, batch=0, rows=8, examples=0.0, loss=math.nan, terms={"ce": math.inf}))
        log.append(UpdateSkipped(step=0, epoch=0, microbatches=1, reason="nonfinite"))
        log.flush(sync=True)
        log.put_raw(log.next_seq, b"\xc1")
    schema = _schema(capsys)
    assert main([str(run), "--json"]) == 0
    rows = _lines(capsys)
    assert {r["kind"] for r in rows[:-1]} == {t.KIND for t in CURRENT_TYPES}
    legacy = rows[EVENT_TYPES.index(UpdateCommittedV1)]
    assert (legacy["kind"], legacy["version"]) == ("update_committed", 2)
    assert rows[-3]["loss"] is None and rows[-3]["terms"] == {"ce": None}
    assert rows[-1]["kind"] is None
    _assert_valid(schema, rows)
    validator = _validator(schema)
    assert not validator.is_valid({**rows[0], "kind": "run_started@1"})  # not a printed kind
    assert not validator.is_valid({k: v for k, v in rows[0].items() if k != "version"})
    assert not validator.is_valid({**rows[0], "unexpected": 1})


def test_no_event_field_is_named_like_a_key_json_adds():
    for t in EVENT_TYPES:
        assert not {"seq", "version"} & set(t.__struct_fields__), t


# --- summary of a run whose writer died ------------------------------------------------------


def test_summary_says_a_running_run_whose_writer_was_sigkilled_has_no_writer(tmp_path, capsys):
    from crashkit import kill_at_event, run_killed

    runs = tmp_path / "runs"

    def train() -> None:
        net = small_net()
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=runs,
                run_id="dead", progress=False).fit(*loaders(), epochs=3)

    assert run_killed(train, kill_at_event(20)) == "killed"
    assert main([str(runs / "dead"), "summary"]) == 0
    status = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("status"))
    assert status.split(None, 1)[1] == (
        "running (no process on this machine is writing it: killed or crashed? "
        f"resume it with fit(..., resume_from={str(runs / 'dead')!r}))")
    assert main([str(runs / "dead"), "summary", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "running" and doc["writer_alive"] is False
    Lease(runs, "dead").acquire().release()  # inspect left the lease free


def test_summary_of_a_killed_cli_run_says_to_resume_it_with_nnx_es_resume(tmp_path, capsys):
    from crashkit import kill_at_event, run_killed

    from nnx_es.recipes.runspec import build_run, scaffold

    runs = tmp_path / "runs"

    def train() -> None:  # what nnx-es run does: a trainer built from a spec (run_started holds it)
        built = build_run(scaffold(dataset="digits", epochs=3), runs_root=runs, run_id="dead-cli", progress=False)
        built.trainer.fit(built.train_loader, built.val_loader, epochs=3)

    assert run_killed(train, kill_at_event(200)) == "killed"
    assert main([str(runs / "dead-cli"), "summary"]) == 0
    status = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("status"))
    assert status.split(None, 1)[1] == (
        "running (no process on this machine is writing it: killed or crashed? "
        f"resume it with nnx-es resume {str(runs / 'dead-cli')!r})")


def _running_run(root: Path, *, checkpoint: bool = True) -> Path:
    b = RunBuilder(root / "runs" / RUN_ID)
    b.start()
    if checkpoint:
        b.epoch(0, val_loss=0.8)
        b.crash_in_epoch(1)
    else:
        b.events = b.events[:4]  # run_started, callbacks, train_began: no LAST yet
    write_run(b.run_dir, b.events, views=False)
    return b.run_dir


def test_summary_of_a_run_whose_lease_is_held_reads_without_taking_the_lease(tmp_path, capsys, monkeypatch):
    run_dir = _running_run(tmp_path)
    lease = Lease(run_dir.parent, RUN_ID).acquire()
    try:
        lease.path.write_text("999999999\n")  # a pid that runs nothing: the held flock alone says alive

        def no_flock(*args: object) -> None:
            raise AssertionError("inspect must never lock the writer lease")

        monkeypatch.setattr(fcntl, "flock", no_flock)
        assert main([str(run_dir), "summary", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["writer_alive"] is (os.path.exists("/proc/locks"))
        lease.path.write_text(f"{os.getpid()}\n")
        assert main([str(run_dir), "summary"]) == 0
        status = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("status"))
        assert status.split() == ["status", "running"]
    finally:
        monkeypatch.undo()
        lease.release()


@pytest.mark.parametrize("spelling", ["dot", "symlink"])
def test_a_live_writer_is_seen_through_any_spelling_of_its_run_directory(tmp_path, capsys, monkeypatch, spelling):
    run_dir = _running_run(tmp_path)
    lease = Lease(run_dir.parent, RUN_ID).acquire()
    try:
        if spelling == "dot":
            monkeypatch.chdir(run_dir)
            given = Path(".")
        else:
            given = tmp_path / "latest"
            given.symlink_to(run_dir, target_is_directory=True)
        assert main([str(given), "summary", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["writer_alive"] is True
    finally:
        lease.release()


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="the lock table decides only where it can be read")
def test_a_pid_left_in_a_free_lease_does_not_make_a_dead_writer_look_alive(tmp_path, capsys):
    run_dir = _running_run(tmp_path)
    Lease(run_dir.parent, RUN_ID).acquire().release()
    lease_file = run_dir.parent / ".leases" / f"{RUN_ID}.lock"
    assert lease_file.read_text() == ""  # a released lease keeps no pid
    lease_file.write_text(f"{os.getpid()}\n")  # a live pid (reused, or an older release's) in a free lease
    assert main([str(run_dir), "summary", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["writer_alive"] is False


def test_summary_of_a_dead_run_without_a_checkpoint_says_there_is_nothing_to_resume(tmp_path, capsys):
    run_dir = _running_run(tmp_path, checkpoint=False)
    assert main([str(run_dir), "summary"]) == 0
    assert "killed or crashed? it has no checkpoint to resume from)" in capsys.readouterr().out


def test_summary_of_a_finalized_run_asks_nothing_about_its_writer(clean: Run, capsys):
    assert main([str(clean.run_dir), "summary", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "completed" and doc["writer_alive"] is None
    assert main([str(clean.run_dir), "summary"]) == 0
    assert "writing it" not in capsys.readouterr().out


# --- options that would be ignored are refused -----------------------------------------------


@pytest.mark.parametrize("argv, flag", [
    (["{run}", "summary", "--at", "3"], "--at"),
    (["{run}", "plot", "--at", "3", "--out", "{tmp}/x.png"], "--at"),
    (["{run}", "export", "--at", "3", "--tensorboard", "{tmp}/tb"], "--at"),
    (["{run}", "--follow", "--at", "3"], "--follow"),
    (["{run}", "--at", "3", "--kind", "epoch_began"], "--kind"),
    (["{run}", "--at", "3", "--to", "5"], "--to"),
    (["{run}", "--at", "0", "--from", "0"], "--from"),
    (["{run}", "--at", "3", "--limit", "0"], "--limit"),
    (["{run}", "--at", "3", "--epoch", "0"], "--epoch"),
    (["{run}", "--at", "3", "--rank", "0"], "--rank"),
    (["--schema", "{run}"], "--schema"),
    (["--schema", "--json"], "--json"),
    (["--schema", "--kind", "epoch_began"], "--kind"),
    (["{run}", "summary", "--follow"], "--follow"),
    (["{run}", "summary", "--from", "0"], "--from"),
    (["{run}", "summary", "--epoch", "1"], "--epoch"),
    (["{run}", "summary", "--rank", "0"], "--rank"),
    (["{run}", "summary", "--out", "{tmp}/x.png"], "--out"),
    (["{run}", "summary", "--tensorboard", "{tmp}/tb"], "--tensorboard"),
    (["{run}", "plot", "--json", "--out", "{tmp}/x.png"], "--json"),
    (["{run}", "plot", "--kind", "epoch_began", "--out", "{tmp}/x.png"], "--kind"),
    (["{run}", "plot", "--tensorboard", "{tmp}/tb", "--out", "{tmp}/x.png"], "--tensorboard"),
    (["{run}", "export", "--json", "--tensorboard", "{tmp}/tb"], "--json"),
    (["{run}", "export", "--out", "{tmp}/x.png", "--tensorboard", "{tmp}/tb"], "--out"),
    (["{run}", "--out", "{tmp}/x.png"], "--out"),
    (["{run}", "--tensorboard", "{tmp}/tb"], "--tensorboard"),
])
def test_an_option_the_command_would_ignore_is_refused_naming_it(argv, flag, clean: Run, tmp_path, capsys):
    args = [a.format(run=clean.run_dir, tmp=tmp_path) for a in argv]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: inspect") and f"inspect: error: argument {flag}: not allowed" in captured.err
    assert not list(tmp_path.glob("x.png")) and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("argv", [
    ["--at", "0", "--json"], ["--at", "5"], ["--follow", "--to", "3", "--json"], ["--from", "0", "--limit", "0"],
    ["summary", "--json"], ["--kind", "epoch_began", "--epoch", "0", "--rank", "0", "--json"],
])
def test_the_options_a_command_uses_are_still_accepted(argv, clean: Run, capsys):
    assert main([str(clean.run_dir), *argv]) == 0
    assert capsys.readouterr().err == ""


def test_help_describes_the_refusals_ctrl_c_and_the_flagged_summary(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for needle in ("An option the command would ignore is refused", "130 interrupted (Ctrl-C)",
                   "killed or crashed?", "resume_from=RUN_DIR", "extension names the format",
                   "holding no TensorBoard event files", "the JSON Schema of the event lines --json prints",
                   "takes no filter"):
        assert needle in text, needle


# --- Ctrl-C during --follow ------------------------------------------------------------------


def test_ctrl_c_during_follow_exits_130_without_a_traceback(tmp_path):
    run_dir = _running_run(tmp_path)
    with Lease(run_dir.parent, RUN_ID):  # a live writer, as far as --follow can tell: it keeps following
        proc = subprocess.Popen([str(REPO / "tools" / "inspect"), str(run_dir), "--follow", "--kind", "run_started"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().split() == ["seq", "kind", "fields"]  # following, after its first poll
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 130, err
    assert err == ""


# --- plot to a format matplotlib cannot write ------------------------------------------------


@pytest.mark.parametrize("name, says", [("x.txt", "its extension .txt names no image format"),
                                        ("curves", "it has no extension")])
def test_plot_to_an_unwritable_format_exits_2_naming_the_path(name, says, clean: Run, tmp_path, capsys):
    out = tmp_path / name
    assert main([str(clean.run_dir), "plot", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"argument --out: cannot plot to {str(out)!r}: {says}" in err and ".png" in err and ".svg" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == [tmp_path / "runs"]


def test_plot_takes_an_upper_case_extension(clean: Run, tmp_path, capsys):
    out = tmp_path / "curves.PNG"
    assert main([str(clean.run_dir), "plot", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


# --- export twice into one directory ---------------------------------------------------------


def test_export_into_a_directory_holding_event_files_is_refused(real_run, tmp_path, capsys):
    tb = tmp_path / "tb"
    assert main([str(real_run), "export", "--tensorboard", str(tb)]) == 0
    (first,) = tb.iterdir()
    capsys.readouterr()
    assert main([str(real_run), "export", "--tensorboard", str(tb)]) == 2
    err = capsys.readouterr().err
    assert f"argument --tensorboard: {str(tb)!r} already holds TensorBoard event files ({first.name})" in err
    assert "choose an empty directory or delete them" in err
    assert list(tb.iterdir()) == [first]


def test_export_into_a_directory_without_event_files_is_allowed(real_run, tmp_path, capsys):
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "notes.txt").write_text("mine")
    assert main([str(real_run), "export", "--tensorboard", str(tb)]) == 0
    assert len([p for p in tb.iterdir() if p.name.startswith("events.out.tfevents.")]) == 1



def test_summary_says_whether_the_logs_values_verify_against_their_checksums(real_run, tmp_path, capsys):
    import shutil

    from events.logbase import seq_key

    assert main([str(real_run), "summary", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checksums"] == "ok"
    damaged = tmp_path / "r"
    shutil.copytree(real_run, damaged, ignore=shutil.ignore_patterns("lock.mdb"))
    with LmdbLog(damaged / "events.lmdb") as log:
        raw = bytearray(next(raw for seq, raw in log.read_raw(5, 6)))
        raw[-1] ^= 0x01  # one flipped bit, written past the checksum records (as rot would)
        with log._env.begin(write=True, db=log._events) as txn:
            txn.put(seq_key(5), bytes(raw))
    assert main([str(damaged), "summary"]) == 1  # damage the summary verified: a script checking it must not pass
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("checksums"))
    assert line.split(None, 1)[1] == "1 range of values do not verify: run tools/replay"
    # a log written before checksums existed: nothing verified, and said so
    import lmdb

    from events.sums import SUMS_DB

    old = tmp_path / "old"
    shutil.copytree(real_run, old, ignore=shutil.ignore_patterns("lock.mdb"))
    env = lmdb.open(str(old / "events.lmdb"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(SUMS_DB, txn=txn), delete=True)
    env.close()
    assert main([str(old), "summary", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checksums"] == "not verified: the log was written before checksums existed"


def test_the_docs_and_inspect_help_say_a_killed_cli_run_resumes_with_nnx_es_resume(capsys):
    """What ``summary`` prints for a killed ``nnx-es run`` (``nnx-es resume``) is what its help and the
    inspect guide (once the README's Tools section) say, beside ``fit(..., resume_from=...)`` for a run
    started from Python."""
    readme = " ".join((Path(__file__).resolve().parents[4] / "docs" / "guides" / "inspect.md").read_text().split())
    assert ("killed or crashed? resume it with `nnx-es resume runs/<id>` when `nnx-es run` started it, "
            "else `fit(..., resume_from=...)`") in readme
    assert main(["--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "resume it with nnx-es resume RUN_DIR (a run nnx-es run started" in help_text
    assert "else fit(..., resume_from=RUN_DIR)" in help_text
