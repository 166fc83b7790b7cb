"""nnx_es.distributed.elastic: each generation of a torchrun restart (or membership change) gets its own
rendezvous namespace."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from nnx_es.distributed.elastic import rendezvous_store, restart_count

TIMEOUT = datetime.timedelta(seconds=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_an_agent_store_the_group_starts_as_usual(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert rendezvous_store(TIMEOUT, 2) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert rendezvous_store(TIMEOUT, 2) is None


@pytest.mark.parametrize("value, count", [("", 0), ("3", 3), ("x", 0)])
def test_restart_count_reads_torchrun(monkeypatch, value, count):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", value)
    assert restart_count() == count


def _agent_store(monkeypatch) -> dist.TCPStore:
    """A store standing in for torchrun's agent's, and the environment its workers see (restart 0)."""
    port = _free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    return agent


def test_each_restart_reads_and_writes_its_own_keys_of_the_agent_store(monkeypatch):
    agent = _agent_store(monkeypatch)
    first = rendezvous_store(TIMEOUT, 2)
    first.set("rank_0", "old address")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = rendezvous_store(TIMEOUT, 2)
    second.set("rank_0", "new address")
    assert agent.get("nnx_es/restart_0/world_2/rank_0") == b"old address"
    assert agent.get("nnx_es/restart_1/world_2/rank_0") == b"new address"
    assert first.get("rank_0") == b"old address" and second.get("rank_0") == b"new address"


def test_a_membership_change_without_a_restart_count_gets_a_namespace_of_its_own(monkeypatch):
    # torchrun --nnodes=1:2: a node joining restarts the group at the same TORCHELASTIC_RESTART_COUNT, larger
    agent = _agent_store(monkeypatch)
    rendezvous_store(TIMEOUT, 1).set("rank_0", "one rank's address")
    joined = rendezvous_store(TIMEOUT, 2)
    joined.set("rank_1", "second rank's address")
    assert not joined.check(["rank_0"])  # the generation of 2 never reads the dead generation's rank 0
    assert agent.get("nnx_es/restart_0/world_1/rank_0") == b"one rank's address"
