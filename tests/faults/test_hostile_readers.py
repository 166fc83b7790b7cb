"""Readers of a run someone else handed over: damage is named (exit 2), strings are shown, never acted on.

A small real run (its one callback named with terminal controls: ``ESC ]0;title BEL`` sets the
terminal's title, ``ESC [2J`` clears the screen) is damaged or forged in a private copy, then read
by ``tools/replay``, ``inspect`` (events, summary, ``--at``, a runs root, ``diff``), ``nnx-es diagnose``
and ``NNModel.load``. Forging uses the log's own test hooks (``put_raw``, ``put_blob_raw``) or LMDB
directly; bit rot changes ``data.mdb`` itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import lmdb
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trainkit import loaders, small_net

from crashkit import flip_in_file
from events.codec import decode, encode
from events.errors import DamagedLogError, EventLogError
from events.log import LmdbLog
from events.schema import LastCommitted
from nnx_es import LambdaCallback
from nnx_es.checkpoint import Component, Manifest
from nnx_es.cli import inspect as inspect_cli
from nnx_es.cli import replay as replay_cli
from nnx_es.cli.main import main as nnx_es_main
from nnx_es.errors import ConfigError, CorruptCheckpointError, NnxError
from nnx_es.nnmodel import NNModel

EVIL = "cb\x1b]0;pwned\x07\x1b[2J"
RAW_CONTROLS = ("\x1b", "\x07")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-epoch run of a real Trainer whose callback is named :data:`EVIL`."""
    root = tmp_path_factory.mktemp("hostile") / "runs"
    NNModel(small_net()).train(*loaders(), epochs=2, runs_root=root, run_id="small", progress=False,
                               callbacks=[LambdaCallback(name=EVIL, on_epoch_end=lambda ctx: None)])
    return root / "small"


@pytest.fixture
def run(small_run: Path, tmp_path: Path) -> Path:
    """A private copy of the small run, under ``tmp_path/runs``."""
    dest = tmp_path / "runs" / small_run.name
    shutil.copytree(small_run, dest, ignore=shutil.ignore_patterns("lock.mdb"))
    return dest


def _no_traceback(captured: pytest.CaptureResult[str]) -> None:
    assert "Traceback" not in captured.err + captured.out


def _unescaped(text: str) -> bool:
    return any(c in text for c in RAW_CONTROLS)


# --- a key that is not a seq, a damaged meta page -------------------------------------------------------


def put_key(log_dir: Path, key: bytes, value: bytes) -> None:
    """Store ``value`` under ``key`` in the log's events database, with LMDB itself (any key, no checksum)."""
    env = lmdb.open(str(log_dir), max_dbs=8)
    try:
        with env.begin(write=True, db=env.open_db(b"events")) as txn:
            txn.put(key, value)
    finally:
        env.close()


@pytest.mark.parametrize("key", [(1 << 63).to_bytes(8, "big"), ((1 << 63) - 1).to_bytes(8, "big"), b"\xff" * 8,
                                 b"\xff" * 9, b"\x7f"])
def test_a_last_key_that_is_not_a_seq_is_named_as_damage_by_every_reader(run: Path, capsys, key):
    with LmdbLog(run / "events.lmdb", readonly=True) as log:
        raw = dict(log.read_raw())[3]
    put_key(run / "events.lmdb", key, raw)
    for argv in (["summary"], ["summary", "--json"], [], ["--at", "5"], ["rows"]):
        assert inspect_cli.main([str(run), *argv]) == 2, argv
        captured = capsys.readouterr()
        _no_traceback(captured)
        assert "is damaged: its last key" in captured.err and "is not a seq" in captured.err
    assert replay_cli.main([str(run)]) == 2
    assert "is not a seq" in capsys.readouterr().err
    assert inspect_cli.main([str(run.parent)]) == 1  # the listing names it
    assert "DamagedLogError" in capsys.readouterr().out
    with pytest.raises(DamagedLogError, match="is not a seq"):
        NNModel(small_net()).load(run, "last")


def test_a_damaged_meta_page_is_named_as_damage_not_as_a_data_format(run: Path, capsys):
    data = run / "events.lmdb" / "data.mdb"
    b = bytearray(data.read_bytes())
    struct.pack_into("<I", b, 20, 254)  # meta page 0's data format: bit rot
    data.write_bytes(bytes(b))
    assert replay_cli.main([str(run), "--json"]) == 2
    captured = capsys.readouterr()
    _no_traceback(captured)
    error = json.loads(captured.out)["error"]
    assert error["type"] == "DamagedLogError"
    assert "is damaged: meta page 0 reads data format v254" in error["message"]
    assert "not supported" not in error["message"]


# --- terminal controls ---------------------------------------------------------------------------------


def test_inspect_and_replay_show_a_callback_name_with_terminal_controls_escaped(run: Path, capsys):
    for argv in ([], ["--kind", "callback_began"], ["summary"], ["--at", "30"]):
        assert inspect_cli.main([str(run), *argv]) == 0, argv
        captured = capsys.readouterr()
        assert not _unescaped(captured.out + captured.err), argv
    assert inspect_cli.main([str(run), "--kind", "callback_began"]) == 0
    assert "cb\\x1b]0;pwned\\x07\\x1b[2J" in capsys.readouterr().out  # shown, escaped
    assert inspect_cli.main([str(run), "--kind", "callback_began", "--json"]) == 0
    out = capsys.readouterr().out
    assert not _unescaped(out) and json.loads(out.splitlines()[0])["name"] == EVIL  # JSON decodes to the name
    assert replay_cli.main([str(run)]) == 0
    assert not _unescaped(capsys.readouterr().out)


def test_a_runs_listing_escapes_a_run_directory_named_with_terminal_controls(run: Path, capsys):
    evil = run.parent / "r\x1b[2J\u202e"
    run.rename(evil)
    assert inspect_cli.main([str(run.parent)]) == 0
    out = capsys.readouterr().out
    assert "r\\x1b[2J\\u202e" in out and not _unescaped(out) and "\u202e" not in out
    assert inspect_cli.main([str(run.parent), "--json"]) == 0
    out = capsys.readouterr().out
    assert "\u202e" not in out and json.loads(out)["run_id"] == evil.name


# --- diff and the runs listing verify checksums ---------------------------------------------------------


def test_diff_of_a_bit_rotted_log_exits_2_naming_the_damage_not_a_difference(small_run: Path, run: Path, capsys):
    flip_in_file(run, 20, 2, 0x41)
    for argv in ([str(small_run), str(run)], [str(run), str(small_run), "--json"]):
        assert inspect_cli.main(["diff", *argv]) == 2
        captured = capsys.readouterr()
        _no_traceback(captured)
        assert f"the event log of {run} is damaged" in captured.err
        assert "do not verify against their checksums" in captured.err and "first difference" not in captured.out
    assert json.loads(captured.out)["error"]["type"] == "DamagedLogError"


def test_diff_of_an_undecodable_event_exits_2_not_1(small_run: Path, run: Path, capsys):
    with LmdbLog(run / "events.lmdb") as log:
        log.put_raw(20, b"\x92\x01\x02")  # the checksum recomputed: not bit rot, a value that does not decode
    assert inspect_cli.main(["diff", str(small_run), str(run)]) == 2
    captured = capsys.readouterr()
    _no_traceback(captured)
    assert "event at seq 20 does not decode" in captured.err and "nothing was compared" in captured.err


def test_a_runs_listing_shows_a_bit_rotted_run_as_damaged(run: Path, capsys):
    flip_in_file(run, 20, 2, 0x41)
    assert inspect_cli.main([str(run.parent)]) == 1
    out = capsys.readouterr().out
    row = out.splitlines()[1].split()
    assert row[:2] == ["small", "damaged"]
    assert "small: damaged: 1 range of values do not verify against their checksums" in out
    assert inspect_cli.main([str(run.parent), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "damaged"


# --- NNModel.load checks that the checkpoint is the run's ---------------------------------------------


def _forge_last(run: Path, change: Callable[[Manifest], Manifest]) -> None:
    """Make the run's final LAST name ``change(its manifest)``, stored in the log, the checksums recomputed:
    a forged run, as a writer would have written it."""
    with LmdbLog(run / "events.lmdb") as log:
        seq, last = [(s, e) for s, e in log.read() if isinstance(e, LastCommitted)][-1]
        mine = msgspec.msgpack.decode(log.get_blob(last.manifest.encode()), type=Manifest)
        forged = msgspec.msgpack.encode(change(mine))
        digest = hashlib.sha256(forged).hexdigest()
        log.put_blob_raw(digest.encode(), forged)
        log.put_raw(seq, encode(msgspec.structs.replace(decode(dict(log.read_raw())[seq]), manifest=digest)))


def test_nnmodel_load_refuses_a_last_that_names_another_runs_manifest(run: Path):
    _forge_last(run, lambda m: msgspec.structs.replace(m, run_id="another"))  # its blobs the same bytes
    assert replay_cli.main([str(run)]) == 1  # the audit refuses it (invariant 4) ...
    with pytest.raises(CorruptCheckpointError, match="belongs to run 'another', not 'small'"):
        NNModel(small_net()).load(run, "last")  # ... and so does load


def _with_model(state: bytes) -> Callable[[Manifest], Manifest]:
    comp = Component(blob=hashlib.sha256(state).hexdigest(), codec="tensors", bytes=len(state), data=state)
    return lambda m: msgspec.structs.replace(m, components={**m.components, "model": comp})


def _tensors_codec(tree: object) -> bytes:
    encoded = msgspec.msgpack.encode(tree)
    return len(encoded).to_bytes(8, "little") + encoded


@pytest.mark.parametrize("state, error, named", [
    (_tensors_codec([1, 2]), ConfigError, "the checkpoint's weights are a list, not a state dict"),
    (_tensors_codec({"0.weight": "w", 7: 1}), ConfigError, "0.weight: a str in the checkpoint, not a tensor"),
    (_tensors_codec({"w": msgspec.msgpack.Ext(1, msgspec.msgpack.encode(["float32", [1 << 20] * 2, 0, 4 << 40]))}),
     CorruptCheckpointError, "component 'model' does not decode: a float32 tensor of shape"),
    (_tensors_codec(msgspec.msgpack.Ext(3, msgspec.msgpack.encode([{}, {"": 5}]))), CorruptCheckpointError,
     "metadata is not a map of maps"),
])
def test_nnmodel_load_of_a_crafted_model_state_names_it(run: Path, state: bytes, error: type, named: str):
    _forge_last(run, _with_model(state))
    with pytest.raises(error, match=re.escape(named)):
        NNModel(small_net()).load(run, "last")


def test_nnmodel_load_of_a_damaged_log_raises_a_log_error(run: Path):
    data = run / "events.lmdb" / "data.mdb"
    b = bytearray(data.read_bytes())
    struct.pack_into("<I", b, 16, 0x12345678)  # meta page 0's magic
    data.write_bytes(bytes(b))
    with pytest.raises(EventLogError, match="meta page 0 has magic 0x12345678"):
        NNModel(small_net()).load(run, "best")


# --- hypothesis: forged keys and values, every reader bounded ----------------------------------------------

_DBS = (b"events", b"sums", b"snapshots", b"blobs")
_keys = st.one_of(st.integers(0, 60).map(lambda s: s.to_bytes(8, "big")),
                  st.sampled_from([(1 << 62) - 1, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]).map(
                      lambda s: s.to_bytes(8, "big")),
                  st.binary(min_size=1, max_size=12))
_forgeries = st.lists(st.tuples(st.sampled_from(_DBS), _keys, st.one_of(st.binary(max_size=48), st.none()),
                                st.booleans()), min_size=1, max_size=3)


def _forge(log_dir: Path, forgeries: list[tuple[bytes, bytes, bytes | None, bool]]) -> None:
    """Store each ``(db, key, value, derived)`` with LMDB itself: ``value`` None deletes the key; ``derived``
    stores a stored value of that database with its bytes changed by ``value`` (a plausible forgery)."""
    env = lmdb.open(str(log_dir), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            for name, key, value, derived in forgeries:
                db = env.open_db(name, txn=txn)
                if value is None:
                    txn.delete(key, db=db)
                    continue
                if derived and (old := txn.get(key, db=db)) is not None:
                    value = bytes(old[:len(old) // 2]) + value + bytes(old[len(old) // 2 + len(value):])
                txn.put(key, value, db=db)
    finally:
        env.close()


def _readers(run: Path, pristine: Path) -> list[tuple[str, Callable[[], int]]]:
    def load() -> int:
        try:
            NNModel(small_net()).load(run, "last")
        except NnxError:
            return 2
        return 0

    inspect_argvs = ([], ["--json"], ["summary"], ["summary", "--verify", "--json"], ["--at", "20"])
    return [("replay", lambda: replay_cli.main([str(run), "--json"])),
            *((f"inspect {' '.join(a)}", lambda a=a: inspect_cli.main([str(run), *a])) for a in inspect_argvs),
            ("inspect RUNS_ROOT", lambda: inspect_cli.main([str(run.parent)])),
            ("inspect diff", lambda: inspect_cli.main(["diff", str(pristine), str(run)])),
            ("nnx-es diagnose", lambda: nnx_es_main(["diagnose", str(run), "--json"])),
            ("NNModel.load", load)]


@settings(max_examples=25, deadline=20_000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(forgeries=_forgeries)
def test_a_forged_log_is_read_or_refused_by_every_reader_without_a_traceback(small_run: Path, forgeries):
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "runs" / "small"
        shutil.copytree(small_run, run, ignore=shutil.ignore_patterns("lock.mdb"))
        _forge(run / "events.lmdb", forgeries)
        out = io.StringIO()
        for name, reader in _readers(run, small_run):
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                status = reader()  # anything raised here is a traceback the reader lets through
            assert status in (0, 1, 2), (name, status)
        assert "Traceback" not in out.getvalue()
