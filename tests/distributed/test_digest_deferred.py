"""The epoch-end digest comparison deferred into the epoch sums' all-reduce (one collective fewer an
epoch): equal digests are recorded without a gather; a difference is caught and gathered. A fake
two-rank world stands in for the group (the 2-rank planted divergence: test_trainer_ddp)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nnx_es.distributed.digest import ParamDigest, params_digest
from nnx_es.errors import DivergenceError


class _World:
    size, writer_rank, rank = 2, 0, 0

    def __init__(self, other: bytes) -> None:
        self.other, self.gathers = other, 0

    def gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.gathers += 1
        return [t, torch.frombuffer(bytearray(self.other), dtype=torch.uint8)]


class _Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def emit(self, e: Any) -> int:
        self.events.append(e)
        return len(self.events)


def _summed(mine: list[float], other: bytes) -> list[float]:
    """What the epoch sums' all-reduce gives for the deferred values of this rank and the other."""
    theirs = [float(b) for b in other] + [float(b * b) for b in other]
    return [a + b for a, b in zip(mine, theirs)]


def test_equal_digests_are_recorded_without_a_gather() -> None:
    net = torch.nn.Linear(3, 2)
    same = bytes.fromhex(params_digest(net))
    world, rec = _World(same), _Recorder()
    d = ParamDigest(net, world, None)
    values = d.at_epoch_end(rec, epoch=0, step=4, defer=True)
    assert values is not None and len(values) == 32 and rec.events == []  # nothing recorded before the sums
    d.settle(rec, _summed(values, same))
    assert world.gathers == 0
    assert [(e.step, e.diverged, e.digests) for e in rec.events] == [(4, False, [same.hex()] * 2)]


def test_a_one_byte_difference_is_caught_and_gathered() -> None:
    net = torch.nn.Linear(3, 2)
    mine = bytes.fromhex(params_digest(net))
    other = bytearray(mine)
    other[0] = (other[0] + 1) % 256  # world * sum of squares != sum**2 for that byte (Cauchy-Schwarz)
    world, rec = _World(bytes(other)), _Recorder()
    d = ParamDigest(net, world, None)
    values = d.at_epoch_end(rec, epoch=1, step=8, defer=True)
    with pytest.raises(DivergenceError, match=r"rank\(s\) \[1\]"):
        d.settle(rec, _summed(values, bytes(other)))
    assert world.gathers == 1 and rec.events[-1].diverged is True  # gathered to record and name them


def test_without_defer_the_digests_are_gathered_at_once() -> None:
    net = torch.nn.Linear(3, 2)
    world, rec = _World(bytes.fromhex(params_digest(net))), _Recorder()
    assert ParamDigest(net, world, None).at_epoch_end(rec, epoch=0, step=2) is None
    assert world.gathers == 1 and len(rec.events) == 1


def test_a_divergence_names_a_setting_that_differs_between_ranks_as_a_cause() -> None:
    """A fresh user's per-rank learning rate (and gradient clipping) diverged the ranks; the message
    listed hooks, RNGs and kernels only."""
    net = torch.nn.Linear(3, 2)
    other = bytearray.fromhex(params_digest(net))
    other[3] ^= 1
    with pytest.raises(DivergenceError) as err:
        ParamDigest(net, _World(bytes(other)), None).check(_Recorder(), epoch=0, step=2)
    msg = str(err.value)
    assert "rank(s) [1]" in msg and "a setting differs between ranks" in msg
    for what in ("learning rate", "scheduler", "gradient clipping", "build every rank's trainer with the same settings",
                 "a hook or callback touching them"):
        assert what in msg, (what, msg)
