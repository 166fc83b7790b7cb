"""Across machines: the same script under two torchrun agents (``--nnodes=2 --nproc-per-node=1``,
c10d rendezvous on 127.0.0.1, standing in for two hosts) gives the same run as one agent with
two ranks -- the writer's last checkpoint bitwise, the history equal -- and the agent whose rank
is not the writer never touches its runs root (issue 13, "Across machines"). The script is
``examples/ddp_supervised.py``; each agent gets its own runs root (a host's own disk) through its
``--runs`` argument, the one thing in which the two command lines differ."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec
import pytest

from launch import REPO, free_port, kill, torchrun
from nnx_es.audit import audit_run
from nnx_es.checkpoint import read_manifest
from nnx_es.result import load_result
from nnx_es.storage import BlobStore

#: the example script both launches run (its --runs is the runs root)
SCRIPT = REPO / "examples" / "ddp_supervised.py"
RUN = "multinode"
TIMEOUT_S = 150.0


def _script_args(runs_root: Path) -> list[str]:
    return ["--epochs", "2", "--run-id", RUN, "--runs", str(runs_root)]


def _wait(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, _ = proc.communicate()
        pytest.fail(f"an agent did not end within {timeout} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


def _history(run_dir: Path) -> list[dict]:
    records = [msgspec.to_builtins(r) for r in load_result(run_dir).history]
    for r in records:
        r.pop("wall_time_s", None)
    return records


def _last_components(run_dir: Path) -> dict[str, str]:
    """Each component of the run's LAST checkpoint by its SHA-256 (the model's: the parameters, bitwise)."""
    result = load_result(run_dir)
    assert result.status == "completed", result.status
    manifest = read_manifest(BlobStore(run_dir / "blobs"), result.last.manifest)
    return {name: comp.blob for name, comp in manifest.components.items()}


def test_two_agents_give_the_single_node_run_and_only_the_writer_writes(tmp_path):
    single_root = tmp_path / "single-runs"
    roots = [tmp_path / "host0-runs", tmp_path / "host1-runs"]  # each agent's own runs root (its host's disk)
    for d in (single_root, *roots):
        d.mkdir()
    port = free_port()
    # the same script for both agents; only their runs root differs
    agents = [torchrun(SCRIPT, *_script_args(root), nproc=1, nnodes=2, node_rank=i, port=port, wait=False,
                       warm=False)  # two agents, each starting a new interpreter, as on two machines
              for i, root in enumerate(roots)]
    try:
        for a in agents:
            _wait(a, TIMEOUT_S)
    finally:
        for a in agents:
            kill(a)
    try:
        proc = torchrun(SCRIPT, *_script_args(single_root), nproc=2, timeout_s=TIMEOUT_S, warm=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the single-node launch did not end within {TIMEOUT_S} s:\n{(exc.output or '')[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-4000:]

    # the c10d rendezvous, not --node-rank, orders the agents: the writer (rank 0) is on either host,
    # and only its runs root holds anything
    used = [r for r in roots if any(r.iterdir())]
    assert len(used) == 1, {str(r): sorted(p.name for p in r.iterdir()) for r in roots}
    writer = used[0]
    (other,) = [r for r in roots if r != writer]
    assert sorted(p.name for p in writer.iterdir()) == [".leases", RUN]
    assert list(other.rglob("*")) == []

    # the same run: every component of the last checkpoint (the model's: the parameters, bitwise), the history
    assert _last_components(writer / RUN) == _last_components(single_root / RUN)
    assert _history(writer / RUN) == _history(single_root / RUN)
    assert len(_history(writer / RUN)) == 2
    report = audit_run(writer / RUN)
    assert report.ok, [str(v) for v in report.violations]
