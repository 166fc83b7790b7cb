"""The power-loss recorder (the LD_PRELOAD shim) and the crash-state model, on small traces."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nnx_es.testing.crashstates import PAGE, SECTOR, TraceError, crash_states, persistence_points
from nnx_es.testing.tracer import NoCompilerError, Op, build_shim, read_trace, traced_env

REPO = Path(__file__).resolve().parents[4]
ROOT = "/r"


def run_traced(tmp_path: Path, code: str) -> list[Op]:
    try:
        lib = build_shim()
    except NoCompilerError as exc:
        pytest.skip(f"the tracing shim needs a C compiler: {exc}")
    root = tmp_path / "root"
    root.mkdir()
    env = traced_env(lib, tmp_path / "trace.bin", root)
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=root, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    return [op for op in read_trace(tmp_path / "trace.bin")]


def test_the_shim_records_lmdb_writes_from_c_and_a_durable_file_write_with_their_data(tmp_path):
    ops = run_traced(tmp_path, '''
        import lmdb, os
        from pathlib import Path
        env = lmdb.open("log", sync=True, metasync=False)
        with env.begin(write=True) as txn:
            txn.put(b"k", b"v" * 5000)
        env.close()
        from nnx_es.storage import atomic_write
        atomic_write(Path("blobs/x"), b"hello")
        open("/dev/null", "w").write("not traced")
    ''')
    root = str((tmp_path / "root").resolve())
    kinds = [op.op for op in ops]
    assert not any(op.path.endswith("lock.mdb") for op in ops)
    data = [op for op in ops if op.op == "write" and op.data.count(b"v") >= 5000]
    assert data, "LMDB's pwrite of the value's page is recorded with its bytes"
    assert "fdatasync" in kinds  # LMDB's own sync, from C
    rename = next(op for op in ops if op.op == "rename")
    assert rename.path2 == f"{root}/blobs/x" and rename.path.startswith(f"{root}/blobs/.x.")
    blob = next(op for op in ops if op.op == "write" and op.data == b"hello")
    assert kinds.index("rename") > ops.index(blob)
    assert all(op.path.startswith(root) or not op.path for op in ops)


def test_the_shim_does_nothing_without_its_environment(tmp_path):
    lib = None
    try:
        lib = build_shim()
    except NoCompilerError as exc:
        pytest.skip(str(exc))
    env = {**os.environ, "LD_PRELOAD": str(lib)}
    proc = subprocess.run([sys.executable, "-c", "open('x', 'w').write('y')"], cwd=tmp_path, env=env)
    assert proc.returncode == 0 and not list(tmp_path.glob("*.bin"))


def W(path, fd, off, data):  # noqa: N802 - a compact trace
    return Op("write", fd=fd, offset=off, arg=len(data), data=data)


def opened(path, fd, created=True):
    return Op("open", fd=fd, flags=os.O_WRONLY | os.O_CREAT, arg=int(created), path=f"{ROOT}/{path}")


def test_a_rename_without_its_directory_fsync_may_vanish_and_with_it_may_not():
    base = [Op("mkdir", path=f"{ROOT}/d"), Op("open", fd=3, flags=os.O_RDONLY | os.O_DIRECTORY, path=ROOT),
            Op("fsync", fd=3), opened("d/.t", 4), W("d/.t", 4, 0, b"abc"), Op("fsync", fd=4),
            Op("rename", path=f"{ROOT}/d/.t", path2=f"{ROOT}/d/x"), Op("fsync", fd=3)]
    assert len(persistence_points(base, ROOT)) == 3
    final = [s for s in crash_states(base, ROOT, per_point=50, seed=1, distinct=False) if s.point == 3]
    assert {("d/x" in s.files) for s in final} == {True, False}  # the root's fsync does not cover d's entry
    synced = base + [Op("open", fd=5, flags=os.O_RDONLY | os.O_DIRECTORY, path=f"{ROOT}/d"), Op("fsync", fd=5)]
    last = [s for s in crash_states(synced, ROOT, per_point=50, seed=1, distinct=False) if s.point == 4]
    assert last and all(s.files.get("d/x") == b"abc" for s in last)


def test_unsynced_pages_are_kept_lost_reordered_and_torn_at_sector_boundaries():
    old, new = b"o" * (2 * PAGE), b"n" * (2 * PAGE)
    ops = [opened("f", 3), W("f", 3, 0, old), Op("fsync", fd=3),
           Op("open", fd=4, flags=os.O_RDONLY | os.O_DIRECTORY, path=ROOT), Op("fsync", fd=4), W("f", 3, 0, new)]
    states = [s for s in crash_states(ops, ROOT, per_point=200, seed=0, distinct=False) if s.point == 2]
    contents = {s.files.get("f") for s in states}
    pages = {(c[:PAGE] == new[:PAGE], c[PAGE:] == new[PAGE:]) for c in contents if c}
    assert {(True, False), (False, True), (True, True), (False, False)} <= pages  # any page may arrive alone
    torn = [c for c in contents if c and 0 < c[:PAGE].count(b"n") < PAGE]
    assert torn and all(c[:PAGE].count(b"n") % SECTOR == 0 for c in torn)
    assert states[0].files["f"] == old  # the first state of a point keeps nothing unsynced


def test_a_commit_mark_sets_what_the_states_after_it_must_keep_and_a_writable_mmap_is_refused():
    ops = [opened("f", 3), W("f", 3, 0, b"x"), Op("fdatasync", fd=3), Op("mark", arg=7)]
    states = list(crash_states(ops, ROOT, per_point=5))
    assert [s.committed_events for s in states if s.point == 1] and all(
        s.committed_events == 7 for s in states if s.point == 1)
    with pytest.raises(TraceError, match="shared writable mmap"):
        persistence_points([Op("unsupported", path=f"{ROOT}/f", path2="a shared writable mmap (MDB_WRITEMAP?)")], ROOT)


def test_a_huge_states_budget_ends_once_each_points_distinct_states_are_drawn():
    ops = [opened("f", 3), W("f", 3, 0, b"x"), Op("fsync", fd=3),
           Op("open", fd=4, flags=os.O_RDONLY | os.O_DIRECTORY, path=ROOT), Op("fsync", fd=4), W("f", 3, 0, b"y")]
    states = list(crash_states(ops, ROOT, per_point=10**9))  # used to draw 3e9 times at a point with 2 states
    assert 1 <= len(states) <= 12 and len({(s.digest, s.committed_events) for s in states}) == len(states)
