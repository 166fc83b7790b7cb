"""A run directory turned against its user, through the command-line tools: each refuses, exits 2,
ends within a bound, and writes nothing (the log byte-identical, a link's target unchanged).

A run trained from a spec (its model state above INLINE_MAX: blob files), copied for each scenario;
then a link planted where the run keeps its log, blobs, a blob or its views, a FIFO or a link to
``/dev/zero`` in place of a blob, or a link where a runs root names the run. ``nnx-replay``,
``nnx-inspect``, ``nnx-es resume`` and ``NNModel.load`` run in other processes (children of the suite's
warm process, tests/warmkit.py) under a timeout (a hang fails the test, it does not stall the suite).
DESIGN.md "Trust boundaries".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import warmkit
from nnx_es.audit import audit_run
from nnx_es.storage import Lease

BOUND_S = 120  # every refusal below takes well under a second; a hang is cut here and fails


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a tool (``replay``: nnx-replay, ``inspect``: nnx-inspect, else nnx-es) with the bound; a hang fails."""
    script = {"replay": "nnx-replay", "inspect": "nnx-inspect"}.get(args[0])
    start = time.monotonic()
    try:
        out = warmkit.command(script, *args[1:], cwd=cwd, timeout=BOUND_S) if script else \
            warmkit.command("nnx-es", *args, cwd=cwd, timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(args)} did not end within {BOUND_S} s (it blocked on the run directory)")
    assert time.monotonic() - start < BOUND_S
    return out


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root`` (lock.mdb aside: readers take LMDB's reader slots in it)."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        if p.name == "lock.mdb":
            continue
        rel = str(p.relative_to(root))
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else \
            "fifo" if p.is_fifo() else p.read_bytes()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """``<tmp>/runs/r``: one epoch of the digits spec, its MLP wide enough to store blob files."""
    tmp = tmp_path_factory.mktemp("hostile")
    assert _cli(tmp, "init", "--out", "spec.json", "--epochs", "1").returncode == 0
    spec = json.loads((tmp / "spec.json").read_text())
    spec["model"]["kwargs"]["hidden"] = [1024]  # 64x1024 float32 weights: above INLINE_MAX
    (tmp / "spec.json").write_text(json.dumps(spec))
    run = _cli(tmp, "run", "spec.json", "--run-id", "r")
    assert run.returncode == 0, run.stderr
    assert len(list((tmp / "runs" / "r" / "blobs" / "sha256").iterdir())) >= 1
    return tmp


@pytest.fixture
def work(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run's directory (``work/runs/r``), the spec beside it, and a ``victim``
    directory outside the run where planted links point."""
    shutil.copytree(trained / "runs", tmp_path / "runs", symlinks=True)
    shutil.copy(trained / "spec.json", tmp_path / "spec.json")
    (tmp_path / "victim").mkdir()
    return tmp_path


def _model_blob(run: Path) -> Path:
    return max((run / "blobs" / "sha256").iterdir(), key=lambda p: p.stat().st_size)


def _plant(work: Path, place: str) -> Path:
    """Move what the run keeps at ``place`` into ``victim/`` and leave a link to it; return the link."""
    run = work / "runs" / "r"
    where = {"events.lmdb": run / "events.lmdb", "blobs": run / "blobs", "views": run / "views",
             "blob": _model_blob(run)}[place]
    target = work / "victim" / place
    shutil.move(where, target)
    where.symlink_to(target, target_is_directory=target.is_dir())
    return where


def _refused(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in out.stderr, out.stderr


@pytest.mark.parametrize("place", ["events.lmdb", "blobs", "blob", "views"])
def test_a_link_in_a_run_is_refused_by_every_tool_and_its_target_is_left_as_it_was(work: Path, place: str) -> None:
    link = _plant(work, place)
    run = work / "runs" / "r"
    victim, before_run = _tree(work / "victim"), _tree(run)
    said = f"{link.relative_to(work)} is a symbolic link"
    _refused(_cli(work, "replay", "runs/r"), said)
    if place == "blob":  # inspect reads no blob: it reads nothing through the link and ends
        assert _cli(work, "inspect", "runs/r", "summary").returncode == 0
    else:
        _refused(_cli(work, "inspect", "runs/r", "summary"), said)
    _refused(_cli(work, "resume", "runs/r", "--epochs", "2"), said)
    assert _tree(work / "victim") == victim  # the link's target: not read into, not written
    assert _tree(run) == before_run  # and the run: nothing written (its log byte-identical)


def test_a_run_directory_that_is_a_link_in_its_runs_root_is_refused_to_a_writer(work: Path) -> None:
    """The issue's second writer: another runs root whose ``r`` links to a run. A writer that names
    the run by runs root and id (``nnx-es run --runs-dir``, ``fit(resume='auto')``) is refused."""
    other = work / "other"
    other.mkdir()
    (other / "r").symlink_to(work / "runs" / "r", target_is_directory=True)
    before = _tree(work / "runs")
    out = _cli(work, "run", "spec.json", "--runs-dir", "other", "--run-id", "r")
    _refused(out, "other/r is a symbolic link")
    assert _tree(work / "runs") == before
    assert not (other / ".leases" / "r.lock").read_bytes()  # the lease file there never took a pid


def test_an_auto_resume_through_a_linked_run_directory_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    """The issue's exploit in the API: ``fit(runs_root=other, run_id='r', resume='auto')`` where
    ``other/r`` links to a finished run went on to resume that run, writing into it."""
    import torch
    from torch import nn

    from nnx_es import Trainer, UnsafePathError
    from trainkit import loaders, small_net

    def trainer(runs: Path) -> Trainer:
        net = small_net(0)
        return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), monitor="val_loss",
                       runs_root=runs, run_id="r", seed=0, progress=False)

    trainer(tmp_path / "runs").fit(*loaders(batch_size=8), epochs=1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "r").symlink_to(tmp_path / "runs" / "r", target_is_directory=True)
    before = _tree(tmp_path / "runs" / "r")
    with pytest.raises(UnsafePathError, match=r"other/r is a symbolic link"):
        trainer(tmp_path / "other").fit(*loaders(batch_size=8), epochs=2, resume="auto")
    assert _tree(tmp_path / "runs" / "r") == before


def test_a_second_writer_through_a_linked_path_meets_the_live_writers_lease(work: Path) -> None:
    """A link the user names (``latest -> runs/r``) is the user's naming: resolved, it reaches the
    run itself and its own lease; held by a live writer, the second writer is refused (exit 2)."""
    (work / "latest").symlink_to(work / "runs" / "r", target_is_directory=True)
    before = _tree(work / "runs" / "r")
    with Lease(work / "runs", "r"):  # the live writer
        out = _cli(work, "resume", "latest", "--epochs", "2")
    _refused(out, "is being written by another process")
    assert _tree(work / "runs" / "r") == before
    assert audit_run(work / "runs" / "r").ok


@pytest.mark.parametrize("hostile", ["fifo", "dev-zero"])
def test_a_fifo_or_dev_zero_in_place_of_a_blob_ends_at_once_with_a_clear_error(work: Path, hostile: str) -> None:
    run = work / "runs" / "r"
    blob = _model_blob(run)
    blob.unlink()
    if hostile == "fifo":
        os.mkfifo(blob)
        said = f"{blob.name} is a FIFO, not a regular file"
    else:
        blob.symlink_to("/dev/zero")
        said = f"{blob.name} is a symbolic link (to '/dev/zero')"
    before = _tree(run)
    _refused(_cli(work, "replay", "runs/r"), said)
    assert _cli(work, "inspect", "runs/r", "summary", "--verify").returncode == 0  # reads no blob: ends
    _refused(_cli(work, "resume", "runs/r", "--epochs", "2"), said)
    load = ("import sys\nfrom nnx_es import NNModel, UnsafePathError\nfrom nnx_es.recipes.models import MLP\n"
            "try:\n    NNModel(MLP(64, 10, hidden=[1024])).load('runs/r', 'last')\n"
            "except UnsafePathError as exc:\n    print(exc, file=sys.stderr); sys.exit(2)\n")
    try:
        out = warmkit.python_c(load, cwd=work, timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"NNModel.load did not end within {BOUND_S} s")
    _refused(out, said)
    assert _tree(run) == before


def test_a_resume_never_deletes_through_a_linked_blob_shard_outside_the_run(tmp_path: Path) -> None:
    """A run handed over with ``blobs/sha256/<2 hex>`` (the older sharded layout) linked to a directory of
    the user's holding a file named by a blob's digest (a content-addressed store names files so): the
    resume's retention prunes that blob's checkpoint and used to unlink the user's file through the link."""
    assert _cli(tmp_path, "init", "--out", "spec.json", "--epochs", "2").returncode == 0
    spec = json.loads((tmp_path / "spec.json").read_text())
    spec["model"]["kwargs"]["hidden"] = [1024]  # blob files
    spec["trainer"] = {"phase_every": 1, "keep_phases": 2}  # epoch 0's phase: rotated out by the resume
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    trained = _cli(tmp_path, "run", "spec.json", "--run-id", "r")
    assert trained.returncode == 0, trained.stderr
    run = tmp_path / "runs" / "r"
    from nnx_es.checkpoint import read_manifest
    from nnx_es.result import open_projections
    from nnx_es.storage import BlobStore

    kept = open_projections(run)[0].checkpoints
    store = BlobStore(run / "blobs")

    def files(manifest: str) -> set[str]:
        return {c.blob for c in read_manifest(store, manifest).components.values() if c.data is None}

    phase = min(kept.phases.values(), key=lambda p: p.epoch)
    blobs, last = files(phase.manifest), files(kept.last.manifest)
    doomed = sorted(blobs - last)
    assert doomed, (kept, blobs, last)
    store_dir = tmp_path / "victim"
    store_dir.mkdir()
    digest = doomed[0]
    shutil.move(run / "blobs" / "sha256" / digest, store_dir / digest)
    (run / "blobs" / "sha256" / digest[:2]).symlink_to(store_dir, target_is_directory=True)
    before = _tree(store_dir)
    out = _cli(tmp_path, "resume", "runs/r", "--epochs", "3")
    assert "Traceback" not in out.stderr, out.stderr
    assert f"sha256/{digest[:2]} is a symbolic link" in out.stderr, out.stderr  # said, never followed
    assert _tree(store_dir) == before  # the user's file is still there


@pytest.mark.parametrize("place", ["events.lmdb", "events.lmdb/data.mdb", "events.lmdb/lock.mdb"])
def test_inspect_diff_against_a_run_with_a_linked_log_exits_2_naming_the_link_not_a_difference(
        work: Path, place: str) -> None:
    """``inspect diff runs/r runs/r2`` where ``r2``'s log (or a file of it) links elsewhere ended in a traceback,
    exit 1 (= "differ"); a log linked to ``r``'s own read as "the same events"."""
    runs = work / "runs"
    shutil.copytree(runs / "r", runs / "r2", symlinks=True)
    link = runs / "r2" / place
    target = work / "victim" / Path(place).name
    if place == "events.lmdb":
        shutil.rmtree(link)
        target = runs / "r" / "events.lmdb"
    else:
        shutil.move(link, target)
    link.symlink_to(target, target_is_directory=target.is_dir())
    before = _tree(work / "victim")
    _refused(_cli(work, "inspect", "diff", "runs/r", "runs/r2"), f"runs/r2/{place} is a symbolic link")
    assert _tree(work / "victim") == before
