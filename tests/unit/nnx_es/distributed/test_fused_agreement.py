"""FusedAgreement: the window's agreement in DDP's last gradient bucket (a one-rank gloo group here;
the 2-rank behaviour runs in bench/ddp.py's fused row and the hook's sums are plain all-reduces)."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nnx_es.distributed.fused import FusedAgreement
from nnx_es.errors import ConfigError


@pytest.fixture
def group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=20))
    yield
    dist.destroy_process_group()


def _grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in net.parameters()]


def test_the_staged_values_come_back_summed_and_the_gradients_are_ddps(group):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    twin = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    twin.load_state_dict(plain.state_dict())
    model = DistributedDataParallel(twin, bucket_cap_mb=0.0001)  # several buckets: only the last carries
    fused = FusedAgreement(model)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    for declared in (True, False, True):  # the result is handed out once per synchronizing backward
        for net in (plain, twin):
            net.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(plain(x), y).backward()
        values = torch.tensor([1.25, 5.0, 0.0], dtype=torch.float64) + 2.0 ** -40  # not exact in float32
        before = fused.fallbacks
        fused.stage(values, float32_sums=declared)  # multiples of 2**-149: float32 parts carry them exactly
        nn.functional.cross_entropy(model(x), y).backward()
        got = fused.result()
        assert got == values.tolist()  # bitwise, as Python floats
        assert fused.fallbacks == before + (0 if declared else 1)  # undeclared: a float64 all-reduce of its own
        assert fused.result() is None
        for a, b in zip(_grads(plain), _grads(twin)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_staged_from_the_host_come_back_as_from_the_device(group, dtype):
    """stage_host: the parts written beside a float32 CPU bucket in a buffer kept between windows
    (a float64 bucket takes the values as a tensor): the same sums, fallbacks and gradients as stage."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    twins = [nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype) for _ in range(2)]
    models, agreements = [], []
    for twin in twins:
        twin.load_state_dict(plain.state_dict())
        models.append(DistributedDataParallel(twin, bucket_cap_mb=0.0001))
        agreements.append(FusedAgreement(models[-1]))
    x, y = torch.randn(5, 4, dtype=dtype), torch.randint(0, 3, (5,))
    for values, declared in (([1.25, 5.0], True), ([2.0 ** -200, 3.0], False), ([7.5, 2.0 ** 130], True),
                             ([0.5, 1.0, 8.0], True), ([3.0, 4.0], True)):  # another count, then back
        for net in (plain, *twins):
            net.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(plain(x), y).backward()
        agreements[0].stage(torch.tensor(values, dtype=torch.float64), float32_sums=declared)
        agreements[1].stage_host(values, float32_sums=declared)
        got = []
        for model, agreement in zip(models, agreements):
            nn.functional.cross_entropy(model(x), y).backward()
            got.append((agreement.result(), agreement.fallbacks, agreement.last_bytes))
        assert got[0] == got[1]
        assert got[1][0] == values  # one rank: the sums are the values
        for twin in twins:
            for a, b in zip(_grads(plain), _grads(twin)):
                assert torch.equal(a, b)
    # float32: the undeclared values and the one beyond 2**128 fall back; a float64 bucket carries them as they are
    assert agreements[1].fallbacks == (2 if dtype == torch.float32 else 0)


def test_a_backward_under_no_sync_carries_nothing_and_a_second_hook_is_refused(group):
    model = DistributedDataParallel(nn.Linear(3, 2))
    fused = FusedAgreement(model)
    fused.stage(torch.tensor([3.0]))
    with model.no_sync():
        model(torch.randn(2, 3)).sum().backward()
    assert fused.result() is None
    model(torch.randn(2, 3)).sum().backward()
    assert fused.result() == [3.0]
    with pytest.raises(ConfigError, match="already has a communication hook"):
        FusedAgreement(model)
    with pytest.raises(ConfigError, match="1-D"):
        fused.stage(torch.zeros(2, 2))
