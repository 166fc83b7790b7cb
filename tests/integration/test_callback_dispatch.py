"""One rule decides whether a callback implements a hook: a subclass override or an instance attribute."""

from __future__ import annotations

import torch
from torch import nn

from nnx_es import Callback, LambdaCallback, Trainer
from nnx_es.callbacks import HOOKS, CallbackList, implements
from tests.trainkit import loaders, small_net


def test_hooks_assigned_on_a_callback_instance_are_all_called(tmp_path):
    calls: list[tuple[str, int]] = []
    cb = Callback()
    cb.on_epoch_begin = lambda ctx: calls.append(("epoch_begin", ctx.epoch))
    cb.on_epoch_end = lambda ctx: calls.append(("epoch_end", ctx.epoch))
    cb.on_validation_end = lambda ctx, metrics: calls.append(("validation_end", ctx.epoch))
    cb.on_train_end = lambda ctx: calls.append(("train_end", ctx.epoch))
    net = small_net()
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), callbacks=[cb],
                      runs_root=tmp_path, run_id="instance-hooks", progress=False)
    trainer.fit(*loaders(), epochs=2)
    assert calls == [("epoch_begin", 0), ("validation_end", 0), ("epoch_end", 0),
                     ("epoch_begin", 1), ("validation_end", 1), ("epoch_end", 1), ("train_end", 1)]


def test_the_hook_names_derive_from_callback_and_one_rule_covers_every_kind_of_callback():
    assert set(HOOKS) == {n for n in dir(Callback) if n.startswith("on_")} and HOOKS[0] == "on_train_begin"

    class Sub(Callback):
        def on_batch_end(self, ctx):
            pass

    inst = Callback()
    inst.on_optimizer_update = lambda ctx, receipt: None
    lam = LambdaCallback(name="lam", on_epoch_end=lambda ctx: None)
    assert [h for h in HOOKS if implements(Sub(), h)] == ["on_batch_end"]
    assert [h for h in HOOKS if implements(inst, h)] == ["on_optimizer_update"]
    assert [h for h in HOOKS if implements(lam, h)] == ["on_epoch_end"]
    listed = CallbackList([Sub(), lam])
    assert listed.has("on_batch_end") and listed.has("on_epoch_end") and not listed.has("on_train_begin")
