"""Targets a loss ignores (``CrossEntropyLoss`` / ``NLLLoss``'s ``ignore_index``) count in no mean.

torch's ``reduction="mean"`` divides by the targets that are not ``ignore_index``; the trainer's
window mean must do the same, or every padded batch trains with a smaller step than the loss
given (silently). Each test compares the run with torch's own loss on the same batches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nnx_es.objective
from nnx_es import Trainer
from nnx_es.objective import Objective
from tests.trainkit import of_kind


@pytest.fixture(autouse=True, params=["host count", "device count"])
def count_where(request, monkeypatch):
    """Every test both ways: ignored CPU targets counted on the host, and on the device as on an
    accelerator (two ops, read with the window's one transfer, W corrected after the read)."""
    monkeypatch.setattr(nnx_es.objective, "HOST_COUNT_ON_CPU", request.param == "host count")
    return request.param

IGNORE = -100


def _data(rows: int = 64, ignore_every: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 5, generator=g)
    y = torch.randint(0, 3, (rows,), generator=g)
    y[::ignore_every] = IGNORE
    return x, y


def _hand(x, y, *, batch, accumulation=1, clip=None, loss=None, steps_from=None):  # noqa: ANN001, ANN202
    """torch's own loop: one mean CE over each window's rows (what the trainer must equal)."""
    torch.manual_seed(1)
    net = nn.Linear(5, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    loss_fn = loss or nn.CrossEntropyLoss()
    losses = []
    window = batch * accumulation
    for i in range(0, len(x), window):
        opt.zero_grad()
        value = loss_fn(net(x[i:i + window]), y[i:i + window])
        value.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        losses.append(value.item())
    return net, losses


def _fit(tmp_path, x, y, *, batch, accumulation=1, clip=None, loss=None, metrics=()):  # noqa: ANN001, ANN202
    torch.manual_seed(1)
    net = nn.Linear(5, 3)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), loss or nn.CrossEntropyLoss(),
                      runs_root=tmp_path, run_id="r", progress=False, accumulation=accumulation, clip_grad_norm=clip,
                      metrics=metrics)
    result = trainer.fit(DataLoader(TensorDataset(x, y), batch_size=batch), epochs=1)
    return net, result


@pytest.mark.parametrize("accumulation,clip", [(1, None), (2, None), (1, 0.05), (2, 0.05)])
def test_the_update_is_torchs_mean_over_the_targets_not_ignored(tmp_path, accumulation, clip):
    x, y = _data()
    net, _ = _fit(tmp_path, x, y, batch=16, accumulation=accumulation, clip=clip)
    ref, losses = _hand(x, y, batch=16, accumulation=accumulation, clip=clip)
    torch.testing.assert_close(net.weight, ref.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(net.bias, ref.bias, rtol=0, atol=1e-6)
    receipts = of_kind(tmp_path / "r", "update_committed")
    assert [r.loss for r in receipts] == pytest.approx(losses, rel=1e-6)
    valid = [(y[i:i + 16 * accumulation] != IGNORE).sum().item() for i in range(0, 64, 16 * accumulation)]
    assert [r.local_examples for r in receipts] == valid == [r.global_examples for r in receipts]
    done = of_kind(tmp_path / "r", "microbatch_done")
    assert [m.examples for m in done] == [(y[i:i + 16] != IGNORE).sum().item() for i in range(0, 64, 16)]
    assert [m.rows for m in done] == [16] * 4  # rows stay the batch's rows


def test_the_epochs_loss_and_accuracy_leave_the_ignored_targets_out(tmp_path):
    x, y = _data()
    net, result = _fit(tmp_path, x, y, batch=64, metrics=("accuracy",))  # one update: the epoch's sums are its rows'
    torch.manual_seed(1)
    before = nn.Linear(5, 3)
    with torch.no_grad():
        logits = before(x)
    keep = y != IGNORE
    record = result.history[-1]
    assert record.train["loss"] == pytest.approx(nn.CrossEntropyLoss()(logits, y).item(), rel=1e-6)
    assert record.train["accuracy"] == pytest.approx((logits.argmax(1)[keep] == y[keep]).float().mean().item())


def test_a_window_whose_every_target_is_ignored_is_skipped_as_masked(tmp_path):
    x, y = _data()
    y[:16] = IGNORE  # the first window: nothing to learn from
    net, _ = _fit(tmp_path, x, y, batch=16)
    skipped = of_kind(tmp_path / "r", "update_skipped")
    assert [(s.reason, s.step) for s in skipped] == [("masked", 0)]
    assert len(of_kind(tmp_path / "r", "update_committed")) == 3
    ref, _ = _hand(x[16:], y[16:], batch=16)
    torch.testing.assert_close(net.weight, ref.weight, rtol=0, atol=1e-6)


def test_per_position_targets_mean_over_the_positions_not_ignored(tmp_path):
    """(B, C, T) logits with (B, T) targets (a sequence labeller with padded positions)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, 6, generator=g)
    y = torch.randint(0, 3, (32, 6), generator=g)
    y[:, 4:] = IGNORE  # padding at the end of every sequence
    y[5, :] = IGNORE  # and a row that is all padding
    y[7, 1:] = IGNORE

    torch.manual_seed(1)
    net = _Tagger()
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="r", progress=False)
    trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8), epochs=1)
    torch.manual_seed(1)
    ref = _Tagger()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = []
    for i in range(0, 32, 8):
        opt.zero_grad()
        loss = nn.CrossEntropyLoss()(ref(x[i:i + 8]), y[i:i + 8])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.testing.assert_close(net.proj.weight, ref.proj.weight, rtol=0, atol=1e-6)
    assert [r.loss for r in of_kind(tmp_path / "r", "update_committed")] == pytest.approx(losses, rel=1e-6)


def test_validation_and_evaluate_mean_over_the_targets_not_ignored(tmp_path):
    x, y = _data()
    vx, vy = _data(seed=5, ignore_every=2)
    torch.manual_seed(1)
    net = nn.Linear(5, 3)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="r", progress=False, metrics=["accuracy"])
    result = trainer.fit(DataLoader(TensorDataset(x, y), batch_size=16),
                         DataLoader(TensorDataset(vx, vy), batch_size=10), epochs=1)
    with torch.no_grad():
        logits = net(vx)
    keep = vy != IGNORE
    val = result.history[-1].val
    assert val["val_loss"] == pytest.approx(nn.CrossEntropyLoss()(logits, vy).item(), rel=1e-6)
    assert val["val_accuracy"] == pytest.approx((logits.argmax(1)[keep] == vy[keep]).float().mean().item())


def test_a_second_term_counts_only_the_rows_the_ignoring_term_keeps(tmp_path):
    """Several terms share one denominator: a row whose target is ignored counts in none of them."""
    x, y = _data()

    def l2(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # a per-row penalty on the logits
        return outputs.pow(2).mean(dim=1)

    objective = Objective({"ce": nn.CrossEntropyLoss(), "l2": (l2, 0.1)})
    net, _ = _fit(tmp_path, x, y, batch=16, loss=objective)

    def both(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        keep = targets != IGNORE
        return nn.CrossEntropyLoss()(outputs, targets) + 0.1 * l2(outputs[keep], targets[keep]).mean()

    ref, _ = _hand(x, y, batch=16, loss=both)
    torch.testing.assert_close(net.weight, ref.weight, rtol=0, atol=1e-6)


def test_weighted_rows_with_ignored_targets_divide_by_the_kept_weight(tmp_path):
    x, y = _data()
    w = torch.linspace(0.5, 2.0, 64)
    torch.manual_seed(1)
    net = nn.Linear(5, 3)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="r", progress=False, sample_weights=True)
    trainer.fit(DataLoader(TensorDataset(x, y, w), batch_size=16), epochs=1)
    torch.manual_seed(1)
    ref = nn.Linear(5, 3)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for i in range(0, 64, 16):
        opt.zero_grad()
        xb, yb, wb = x[i:i + 16], y[i:i + 16], w[i:i + 16]
        keep = yb != IGNORE
        per_row = nn.CrossEntropyLoss(reduction="none")(ref(xb), yb)
        ((per_row * wb)[keep].sum() / wb[keep].sum()).backward()
        opt.step()
    torch.testing.assert_close(net.weight, ref.weight, rtol=0, atol=1e-6)


def test_ctx_loss_read_inside_a_window_is_the_mean_over_the_kept_targets(tmp_path):
    from nnx_es import Callback

    x, y = _data()
    seen: list[float] = []

    class Reader(Callback):
        distributed = "all"

        def on_batch_end(self, ctx) -> None:  # noqa: ANN001
            seen.append(ctx.loss)  # read inside the window on the first microbatch of each

    torch.manual_seed(1)
    net = nn.Linear(5, 3)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="r", progress=False, accumulation=2, callbacks=[Reader()])
    trainer.fit(DataLoader(TensorDataset(x, y), batch_size=16), epochs=1)
    done = of_kind(tmp_path / "r", "microbatch_done")
    assert seen == pytest.approx([m.loss for m in done], rel=1e-6)
    torch.manual_seed(1)
    first = nn.Linear(5, 3)
    assert seen[0] == pytest.approx(nn.CrossEntropyLoss()(first(x[:16]), y[:16]).item(), rel=1e-6)


def _tagger_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 4, 6, generator=g)
    y = torch.randint(0, 3, (16, 6), generator=g)
    y[:, 4:] = IGNORE  # every row keeps 4 of its 6 positions
    y[3, 1:] = IGNORE
    return x, y


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:  # (B, 4, T) -> (B, 3, T)
        return self.proj(seq.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_integer_sample_weights_with_per_position_targets_keep_each_rows_share(tmp_path, dtype):
    """A 0/1 mask given as integers weighs like the same mask as floats: a row's kept share of its
    positions (here 4/6) is not truncated to 0 by the weights' dtype."""
    x, y = _tagger_data()
    w = torch.ones(16, dtype=dtype)
    w[5] = 0
    torch.manual_seed(1)
    net = _Tagger()
    Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), nn.CrossEntropyLoss(), runs_root=tmp_path, run_id="r",
            progress=False, sample_weights=True).fit(DataLoader(TensorDataset(x, y, w), batch_size=8), epochs=1)
    torch.manual_seed(1)
    ref = _Tagger()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for i in range(0, 16, 8):
        opt.zero_grad()
        keep = w[i:i + 8] != 0
        nn.CrossEntropyLoss()(ref(x[i:i + 8][keep]), y[i:i + 8][keep]).backward()
        opt.step()
    torch.testing.assert_close(net.proj.weight, ref.proj.weight, rtol=0, atol=1e-6)
    kept = [float((y[i:i + 8][w[i:i + 8] != 0] != IGNORE).sum()) / 6 for i in range(0, 16, 8)]
    assert [r.local_examples for r in of_kind(tmp_path / "r", "update_committed")] == pytest.approx(kept)


def test_terms_ignoring_different_targets_are_refused():
    """One denominator cannot be two means' (CE ignoring -100 beside CE ignoring 0): refused, naming both."""
    from nnx_es.errors import ConfigError

    with pytest.raises(ConfigError, match=r"ignore_index.*-100.*0|ignore_index.*0.*-100"):
        Objective({"a": nn.CrossEntropyLoss(), "b": nn.CrossEntropyLoss(ignore_index=0)})
    Objective({"a": nn.CrossEntropyLoss(), "b": nn.NLLLoss()})  # the same ignore_index: one mean


def test_a_keyed_term_in_a_several_model_run_means_over_its_targets_not_ignored(tmp_path):
    """Keyed(nn.CrossEntropyLoss()) reads targets["y"] from a mapping: its ignored targets count in no mean."""
    from nnx_es.models import Keyed

    x, y = _data()
    torch.manual_seed(1)
    net = nn.Linear(5, 3)

    def training_fn(models, batch):  # noqa: ANN001, ANN202
        return {"s": models["s"](batch[0])}

    objective = Objective({"ce": Keyed(nn.CrossEntropyLoss(), prediction="s", target="y")})
    Trainer({"s": net}, {"s": torch.optim.SGD(net.parameters(), lr=0.5)}, objective, training_fn=training_fn,
            runs_root=tmp_path, run_id="r", progress=False).fit(DataLoader(TensorDataset(x, y), batch_size=16), epochs=1)
    ref, losses = _hand(x, y, batch=16)
    torch.testing.assert_close(net.weight, ref.weight, rtol=0, atol=1e-6)
    receipts = of_kind(tmp_path / "r", "update_committed")
    assert [r.loss for r in receipts] == pytest.approx(losses, rel=1e-6)
    assert [r.local_examples for r in receipts] == [(y[i:i + 16] != IGNORE).sum().item() for i in range(0, 64, 16)]


def test_a_negative_weight_on_an_ignored_row_is_refused_as_on_any_row():
    from nnx_es.errors import ConfigError

    objective = Objective(nn.CrossEntropyLoss())
    y = torch.tensor([0, IGNORE, 1])
    with pytest.raises(ConfigError, match=r"weight -1.0 at row 1"):
        objective(torch.zeros(3, 3), y, torch.tensor([1.0, -1.0, 1.0]))


@pytest.mark.parametrize("head", [None, "multiclass"])
def test_nnmodel_evaluate_means_over_the_targets_not_ignored(head):
    """model.evaluate(loader) with its default loss (the head's, or the one inferred from the outputs when
    no head is declared) is torch's CrossEntropyLoss mean, accuracy over the kept targets."""
    from nnx_es import NNModel

    x, y = _data()
    torch.manual_seed(1)
    net = nn.Linear(5, 3)
    with torch.no_grad():
        logits = net(x)
    keep = y != IGNORE
    got = NNModel(net, head=head).evaluate(DataLoader(TensorDataset(x, y), batch_size=10))
    assert got["loss"] == pytest.approx(nn.CrossEntropyLoss()(logits, y).item(), rel=1e-6)
    assert got["accuracy"] == pytest.approx((logits.argmax(1)[keep] == y[keep]).float().mean().item())


def test_keyed_terms_of_two_tasks_with_their_own_targets_are_not_refused():
    """Two heads, each a CrossEntropyLoss on its own targets (a multi-task run): trained as before, with a
    warning that their ignored targets count in the shared denominator."""
    from nnx_es.models import Keyed

    with pytest.warns(UserWarning, match=r"read different targets \(ya, yb\)"):
        objective = Objective({"a": Keyed(nn.CrossEntropyLoss(), prediction="a", target="ya"),
                               "b": Keyed(nn.CrossEntropyLoss(ignore_index=0), prediction="b", target="yb")})
    assert objective.ignore == ()
    parts = objective({"a": torch.zeros(4, 3), "b": torch.zeros(4, 3)},
                      {"ya": torch.tensor([0, 1, IGNORE, 2]), "yb": torch.tensor([0, 1, 1, 2])})
    assert parts.den == 4.0 and parts.ignored is None
