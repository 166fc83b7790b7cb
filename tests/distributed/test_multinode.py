"""Across machines: the same script under two torchrun agents (``--nnodes=2 --nproc-per-node=1``,
c10d rendezvous on 127.0.0.1, standing in for two hosts) gives the same run as one agent with
two ranks -- the writer's last checkpoint bitwise, the history equal -- and the agent whose rank
is not the writer never touches its runs root (issue 13, "Across machines"). Both agents run the
same command line; each gets its own runs root through ``NNX_ES_RUNS_ROOT`` (a host's own disk)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec
import pytest

from launch import REPO, free_port, kill, results, torchrun
from nnx_es.audit import audit_run
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
    single, multi_out = tmp_path / "single", tmp_path / "multi"
    roots = [tmp_path / "host0-runs", tmp_path / "host1-runs"]  # each agent's own runs root (its host's disk)
    for d in (single, multi_out, *roots):
        d.mkdir()
    port = free_port()
    # the same command line for both agents; only their environment differs
    agents = [torchrun(SCRIPT, *_script_args(multi_out), nproc=1, nnodes=2, node_rank=i, port=port, wait=False,
                       env={"NNX_ES_RUNS_ROOT": str(root)})
              for i, root in enumerate(roots)]
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

    multi, one = results(multi_out, RUN), results(single, RUN)
    assert [r.get("missing") for r in multi + one] == [None] * 4
    # the c10d rendezvous, not --node-rank, orders the agents: rank 0 (the writer) is on either host
    writer, other = Path(multi[0]["runs_root"]), Path(multi[1]["runs_root"])
    assert sorted([writer, other]) == sorted(roots)
    assert sorted(p.name for p in writer.iterdir()) == [".leases", RUN]
    assert list(other.rglob("*")) == [], f"the non-writer host wrote under its runs root: {list(other.rglob('*'))}"

    for a, b in zip(multi, one):
        assert a["status"] == b["status"] == "completed"
        assert a["params"] == b["params"]  # every rank's final parameters, bitwise
        assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])
    assert _history(writer / RUN) == _history(single / "runs" / RUN)
    assert _last_components(writer / RUN) == _last_components(single / "runs" / RUN)
    report = audit_run(writer / RUN)
    assert report.ok, [str(v) for v in report.violations]
