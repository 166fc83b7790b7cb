"""A loss with several values per row is reduced by their mean (torch's reduction="mean").

Expected values come from torch's own losses with their default reduction.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import Trainer
from nnx_es.errors import ConfigError
from nnx_es.objective import Objective
from trainkit import of_kind, params_of

torch.set_num_threads(1)


def _regression(n: int = 16, outputs: int = 3, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.randn(n, outputs, generator=g)
    torch.manual_seed(seed)
    return nn.Linear(4, outputs), x, y


def _grads(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in net.named_parameters()}


def test_a_three_output_mse_run_reports_torchs_loss_and_takes_torchs_step(tmp_path):
    net, x, y = _regression()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss = nn.MSELoss()(ref(x), y)
    loss.backward()
    opt.step()

    run = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.MSELoss(), runs_root=tmp_path / "runs",
                  run_id="r", progress=False).fit(DataLoader(TensorDataset(x, y), batch_size=16), epochs=1)

    (receipt,) = of_kind(run.run_dir, "update_committed")
    assert receipt.loss == pytest.approx(loss.item(), rel=1e-6)  # not 3x
    assert all(torch.allclose(v, params_of(ref)[k], atol=1e-7) for k, v in params_of(net).items())


@pytest.mark.parametrize("weighted", [False, True], ids=["fused_sum", "per_row"])
def test_a_three_output_mse_objective_has_torchs_value_and_gradient(weighted):
    net, x, y = _regression(seed=1)
    ref = copy.deepcopy(net)
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()

    parts = Objective(nn.MSELoss())(net(x), y, torch.ones(len(x)) if weighted else None)
    (parts.total / parts.den).backward()

    assert (parts.total / parts.den).item() == pytest.approx(expected.item(), rel=1e-6)
    for k, g in _grads(net).items():
        assert torch.allclose(g, _grads(ref)[k], atol=1e-7), k


def test_a_per_pixel_loss_of_a_custom_function_is_averaged_per_row_and_a_per_row_loss_used_as_is():
    out, y = torch.randn(6, 2, 5), torch.randn(6, 2, 5)
    per_pixel = Objective(lambda o, t: (o - t) ** 2)(out, y)
    assert (per_pixel.total / per_pixel.den).item() == pytest.approx(nn.MSELoss()(out, y).item(), rel=1e-6)
    per_row = Objective(lambda o, t: ((o - t) ** 2).sum(dim=(1, 2)))(out, y)
    assert per_row.total.item() == pytest.approx(((out - y) ** 2).sum().item(), rel=1e-6)


@pytest.mark.parametrize("weighted", [False, True], ids=["fused_sum", "per_row"])
def test_targets_broadcast_across_rows_are_refused_naming_both_shapes(tmp_path, weighted):
    # (8,) targets against (8, 1) outputs: MSELoss broadcasts them to an (8, 8) loss
    net, x, y = _regression(n=8, outputs=1, seed=2)
    y = y.reshape(-1)
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match=(
            r"returned shape \(8, 8\) for outputs of shape \(8, 1\) and targets of shape \(8,\)")):
        Objective(nn.MSELoss())(net(x), y, torch.ones(8) if weighted else None)
    before = params_of(net)
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match=r"y\.view\(-1, 1\)"):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.MSELoss(), runs_root=tmp_path / "runs",
                run_id="r", progress=False).fit(DataLoader(TensorDataset(x, y), batch_size=8), epochs=1)
    assert all(torch.equal(v, params_of(net)[k]) for k, v in before.items())


@pytest.mark.parametrize("loss, named", [
    (lambda: nn.CrossEntropyLoss(reduction="sum"), r"CrossEntropyLoss\(reduction='sum'\)"),
    (lambda: nn.MSELoss(reduction="sum"), r"MSELoss\(reduction='sum'\)"),
    (lambda: nn.KLDivLoss(reduction="batchmean"), r"KLDivLoss\(reduction='batchmean'\)"),
    (lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 5.0, 0.2])), r"CrossEntropyLoss\(weight=\.\.\.\)"),
    (lambda: nn.NLLLoss(weight=torch.tensor([1.0, 5.0, 0.2])), r"NLLLoss\(weight=\.\.\.\)"),
])
def test_a_loss_that_normalises_itself_otherwise_is_refused_instead_of_silently_replaced(loss, named):
    from nnx_es import Objective
    from nnx_es.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        Objective(loss())
