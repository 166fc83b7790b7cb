"""Device placement: ``Trainer(device=...)``, batches moved before their stages, checkpoints that
do not depend on the device. Parametrized over the devices this machine has, so the same tests
run unchanged on an accelerator."""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import pytest
import torch
from torch import nn

from nnx_es import NNModel, Trainer
from nnx_es.data import iterate_batches
from nnx_es.device import available_devices, move_batch, resolve_device
from nnx_es.errors import ConfigError
from nnx_es.stages import TrainingStage
from trainkit import batches, loaders, small_net

DEVICES = available_devices()


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class Frozen:
    inner: dict
    ids: list


class Named(NamedTuple):
    x: torch.Tensor
    meta: tuple


def _devices(obj):
    if isinstance(obj, torch.Tensor):
        return [obj.device.type]
    if isinstance(obj, dict):
        return [d for v in obj.values() for d in _devices(v)]
    if isinstance(obj, (list, tuple)):
        return [d for v in obj for d in _devices(v)]
    if dataclasses.is_dataclass(obj):
        return [d for f in dataclasses.fields(obj) for d in _devices(getattr(obj, f.name))]
    return []


@pytest.mark.parametrize("device", DEVICES)
def test_every_tensor_of_a_nested_batch_is_moved_and_everything_else_kept(device):
    target = resolve_device(device, nn.Linear(1, 1))
    batch = {
        "pair": Pair(torch.ones(2), torch.zeros(2)),
        "frozen": Frozen({"a": torch.ones(1), "n": 3}, [torch.ones(1), "s"]),
        "named": Named(torch.ones(3), (torch.ones(1), 7)),
        "plain": [1, "two", None],
    }
    moved = move_batch(batch, target)
    assert set(_devices(moved)) == {target.type}
    assert isinstance(moved["pair"], Pair) and moved["pair"].note == "kept"
    assert isinstance(moved["frozen"], Frozen) and moved["frozen"].inner["n"] == 3 and moved["frozen"].ids[1] == "s"
    assert isinstance(moved["named"], Named) and moved["named"].meta[1] == 7
    assert moved["plain"] == [1, "two", None]
    assert torch.equal(moved["pair"].x.cpu(), torch.ones(2))
    again = move_batch(moved, target)
    assert again is moved  # already there: nothing copied, nothing rebuilt


def test_a_loader_that_pins_memory_is_moved_without_blocking(monkeypatch):
    calls = []
    real = torch.Tensor.to

    def to(self, *a, **k):
        calls.append(k.get("non_blocking"))
        return real(self, *a, **k)

    class Pinned(list):
        pin_memory = True

    monkeypatch.setattr(torch.Tensor, "to", to)
    meta = torch.device("meta")  # a device every machine has: the copy is not blocking
    out = list(iterate_batches(Pinned([(torch.ones(2), torch.ones(2))]), device=meta))
    assert out[0][0].device == meta and calls == [True, True]
    calls.clear()
    list(iterate_batches([(torch.ones(2), torch.ones(2))], device=meta))
    assert calls == [False, False]


@pytest.mark.parametrize("bad", ["cuda:99", "tpu", "not a device", "mps:3", 3])
def test_a_device_this_machine_does_not_have_is_refused_by_name_before_training(tmp_path, bad):
    if bad == "mps:3" and "mps" not in DEVICES:
        bad = "mps"
    net = small_net(0)
    with pytest.raises(ConfigError, match="device"):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
                progress=False, device=bad)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("device", DEVICES)
def test_the_model_and_each_batch_are_on_the_device_before_the_batch_stages(tmp_path, device):
    seen = []

    class Where:
        stage = TrainingStage.BEFORE_BATCH

        def __call__(self, ctx, stage):
            seen.append(set(_devices(ctx.batch)))

    def step(net, batch: Pair):
        return net(batch.x), batch.y, None

    data = [Pair(x, y) for x, y in batches([4, 4, 4])]
    net = small_net(0)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=tmp_path, run_id="r", progress=False,
                      hooks=[Where()], train_step_fn=step, eval_step_fn=step, device=device)
    target = resolve_device(device, net)
    assert {p.device for p in net.parameters()} == {target}
    run = trainer.fit(data, data, epochs=2)
    assert run.status == "completed" and seen == [{target.type}] * 6
    assert all(s.device == target for st in opt.state.values() for k, s in st.items() if k != "step")


@pytest.mark.parametrize(("trained_on", "resumed_on"), list(itertools.product(DEVICES, DEVICES)))
def test_checkpoints_do_not_depend_on_the_device(tmp_path, trained_on, resumed_on):
    """A run trained on one device resumes on another (stateful and weights_only) and loads anywhere."""
    def trainer(run_id, device):
        net = small_net(1)
        return Trainer(net, torch.optim.Adam(net.parameters(), lr=0.01), nn.CrossEntropyLoss(), runs_root=tmp_path,
                       run_id=run_id, progress=False, device=device, monitor="val_loss")

    train, val = loaders()
    straight = trainer("straight", trained_on).fit(train, val, epochs=3)
    train, val = loaders()
    first = trainer("first", trained_on).fit(train, val, epochs=2)
    train, val = loaders()
    resumer = trainer("first", resumed_on)
    resumed = resumer.fit(train, val, epochs=3, resume_from=first.run_dir)
    assert resumed.status == "completed" and resumed.counters.epoch == 3
    assert {p.device.type for p in resumer.net.parameters()} == {resolve_device(resumed_on, resumer.net).type}
    if trained_on == resumed_on == "cpu":  # the CPU streams are restored exactly: the same run
        assert [h.train for h in resumed.history] == [h.train for h in straight.history]
    train, val = loaders()
    fresh = trainer("fresh", resumed_on).fit(train, val, epochs=1, resume_from=first.run_dir,
                                            resume_mode="weights_only")
    assert fresh.status == "completed"
    model = NNModel(small_net(9))
    assert model.load(first.run_dir, "last") == 2  # the resumed run's LAST
    state = {k: v.cpu() for k, v in resumer.net.state_dict().items()}
    assert set(state) == set(model.net.state_dict())


def test_nnmodel_train_takes_the_device(tmp_path):
    train, val = loaders()
    model = NNModel(small_net(0))
    run = model.train(train, val, epochs=1, runs_root=tmp_path, progress=False, device="cpu")
    assert run.status == "completed" and next(model.net.parameters()).device.type == "cpu"
