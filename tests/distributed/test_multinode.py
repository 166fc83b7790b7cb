"""Across machines: the same script under two torchrun agents (``--nnodes=2 --nproc-per-node=1``,
c10d rendezvous on 127.0.0.1, standing in for two hosts) gives the same run as one agent with
two ranks -- the writer's last checkpoint bitwise, the history equal -- and the agent whose rank
is not the writer never touches its runs root (issue 13, "Across machines")."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec
import pytest

from launch import REPO, free_port, kill, results, torchrun
from nnx_es.checkpoint import read_manifest
from nnx_es.result import load_result
from nnx_es.storage import BlobStore

SCRIPT = REPO / "tests" / "distributed" / "elastic_script.py"
RUN = "main"
TIMEOUT_S = 150.0


def _script_args(out: Path) -> list[str]:
    return [str(out), "", RUN]  # no kill, one run


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
    result = load_result(run_dir)
    manifest = read_manifest(BlobStore(run_dir / "blobs"), result.last.manifest)
    return {name: comp.blob for name, comp in manifest.components.items()}


def test_two_agents_give_the_single_node_run_and_only_the_writer_writes(tmp_path):
    single = tmp_path / "single"
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for d in (single, *nodes):
        d.mkdir()
    port = free_port()
    agents = [torchrun(SCRIPT, *_script_args(d), nproc=1, nnodes=2, node_rank=i, port=port, wait=False)
              for i, d in enumerate(nodes)]
    try:
        for a in agents:
            _wait(a, TIMEOUT_S)
    finally:
        for a in agents:
            kill(a)
    try:
        proc = torchrun(SCRIPT, *_script_args(single), nproc=2, timeout_s=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the single-node launch did not end within {TIMEOUT_S} s:\n{(exc.output or '')[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-4000:]

    # the c10d rendezvous, not --node-rank, orders the agents: find the node that got rank 0 (the writer)
    owner = {r: i for i, d in enumerate(nodes) for r in (0, 1) if (d / f"{RUN}.rank{r}.json").exists()}
    assert sorted(owner) == [0, 1] and owner[0] != owner[1], owner
    writer, other = nodes[owner[0]], nodes[owner[1]]
    assert not (other / "runs").exists() or not any((other / "runs").rglob("*")), \
        f"the non-writer node wrote under its runs root: {sorted(map(str, (other / 'runs').rglob('*')))}"

    multi = [results(nodes[owner[r]], RUN)[r] for r in (0, 1)]
    one = results(single, RUN)
    for a, b in zip(multi, one):
        assert a["status"] == b["status"] == "completed"
        assert a["params"] == b["params"]  # every rank's final parameters, bitwise
        assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])
    assert _history(writer / "runs" / RUN) == _history(single / "runs" / RUN)
    assert _last_components(writer / "runs" / RUN) == _last_components(single / "runs" / RUN)
