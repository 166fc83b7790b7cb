"""The update engine's cheap paths agree with the plain computations they replace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnx_es import Trainer
from nnx_es.objective import Objective
from trainkit import small_net


def _engine(tmp_path):
    net = small_net(0)
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                   runs_root=tmp_path, progress=False).engine


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_fused_finiteness_check_finds_any_nonfinite_value_and_leaves_gradients_unchanged(tmp_path, bad):
    engine = _engine(tmp_path)
    grads = [torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.randn(5)]
    before = [g.clone() for g in grads]
    assert engine.grads.finite(grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, before))
    grads[1][2] = bad
    assert not engine.grads.finite(grads)
    grads[1][2] = 1.0
    assert engine.grads.finite(grads)  # the found flag is reset between windows
    assert engine.grads.finite([])


def test_the_backward_seed_is_one_over_the_denominator_and_follows_its_changes(tmp_path):
    engine = _engine(tmp_path)
    like = torch.zeros((), dtype=torch.float64)
    assert engine._inverse(32.0, like).item() == 1 / 32 and engine._inverse(32.0, like).dtype == torch.float64
    assert engine._inverse(5.0, like).item() == 1 / 5  # a short last microbatch


@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss(), nn.CrossEntropyLoss(label_smoothing=0.1)])
def test_a_single_unweighted_term_reduces_like_the_general_path(loss):
    outputs = torch.randn(6, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)
    targets = torch.tensor([0, 1, 2, 3, 0, 1])
    fast = Objective(loss)(outputs, targets)
    general = Objective({"loss": (loss, 1.0), "zero": (loss, 0.0)})(outputs, targets)
    assert Objective(loss)._single is not None and general.den == fast.den == 6.0
    assert torch.allclose(fast.total, general.total) and set(fast.terms) == {"loss"}
    weighted = Objective({"loss": (loss, 2.0)})
    assert weighted._single is None
    assert torch.allclose(weighted(outputs, targets).total, 2 * fast.total)


def test_lbfgs_is_refused_up_front_and_trains_through_a_custom_step(tmp_path):
    from nnx_es.errors import ConfigError
    from trainkit import loaders

    net = small_net(0)
    opt = torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=4)
    with pytest.raises(ConfigError, match="optimizer 'lbfgs' is LBFGS.*closure.*trainer_step_fn"):
        Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=tmp_path, progress=False)

    loss_fn = nn.CrossEntropyLoss()

    def lbfgs_step(ctx, batch):
        x, y = batch

        def closure():
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            return loss

        loss = float(opt.step(closure).detach())
        ctx.report_update(loss=loss, examples=float(len(y)))
        return loss

    trainer = Trainer(net, opt, loss_fn, runs_root=tmp_path, run_id="lbfgs", progress=False,
                      trainer_step_fn=lbfgs_step)
    run = trainer.fit(*loaders(batch_size=8, n_train=48), epochs=3)
    assert run.status == "completed" and len(run.history) == 3
    assert run.history[-1].train["loss"] < run.history[0].train["loss"]
