"""The update engine: accumulation windows, skipped windows, the order at a window's end,
several optimizers, custom steps reporting their commits, and stopping at an update.

Expected values come from plain torch reference code written here, never from a
previous run of the trainer.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nnx_es.runtime.recording
from nnx_es import Callback, Objective, Scheduler, Trainer, load_result
from nnx_es.errors import NoUpdateError
from nnx_es.lifecycle import IllegalTransitionError
from trainkit import batches, kinds, loaders, of_kind, params_of, small_net

LR = 0.1


def _sgd_reference(net: nn.Module, data: list[tuple[torch.Tensor, ...]], loss_of=None) -> torch.Tensor:
    """One SGD step (lr LR) of ``net`` on the mean loss over every unmasked row of ``data``; returns the loss."""
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    if len(data[0]) == 3:
        keep = torch.cat([b[2] for b in data]) != 0
        x, y = x[keep], y[keep]
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    out = net(x)
    loss = F.cross_entropy(out, y) if loss_of is None else loss_of(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _trainer(tmp_path: Path, net: nn.Module, run_id: str = "r", opt=None, loss=None, **kw) -> Trainer:
    opt = opt if opt is not None else torch.optim.SGD(net.parameters(), lr=LR)
    return Trainer(net, opt, loss if loss is not None else nn.CrossEntropyLoss(),
                   runs_root=tmp_path / "runs", run_id=run_id, progress=False, **kw)


def _assert_params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), k


# --- 1. accumulation equals one big batch -------------------------------------------------


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked_rows"])
def test_three_unequal_microbatches_accumulate_to_the_mean_over_the_window(tmp_path, masked):
    masks = {0: [1, 0, 1, 1, 0], 1: [0, 1, 1, 1, 1, 1, 0], 2: [1, 0]} if masked else None
    data = batches([5, 7, 2], seed=3, masks=masks)
    net = small_net(1)
    ref = copy.deepcopy(net)
    ref_loss = _sgd_reference(ref, data)
    initial = params_of(net)

    run = _trainer(tmp_path, net, accumulation=3, sample_weights=masked).fit(data, None, epochs=1)

    assert run.status == "completed"
    _assert_params_equal(params_of(net), params_of(ref))
    assert any(not torch.equal(initial[k], params_of(net)[k]) for k in initial)  # it did train
    (receipt,) = of_kind(run.run_dir, "update_committed")
    valid = 9.0 if masked else 14.0  # rows with weight 1: 3 + 5 + 1, or all 14
    assert receipt.microbatches == 3 and receipt.local_examples == valid
    assert receipt.loss == pytest.approx(float(ref_loss), abs=1e-6)
    assert [m.examples for m in of_kind(run.run_dir, "microbatch_done")] == ([3.0, 5.0, 1.0] if masked else [5.0, 7.0, 2.0])


def test_fractional_row_weights_give_the_weighted_mean_over_the_window(tmp_path):
    weights = {0: [0.5, 1.0, 2.0, 0.25, 1.0], 1: [1.0, 0.0, 3.0, 0.5, 0.5, 1.0, 1.0], 2: [0.75, 1.5]}
    data = batches([5, 7, 2], seed=7, masks=weights)
    net = small_net(13)
    ref = copy.deepcopy(net)
    x, y, w = (torch.cat([b[i] for b in data]) for i in range(3))
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    loss = (w * F.cross_entropy(ref(x), y, reduction="none")).sum() / w.sum()  # sum w_i l_i / sum w_i
    loss.backward()
    opt.step()

    run = _trainer(tmp_path, net, accumulation=3, sample_weights=True).fit(data, None, epochs=1)

    _assert_params_equal(params_of(net), params_of(ref))
    (receipt,) = of_kind(run.run_dir, "update_committed")
    assert receipt.local_examples == pytest.approx(14.0)  # 4.75 + 7.0 + 2.25
    assert receipt.loss == pytest.approx(loss.item(), abs=1e-6)


def test_masked_rows_with_missing_targets_do_not_poison_the_update(tmp_path):
    # regression targets with missing labels (NaN) on exactly the masked rows
    data = []
    for i, (x, _y) in enumerate(batches([5, 7, 2], seed=11)):
        y = torch.linspace(-1, 1, 3 * len(x)).reshape(len(x), 3) + i
        w = torch.ones(len(x))
        w[0] = 0.0
        y[0] = float("nan")
        data.append((x, y, w))
    net = small_net(12)
    ref = copy.deepcopy(net)
    # a row's loss is the mean of its 3 squared errors: torch's MSELoss() on the unmasked rows
    _sgd_reference(ref, data, loss_of=lambda o, y: (o - y).pow(2).mean(dim=1).mean())

    run = _trainer(tmp_path, net, loss=nn.MSELoss(), accumulation=3, sample_weights=True).fit(data, None, epochs=1)

    assert of_kind(run.run_dir, "update_skipped") == []
    (receipt,) = of_kind(run.run_dir, "update_committed")
    assert receipt.local_examples == 11.0
    _assert_params_equal(params_of(net), params_of(ref))


# --- 2. a composed objective --------------------------------------------------------------


def _l2_per_row(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean(dim=1)


def test_composed_objective_reports_each_term_per_microbatch_epoch_and_validation(tmp_path):
    data = batches([4, 6, 5], seed=5)
    val = batches([7], seed=9)
    net = small_net(2)
    ref = copy.deepcopy(net)
    # reference per-microbatch term means with the initial weights (one window: no step in between)
    with torch.no_grad():
        ref_terms = [(float(F.cross_entropy(ref(x), y)), float(_l2_per_row(ref(x), y).mean())) for x, y in data]
        xa, ya = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
        ref_ce, ref_l2 = float(F.cross_entropy(ref(xa), ya)), float(_l2_per_row(ref(xa), ya).mean())
    _sgd_reference(ref, data, loss_of=lambda o, y: F.cross_entropy(o, y) + 0.5 * _l2_per_row(o, y).mean())
    with torch.no_grad():
        xv, yv = val[0]
        ref_val_ce, ref_val_l2 = float(F.cross_entropy(ref(xv), yv)), float(_l2_per_row(ref(xv), yv).mean())

    objective = Objective({"ce": nn.CrossEntropyLoss(), "l2": (_l2_per_row, 0.5)})
    run = _trainer(tmp_path, net, loss=objective, accumulation=3).fit(data, val, epochs=1)

    mbs = of_kind(run.run_dir, "microbatch_done")
    assert [set(m.terms) for m in mbs] == [{"ce", "l2"}] * 3
    for m, (ce, l2) in zip(mbs, ref_terms, strict=True):
        assert m.terms["ce"] == pytest.approx(ce, abs=1e-6)
        assert m.terms["l2"] == pytest.approx(l2, abs=1e-6)
        assert m.loss == pytest.approx(ce + 0.5 * l2, abs=1e-6)
    (summary,) = of_kind(run.run_dir, "epoch_summarized")
    assert summary.metrics["ce"] == pytest.approx(ref_ce, abs=1e-6)
    assert summary.metrics["l2"] == pytest.approx(ref_l2, abs=1e-6)
    assert summary.metrics["loss"] == pytest.approx(ref_ce + 0.5 * ref_l2, abs=1e-6)
    (validation,) = of_kind(run.run_dir, "validation_done")
    assert validation.metrics["val_ce"] == pytest.approx(ref_val_ce, abs=1e-6)
    assert validation.metrics["val_l2"] == pytest.approx(ref_val_l2, abs=1e-6)
    assert validation.metrics["val_loss"] == pytest.approx(ref_val_ce + 0.5 * ref_val_l2, abs=1e-6)


# --- 3./4. windows that commit nothing ----------------------------------------------------


class _Snapshots(Callback):
    """Parameters after every microbatch (and its update)."""

    def __init__(self) -> None:
        self.after: list[dict[str, torch.Tensor]] = []

    def on_batch_end(self, ctx):
        self.after.append(params_of(ctx.net))


def _spy_step(opt: torch.optim.Optimizer, calls: list[int], trainer: Trainer) -> None:
    """Record the batch index of every ``opt.step()`` call."""
    original = opt.step  # keep the scheduler's step-tracking wrapper

    @functools.wraps(original)
    def step(*args, **kwargs):
        calls.append(trainer.ctx.batch_index)
        return original(*args, **kwargs)

    opt.step = step


@pytest.mark.parametrize(
    ("reason", "data"),
    [
        ("masked", batches([4, 4, 4, 4], seed=1, masks={1: [0.0, 0.0, 0.0, 0.0]})),
        ("nonfinite", batches([4, 4, 4, 4], seed=1, nan_at=(1,))),
    ],
)
def test_a_window_without_a_valid_update_changes_nothing_and_training_goes_on(tmp_path, reason, data):
    net = small_net(4)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    snaps = _Snapshots()
    trainer = _trainer(tmp_path, net, opt=opt, callbacks=[snaps], sample_weights=True,
                       schedulers=[Scheduler(sched, clock="optimizer_update", name="decay")])
    calls: list[int] = []
    _spy_step(opt, calls, trainer)
    initial = params_of(net)

    run = trainer.fit(data, None, epochs=1)

    assert run.status == "completed"
    assert calls == [0, 2, 3]  # no optimizer step in the skipped window (batch 1)
    _assert_params_equal(snaps.after[1], snaps.after[0], atol=0.0)
    assert any(not torch.equal(initial[k], snaps.after[0][k]) for k in initial)
    assert all(torch.isfinite(v).all() for v in snaps.after[3].values())
    assert [(s.reason, s.step) for s in of_kind(run.run_dir, "update_skipped")] == [(reason, 1)]
    assert [r.step for r in of_kind(run.run_dir, "update_committed")] == [1, 2, 3]
    stepped = of_kind(run.run_dir, "scheduler_stepped")
    assert [s.step for s in stepped] == [1, 2, 3] and sched.last_epoch == 3
    window = kinds(run.run_dir)
    i = window.index("update_skipped")
    assert window[i - 1:i + 2] == ["microbatch_done", "update_skipped", "microbatch_done"]
    # the later windows train on the lr the scheduler reached: 0.1 * 0.5**(committed updates before)
    assert [r.lrs for r in of_kind(run.run_dir, "update_committed")] == [[0.1], [0.05], [0.025]]


# --- 5. the order at a window's end -------------------------------------------------------


def test_window_end_order_unscale_clip_step_receipt_callbacks_then_scheduler(tmp_path, monkeypatch):
    order: list[str] = []
    norms: list[float] = []
    net = small_net(6)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    class Watch(Callback):
        def on_optimizer_update(self, ctx, receipt):
            order.append("on_optimizer_update")

    real_unscale = torch.amp.GradScaler.unscale_
    real_clip = torch.nn.utils.clip_grads_with_norm_
    real_emit = nnx_es.runtime.recording.Recorder.emit

    def unscale(self, optimizer):
        order.append("unscale")
        return real_unscale(self, optimizer)

    def grad_norm(params) -> float:
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params
                                                            if p.grad is not None])))

    def clip(parameters, max_norm, total_norm, *a, **k):
        params = list(parameters)
        order.append("clip")
        norms.append(grad_norm(params))  # the unscaled window gradient, before clipping
        out = real_clip(params, max_norm, total_norm, *a, **k)
        norms.append(grad_norm(params))
        return out

    def emit(self, event):
        order.append(event.KIND)
        return real_emit(self, event)

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", unscale)
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", clip)
    monkeypatch.setattr(nnx_es.runtime.recording.Recorder, "emit", emit)
    real_step = opt.step
    opt.step = functools.wraps(real_step)(lambda *a, **k: (order.append("optimizer.step"), real_step(*a, **k))[1])
    real_sched_step = torch.optim.lr_scheduler.LambdaLR.step

    def sched_step(self, *a, **k):
        order.append("scheduler.step")
        return real_sched_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", sched_step)
    trainer = _trainer(
        tmp_path, net, opt=opt, precision="fp16", clip_grad_norm=1e-3, accumulation=2, callbacks=[Watch()],
        schedulers=[Scheduler(sched, clock="optimizer_update", name="flat")],
    )
    assert trainer.engine.scaler is not None
    trainer.engine.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # no calibration overflow
    run = trainer.fit(batches([4, 4], seed=2), None, epochs=1)

    start = order.index("epoch_began") + 1
    end = order.index("epoch_summarized")
    assert order[start:end] == [
        "microbatch_done", "microbatch_done",
        "unscale", "clip", "optimizer.step", "update_committed", "on_optimizer_update",
        "scheduler.step", "scheduler_stepped",
    ]
    (receipt,) = of_kind(run.run_dir, "update_committed")
    assert receipt.grad_norm == pytest.approx(norms[0], rel=1e-5)
    assert receipt.grad_norm > 1e-3 and receipt.clipped is True and receipt.precision == "fp16"
    assert norms[1] == pytest.approx(1e-3, rel=1e-3)  # clipped to max_norm before the step


# --- 6. several optimizers ----------------------------------------------------------------


def test_on_optimizer_update_sees_every_receipt_of_a_commit_before_any_clock_steps(tmp_path):
    net = small_net(7)
    opt_a = torch.optim.SGD(net[0].parameters(), lr=LR)
    opt_b = torch.optim.SGD(net[2].parameters(), lr=LR)
    sa = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda s: 1.0 / (1 + s))
    sb = torch.optim.lr_scheduler.LambdaLR(opt_b, lambda s: 1.0 / (1 + s))
    seen: list[tuple[str, int, int, int]] = []

    class Watch(Callback):
        def on_optimizer_update(self, ctx, receipt):
            seen.append((receipt.optimizer, receipt.step, sa.last_epoch, sb.last_epoch))

    run = _trainer(
        tmp_path, net, opt={"a": opt_a, "b": opt_b}, callbacks=[Watch()],
        schedulers=[Scheduler(sa, clock="optimizer_update", name="sa"),
                    Scheduler(sb, clock="optimizer_update", name="sb")],
    ).fit(batches([3, 3, 3], seed=4), None, epochs=1)

    assert seen == [(o, k, k - 1, k - 1) for k in (1, 2, 3) for o in ("a", "b")]
    assert sa.last_epoch == sb.last_epoch == 3
    epoch = kinds(run.run_dir)
    window = ["microbatch_done", "update_committed", "update_committed", "scheduler_stepped", "scheduler_stepped"]
    start = epoch.index("epoch_began") + 1
    assert epoch[start:start + 15] == window * 3
    receipts = of_kind(run.run_dir, "update_committed")
    assert [(r.optimizer, r.step) for r in receipts] == [(o, k) for k in (1, 2, 3) for o in ("a", "b")]
    assert load_result(run.run_dir).counters.step == 3


# --- 7. a custom step reports its commits -------------------------------------------------


def _custom_run(tmp_path: Path, run_id: str, report: bool):
    net = small_net(8)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    reports: list[float] = []

    def step(ctx, batch):
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(ctx.net(x), y)
        loss.backward()
        opt.step()
        if report:
            ctx.report_update(loss=loss.item(), examples=float(len(y)))
            reports.append(loss.item())
        return loss.item()

    trainer = _trainer(tmp_path, net, opt=opt, run_id=run_id, trainer_step_fn=step,
                       schedulers=[Scheduler(sched, clock="optimizer_update", name="decay")])
    train, val = loaders(batch_size=16, n_train=48, shuffle=False)
    if report:
        run = trainer.fit(train, val, epochs=2)
    else:  # a run that commits no update never ends "completed"
        with pytest.raises(NoUpdateError, match="report_update"):
            trainer.fit(train, val, epochs=2)
        run = load_result(trainer.run_dir)
    return run, sched, reports


def test_a_custom_step_that_reports_steps_the_update_clock_once_per_report(tmp_path):
    run, sched, reports = _custom_run(tmp_path, "reports", report=True)
    assert run.status == "completed"
    receipts = of_kind(run.run_dir, "update_committed")
    assert len(reports) == 6 and [r.step for r in receipts] == [1, 2, 3, 4, 5, 6]
    assert [r.loss for r in receipts] == pytest.approx(reports)
    assert sched.last_epoch == 6 and [s.steps for s in of_kind(run.run_dir, "scheduler_stepped")] == [1, 2, 3, 4, 5, 6]
    assert run.counters.step == 6
    # the epoch summary is the mean of what the step reported (3 equal microbatches of 16 rows per epoch)
    summaries = of_kind(run.run_dir, "epoch_summarized")
    assert [s.metrics["loss"] for s in summaries] == pytest.approx([sum(reports[:3]) / 3, sum(reports[3:]) / 3])
    assert [s.examples for s in summaries] == [48.0, 48.0]


def test_a_custom_step_that_never_reports_never_steps_the_update_clock(tmp_path):
    run, sched, reports = _custom_run(tmp_path, "silent", report=False)
    assert run.status == "failed" and "committed no optimizer update" in run.error
    assert of_kind(run.run_dir, "update_committed") == []
    assert of_kind(run.run_dir, "scheduler_stepped") == [] and sched.last_epoch == 0
    assert len(of_kind(run.run_dir, "microbatch_done")) == 6 and len(run.history) == 2


def test_a_custom_step_counts_its_microbatches_in_the_epoch_summary(tmp_path):
    run, _, _ = _custom_run(tmp_path, "counted", report=True)
    per_epoch = [sum(1 for m in of_kind(run.run_dir, "microbatch_done") if m.epoch == e) for e in (0, 1)]
    assert per_epoch == [3, 3]
    assert [s.microbatches for s in of_kind(run.run_dir, "epoch_summarized")] == per_epoch


# --- 8. stop at an update boundary --------------------------------------------------------


def test_stop_at_update_stops_after_that_commit_and_keeps_last_at_the_committed_epoch(tmp_path):
    net = small_net(9)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    class StopMidEpoch1(Callback):
        def on_batch_end(self, ctx):
            if ctx.epoch == 1 and ctx.batch_index == 1:
                ctx.stop_at_update()

    train, val = loaders(batch_size=16, n_train=48, shuffle=False)  # 3 microbatches per epoch
    run = _trainer(tmp_path, net, opt=opt, callbacks=[StopMidEpoch1()],
                   schedulers=[Scheduler(sched, clock="optimizer_update", name="flat")]).fit(train, val, epochs=3)

    assert run.status == "stopped"
    events = kinds(run.run_dir)
    epoch1 = events.index("epoch_began", events.index("epoch_began") + 1)
    assert events[epoch1:] == [
        "epoch_began",
        "microbatch_done", "update_committed", "scheduler_stepped",
        "microbatch_done", "update_committed", "scheduler_stepped",
        # the final weights were not validated: the final validation pass scores them (final_validation="auto")
        "stop_requested", "validation_done", "callback_finalized", "run_finalized",
    ]
    assert of_kind(run.run_dir, "validation_done")[-1].trigger == "final"
    (stop,) = of_kind(run.run_dir, "stop_requested")
    assert stop.reason == "update_boundary" and stop.epoch == 1 and stop.step == 5
    lasts = of_kind(run.run_dir, "last_committed")
    assert [(l.epoch, l.final) for l in lasts] == [(-1, False), (0, False)]
    assert run.last is not None and run.last.epoch == 0 and run.last.step == 3
    assert [r.epoch for r in run.history] == [0]


# --- 9. the golden sequence of accumulation with skipped windows --------------------------


def test_accumulation_two_with_a_masked_and_a_nonfinite_window_writes_exactly_this_sequence(tmp_path):
    net = small_net(10)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    data = batches([3, 3, 3, 3, 3, 3], seed=6, masks={2: [0.0] * 3, 3: [0.0] * 3}, nan_at=(4,))
    run = _trainer(tmp_path, net, opt=opt, accumulation=2, sample_weights=True, keep_last=None,
                   schedulers=[Scheduler(sched, clock="optimizer_update", name="decay")]).fit(data, None, epochs=1)

    assert kinds(run.run_dir) == [
        "run_started", "train_began", "checkpoint_stored", "last_committed",
        "epoch_began",
        "microbatch_done", "microbatch_done", "update_committed", "scheduler_stepped",
        "microbatch_done", "microbatch_done", "update_skipped",
        "microbatch_done", "microbatch_done", "update_skipped",
        "epoch_summarized", "history_appended", "checkpoint_stored", "last_committed",
        "last_committed", "run_finalized",  # nothing changed since: the final LAST names the same manifest
    ]
    assert [(s.reason, s.microbatches) for s in of_kind(run.run_dir, "update_skipped")] == [
        ("masked", 2), ("nonfinite", 2)]
    (summary,) = of_kind(run.run_dir, "epoch_summarized")
    assert (summary.microbatches, summary.updates, summary.skipped) == (6, 1, 2)
    assert sched.last_epoch == 1
