"""What a reader learns from a log's LMDB file: the map it needs, a damaged meta page, a key that is a seq."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from events.errors import EventLogError, NewLogError
from events.lmdbfile import HEADROOM_MAX, HEADROOM_MIN, meta_damage, reader_map_size, valid_key
from events.log import LmdbLog
from events.schema import EpochBegan

REPO = Path(__file__).resolve().parents[3]


def _sized(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.mark.parametrize("size, headroom", [(8192, HEADROOM_MIN), (300 << 20, 300 << 20), (5 << 30, HEADROOM_MAX)])
def test_a_reader_maps_its_file_and_room_to_grow_not_a_terabyte(tmp_path: Path, size: int, headroom: int):
    mapped = reader_map_size(_sized(tmp_path / "data.mdb", size))
    assert size + headroom <= mapped < size + headroom + (1 << 20) and mapped % (1 << 20) == 0


def test_a_reader_opened_on_a_small_log_maps_megabytes(tmp_path: Path):
    with LmdbLog(tmp_path / "log") as log:
        log.commit(EpochBegan(epoch=0))
    with LmdbLog(tmp_path / "log", readonly=True) as ro:
        assert ro.map_size() < 128 << 20


def test_keys_that_are_seqs():
    assert valid_key((0).to_bytes(8, "big")) and valid_key(((1 << 62) - 1).to_bytes(8, "big"))
    assert not valid_key((1 << 62).to_bytes(8, "big")) and not valid_key(((1 << 63) - 1).to_bytes(8, "big"))
    assert not valid_key(b"\x00" * 9) and not valid_key(b"\x05")


def _log_file(tmp_path: Path) -> Path:
    with LmdbLog(tmp_path / "log") as log:
        log.commit(EpochBegan(epoch=0))
    return tmp_path / "log" / "data.mdb"


def test_healthy_meta_pages_name_nothing(tmp_path: Path):
    assert meta_damage(_log_file(tmp_path)) is None


@pytest.mark.parametrize("offset, value, named", [
    (20, 254, "meta page 0 reads data format v254 (LMDB 0.9 writes v1, and the other meta page does not agree)"),
    (4096 + 16, 0xDEADBEEF, "meta page 1 has magic 0xdeadbeef, not LMDB's 0xbeefc0de"),
])
def test_a_changed_meta_page_is_named(tmp_path: Path, offset: int, value: int, named: str):
    data = _log_file(tmp_path)
    b = bytearray(data.read_bytes())
    struct.pack_into("<I", b, offset, value)
    data.write_bytes(bytes(b))
    assert meta_damage(data) == named


def test_both_meta_pages_reading_another_data_format_are_named_once(tmp_path: Path):
    data = _log_file(tmp_path)
    b = bytearray(data.read_bytes())
    struct.pack_into("<I", b, 20, 254)
    struct.pack_into("<I", b, 4096 + 20, 254)
    data.write_bytes(bytes(b))
    assert meta_damage(data) == ("both meta pages read data format v254 (LMDB 0.9 writes v1): another LMDB's file, "
                                 "or both damaged")


def test_a_file_that_is_not_lmdb_at_all_is_left_to_lmdb_to_name(tmp_path: Path):
    data = tmp_path / "data.mdb"
    data.write_bytes(b"not an LMDB environment\n" * 512)
    assert meta_damage(data) is None


_WRITER = (
    "import sys\nfrom events.log import LmdbLog\nfrom events.schema import EpochBegan\n"
    "w = LmdbLog(sys.argv[1])\nstart = w.next_seq\n"
    "for i in range(int(sys.argv[2])):\n"
    "    w.stage_blob(b'k%d' % (start + i), bytes(int(sys.argv[3])))\n"
    "    w.append(EpochBegan(epoch=start + i)); w.flush(sync=True)\n"
)


def _write(path: Path, n: int, size: int) -> None:
    subprocess.run([sys.executable, "-c", _WRITER, str(path), str(n), str(size)], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


def test_a_reader_mid_read_whose_map_a_writer_outgrows_is_told_to_read_again_then_follows(tmp_path: Path):
    path = tmp_path / "log"
    _write(path, 2100, 10)
    with LmdbLog(path, readonly=True, map_size=1 << 20) as ro:  # a small map, so that the writer outgrows it
        ro.read_chunk = 1024
        chunks = ro.read_chunks(0, ro.next_seq)
        assert next(chunks)[0] == 0  # a read is open
        _write(path, 4, 1 << 20)  # the file grows past the reader's map
        with pytest.raises(EventLogError, match=r"grew past this reader's map while one of its reads was open .*: "
                                                "read again"):
            ro.get_blob(b"k2100")
        assert [first for first, _ in chunks] == [1024, 2048]  # the open read was not ended
        assert ro.refresh() == 2104 and ro.get_blob(b"k2103") == bytes(1 << 20)  # remapped: it follows
        assert ro.map_size() < (1 << 20) * 4 + HEADROOM_MIN + (4 << 20)


def test_a_reader_of_a_log_whose_writer_has_not_created_its_databases_is_told_so(tmp_path: Path):
    lmdb.open(str(tmp_path / "log"), max_dbs=8).close()  # the data file, no database yet
    with pytest.raises(NewLogError, match="has no events database yet: its writer is creating it"):
        LmdbLog(tmp_path / "log", readonly=True)


_STARTING_WRITER = (
    "import sys, time, lmdb\nfrom pathlib import Path\nfrom events.log import LmdbLog\n"
    "from events.schema import EpochBegan, RunFinalized\nfrom nnx_es.storage import Lease\n"
    "root = Path(sys.argv[1])\nlease = Lease(root, 'live').acquire()\n"
    "lmdb.open(str(root / 'live' / 'events.lmdb'), max_dbs=8).close()  # created, no database yet\n"
    "print('created', flush=True)\ntime.sleep(1.5)\n"
    "with LmdbLog(root / 'live' / 'events.lmdb') as log:\n"
    "    log.append(EpochBegan(epoch=0)); log.commit(RunFinalized(status='completed', epochs=1, steps=0))\n"
)


def test_inspect_follow_waits_for_a_log_its_writer_is_creating(tmp_path: Path, capsys):
    from nnx_es.cli.inspect import main

    (tmp_path / "runs" / "live").mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-c", _STARTING_WRITER, str(tmp_path / "runs")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "created"
        assert main([str(tmp_path / "runs" / "live"), "--kind", "epoch_began"]) == 2  # not following: said
        assert "no events database yet" in capsys.readouterr().err
        assert main([str(tmp_path / "runs" / "live"), "--follow", "--json"]) == 0  # following: waited for it
        assert [json.loads(line)["kind"] for line in capsys.readouterr().out.splitlines()] == [
            "epoch_began", "run_finalized"]
    finally:
        assert writer.wait(timeout=60) == 0
