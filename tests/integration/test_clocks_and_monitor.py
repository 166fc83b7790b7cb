"""Scheduler clocks and the one monitor decision per epoch.

Designed loss curves (:class:`trainkit.EpochCurve`) make the monitored values
known in advance, so the LR reductions, BEST epochs and the stop epoch are
hand-computed in the tests, not read back from a previous run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from nnx_es import EarlyStopping, Monitor, Scheduler, Trainer, load_result
from nnx_es.checkpoint import load_component, verify_checkpoint
from nnx_es.stages import TrainingStage
from nnx_es.storage import BlobStore
from projections import project
from trainkit import EpochCurve, batches, kinds, loaders, of_kind, params_of, read_events, small_net

LR = 0.1


def _trainer(tmp_path: Path, net: nn.Module, opt, run_id: str = "r", **kw) -> Trainer:
    kw.setdefault("keep_last", None)  # every checkpoint kept: these tests read each one
    return Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=tmp_path / "runs", run_id=run_id, progress=False, **kw)


def _lr_changes(lrs: list[float]) -> list[int]:
    """Indices i (> 0) where lrs[i] < lrs[i-1]."""
    return [i for i in range(1, len(lrs)) if lrs[i] < lrs[i - 1]]


# --- scenario 1: a warmup on the optimizer_update clock -----------------------------------


def test_warmup_on_the_update_clock_with_accumulation_16_steps_10_times_in_160_microbatches(tmp_path):
    net = small_net(0)
    opt = torch.optim.SGD(net.parameters(), lr=LR)

    def warmup(s: int) -> float:  # linear warmup over 20 updates
        return min(1.0, (s + 1) / 20)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    run = _trainer(tmp_path, net, opt, accumulation=16,
                   schedulers=[Scheduler(sched, clock="optimizer_update", name="warmup")]).fit(
        batches([2] * 160, seed=1), None, epochs=1)

    stepped = of_kind(run.run_dir, "scheduler_stepped")
    assert len(of_kind(run.run_dir, "microbatch_done")) == 160
    assert len(stepped) == 10 and sched.last_epoch == 10
    assert [s.step for s in stepped] == list(range(1, 11))
    # after update k the lr is LR * warmup(k); update k itself used LR * warmup(k - 1)
    assert [s.lrs[0] for s in stepped] == pytest.approx([LR * (k + 1) / 20 for k in range(1, 11)])
    receipts = of_kind(run.run_dir, "update_committed")
    assert [r.microbatches for r in receipts] == [16] * 10
    assert [r.lrs[0] for r in receipts] == pytest.approx([LR * k / 20 for k in range(1, 11)])
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 11 / 20)


# --- scenario 2: a step skipped for a non-finite gradient ---------------------------------


class InjectInf:
    """At AFTER_BACKWARD of microbatch ``at`` (0-based, over the run), make one gradient inf."""

    stage = TrainingStage.AFTER_BACKWARD
    frequency = 1

    def __init__(self, at: int) -> None:
        self.at = at
        self.calls = 0
        self.scale_before: float | None = None

    def __call__(self, ctx, stage):
        if self.calls == self.at:
            grad = ctx.net[2].bias.grad
            grad[0] = float("inf")
            scaler = ctx.trainer.engine.scaler
            self.scale_before = scaler.get_scale() if scaler is not None else None
        self.calls += 1


class ScaleAfterBatch:
    stage = TrainingStage.AFTER_BATCH
    frequency = 1

    def __init__(self) -> None:
        self.scales: list[float | None] = []
        self.params: list[dict[str, torch.Tensor]] = []

    def __call__(self, ctx, stage):
        scaler = ctx.trainer.engine.scaler
        self.scales.append(scaler.get_scale() if scaler is not None else None)
        self.params.append(params_of(ctx.net))


@pytest.mark.parametrize("track_grad_norm", [False, True])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_a_step_skipped_for_a_nonfinite_gradient_commits_nothing_and_does_not_advance_the_clock(
        tmp_path, precision, track_grad_norm):
    # the non-finite gradient is caught by the norm when it is computed, else by the fused check
    net = small_net(1)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    inject, after = InjectInf(at=2), ScaleAfterBatch()
    trainer = _trainer(tmp_path, net, opt, precision=precision, accumulation=2, hooks=[inject, after],
                       track_grad_norm=track_grad_norm,
                       schedulers=[Scheduler(sched, clock="optimizer_update", name="decay")])
    if precision == "fp16":
        # a scale that does not overflow this small net's fp16 backward on its own (the default
        # 2**16 would skip the first windows while the scaler calibrates), so the only skip is ours
        assert trainer.engine.scaler is not None
        trainer.engine.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    run = trainer.fit(batches([4] * 6, seed=2), None, epochs=1)

    # windows: (0, 1) commits, (2, 3) has the inf gradient, (4, 5) commits
    assert [(s.reason, s.step) for s in of_kind(run.run_dir, "update_skipped")] == [("nonfinite", 1)]
    receipts = of_kind(run.run_dir, "update_committed")
    assert [(r.step, r.precision) for r in receipts] == [(1, precision), (2, precision)]
    if track_grad_norm:
        assert all(r.grad_norm is not None and 0 < r.grad_norm < float("inf") for r in receipts)
    else:
        assert [r.grad_norm for r in receipts] == [None, None]
    assert sched.last_epoch == 2 and [s.steps for s in of_kind(run.run_dir, "scheduler_stepped")] == [1, 2]
    assert [r.lrs for r in receipts] == [[LR], [LR * 0.5]]  # the skipped window did not advance the clock
    for k, v in after.params[3].items():
        assert torch.equal(v, after.params[1][k]), k
    window = kinds(run.run_dir)
    i = window.index("update_skipped")
    assert window[i - 2:i + 1] == ["microbatch_done", "microbatch_done", "update_skipped"]
    if precision == "fp16":
        # GradScaler: an overflow multiplies the scale by backoff_factor (0.5); growth needs 2000 clean steps
        assert inject.scale_before is not None
        assert after.scales[3] == inject.scale_before * 0.5
        assert after.scales[5] == after.scales[3]
    else:
        assert after.scales == [None] * 6


# --- epoch clock after the decision --------------------------------------------------------


def test_an_epoch_clock_scheduler_steps_once_per_epoch_after_the_monitor_decision(tmp_path):
    net = small_net(2)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    run = _trainer(tmp_path, net, opt, monitor="val_loss", schedulers=[Scheduler(step_lr, name="steplr")]).fit(
        *loaders(batch_size=16, n_train=48), epochs=3)

    events = read_events(run.run_dir)
    for epoch in range(3):
        decided = [s for s, e in events if e.KIND == "monitor_decided" and e.epoch == epoch]
        stepped = [s for s, e in events if e.KIND == "scheduler_stepped" and e.epoch == epoch]
        summarized = [s for s, e in events if e.KIND == "epoch_summarized" and e.epoch == epoch]
        assert len(decided) == 1 and len(stepped) == 1
        assert summarized[0] < decided[0] < stepped[0]
    stepped = of_kind(run.run_dir, "scheduler_stepped")
    assert [s.steps for s in stepped] == [1, 2, 3]
    assert [s.lrs[0] for s in stepped] == pytest.approx([0.05, 0.025, 0.0125])
    # every update of epoch e used LR * 0.5**e
    receipts = of_kind(run.run_dir, "update_committed")
    assert [r.epoch for r in receipts] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r.lrs[0] for r in receipts] == pytest.approx([0.1] * 3 + [0.05] * 3 + [0.025] * 3)


# --- the scheduler projection equals the live state at every commit ------------------------


def test_the_scheduler_projection_equals_the_live_scheduler_state_stored_at_every_commit(tmp_path):
    net = small_net(3)
    opt_a = torch.optim.SGD(net[0].parameters(), lr=LR)
    opt_b = torch.optim.SGD(net[2].parameters(), lr=LR)
    warm = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda s: min(1.0, (s + 1) / 4))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt_b, patience=0, factor=0.5)
    curve = EpochCurve([1.0, 1.1, 0.9, 0.95, 0.97])
    trainer = _trainer(
        tmp_path, net, {"a": opt_a, "b": opt_b}, monitor="val_loss", eval_step_fn=curve,
        schedulers=[Scheduler(warm, clock="optimizer_update", name="warm"), Scheduler(plateau, name="plateau")],
    )
    curve.trainer = trainer
    run = trainer.fit(*loaders(batch_size=16, n_train=48), epochs=5)

    events = read_events(run.run_dir)
    store = BlobStore(Path(run.run_dir) / "blobs")
    lasts = [i for i, (_, e) in enumerate(events) if e.KIND == "last_committed"]
    assert len(lasts) == 1 + 5 + 1
    seen_reduction = False
    for i in lasts:
        last = events[i][1]
        projected = project(events[: i + 1]).schedulers.by_name
        manifest = verify_checkpoint(store, last.manifest)
        summary = load_component(store, manifest, "schedulers")
        for name in ("warm", "plateau"):
            live = load_component(store, manifest, f"scheduler/{name}")
            p = projected[name]
            assert p.steps == summary[name]["steps"] == live["steps"] == live["scheduler"]["last_epoch"], (name, i)
            if p.steps == 0:
                continue  # nothing stepped yet: the projection has no lrs to compare
            assert p.lrs == pytest.approx(summary[name]["lrs"])
            assert p.lrs == pytest.approx(live["scheduler"]["_last_lr"])
            if name == "plateau":
                state = live["scheduler"]
                assert (p.plateau.best, p.plateau.num_bad_epochs, p.plateau.cooldown_counter) == (
                    state["best"], state["num_bad_epochs"], state["cooldown_counter"])
                assert summary[name]["plateau"] == {"best": state["best"], "num_bad_epochs": state["num_bad_epochs"],
                                                    "cooldown_counter": state["cooldown_counter"]}
                seen_reduction |= p.lrs[0] < LR
            else:
                assert p.plateau is None and summary[name]["plateau"] is None
    assert seen_reduction  # the curve made the plateau scheduler reduce (epochs 1 and 3)
    # per epoch commit: epoch-clock steps == epochs so far; update-clock steps == updates so far (3 per epoch)
    for i in lasts[1:-1]:
        last = events[i][1]
        p = project(events[: i + 1]).schedulers.by_name
        assert p["plateau"].steps == last.epoch + 1 and p["warm"].steps == 3 * (last.epoch + 1)


# --- validation every n epochs ------------------------------------------------------------


def test_epochs_without_validation_make_no_decision_and_the_plateau_scheduler_waits(tmp_path):
    net = small_net(4)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    run = _trainer(tmp_path, net, opt, monitor=Monitor("val_loss"), validate_every=2,
                   schedulers=[Scheduler(plateau, name="plateau")], callbacks=[EarlyStopping(patience=5)]).fit(
        *loaders(batch_size=16, n_train=48), epochs=5)

    assert run.status == "completed"
    validated = [1, 3, 4]  # (epoch + 1) % 2 == 0, and the last epoch
    assert [v.epoch for v in of_kind(run.run_dir, "validation_done")] == validated
    assert [d.epoch for d in of_kind(run.run_dir, "monitor_decided")] == validated
    assert [s.epoch for s in of_kind(run.run_dir, "scheduler_stepped")] == validated
    assert plateau.last_epoch == 3
    history = run.history
    assert [r.epoch for r in history] == [0, 1, 2, 3, 4]
    assert [(r.val == {}, r.monitor_value is None) for r in history] == [
        (True, True), (False, False), (True, True), (False, False), (False, False)]
    assert {b.epoch for b in of_kind(run.run_dir, "best_committed")} <= set(validated)


# --- scenario 3: EarlyStopping's state in epoch k's checkpoint ------------------------------


def test_early_stopping_state_in_epoch_k_checkpoint_is_epoch_k_decision(tmp_path):
    net = small_net(5)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    # decisions: 1.0 best | 1.1 bad 1 | 0.9 best | 0.95 bad 1 | 0.97 bad 2 | 0.99 bad 3 -> stop at epoch 5
    curve = EpochCurve([1.0, 1.1, 0.9, 0.95, 0.97, 0.99, 0.5, 0.5])
    trainer = _trainer(tmp_path, net, opt, monitor="val_loss", eval_step_fn=curve,
                       callbacks=[EarlyStopping(patience=3)])
    curve.trainer = trainer
    run = trainer.fit(*loaders(batch_size=16, n_train=48), epochs=8)

    assert run.status == "stopped"
    expected_bad = [0, 1, 0, 1, 2, 3]
    decisions = of_kind(run.run_dir, "monitor_decided")
    assert [d.bad_epochs for d in decisions] == expected_bad
    store = BlobStore(Path(run.run_dir) / "blobs")
    per_epoch = [e for e in of_kind(run.run_dir, "last_committed") if e.epoch >= 0 and not e.final]
    assert [e.epoch for e in per_epoch] == list(range(6))
    for last, bad in zip(per_epoch, expected_bad, strict=True):
        state = load_component(store, verify_checkpoint(store, last.manifest), "callback/EarlyStopping")
        assert state["decision_epoch"] == last.epoch
        assert state["bad_epochs"] == bad
        assert state["stopped_epoch"] == (5 if last.epoch == 5 else None)


# --- scenario 4: a metric known per step and per epoch -------------------------------------


def test_a_train_loss_monitor_decides_on_the_epoch_value_not_the_last_receipt(tmp_path):
    net = small_net(6)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    # two equal microbatches per epoch with designed losses (first, last):
    #   epoch  (a, b)        epoch mean  improved?   | last receipt b  improved?
    #   0      (1.0, 1.0)    1.0         yes         | 1.0             yes
    #   1      (0.5, 1.2)    0.85        yes         | 1.2             no
    #   2      (1.2, 0.6)    0.9         no (bad 1)  | 0.6             yes
    #   3      (0.4, 0.9)    0.65        yes         | 0.9             no
    # ReduceLROnPlateau(patience=0, factor=0.5) on the epoch mean reduces at epoch 2 only
    # (on the last receipt it would reduce at epochs 1 and 3); BEST epochs 0, 1, 3.
    curve = EpochCurve([(1.0, 1.0), (0.5, 1.2), (1.2, 0.6), (0.4, 0.9)])
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    trainer = _trainer(tmp_path, net, opt, monitor=Monitor("loss"), train_step_fn=curve,
                       schedulers=[Scheduler(plateau, name="plateau")], callbacks=[EarlyStopping(patience=2)])
    curve.trainer = trainer
    run = trainer.fit(batches([4, 4], seed=3), None, epochs=4)

    summaries = of_kind(run.run_dir, "epoch_summarized")
    decisions = of_kind(run.run_dir, "monitor_decided")
    assert [s.metrics["loss"] for s in summaries] == pytest.approx([1.0, 0.85, 0.9, 0.65], abs=1e-6)
    assert [d.value for d in decisions] == [s.metrics["loss"] for s in summaries]
    last_receipts = [r.loss for r in of_kind(run.run_dir, "update_committed")][1::2]
    assert last_receipts == pytest.approx([1.0, 1.2, 0.6, 0.9], abs=1e-6)
    assert [d.improved for d in decisions] == [True, True, False, True]
    assert [b.epoch for b in of_kind(run.run_dir, "best_committed")] == [0, 1, 3]
    assert [r.lrs["sgd"][0] for r in run.history] == pytest.approx([0.1, 0.1, 0.05, 0.05])
    assert [s.plateau.num_bad_epochs for s in of_kind(run.run_dir, "scheduler_stepped")] == [0, 0, 0, 0]
    assert run.status == "completed" and run.best.epoch == 3


def test_the_plateau_scheduler_follows_the_decision_not_its_own_comparison(tmp_path):
    # Monitor min_delta 0.15; the scheduler's own rule (rel threshold 1e-4) would call every epoch better.
    #   epoch  val   decision (needs < best - 0.15)   plateau(patience=0, factor=0.5)
    #   0      1.0   improved, best 1.0               lr 0.1
    #   1      0.9   no  (0.9 >= 0.85), bad 1         1 > 0 -> reduce: 0.05
    #   2      0.8   improved (0.8 < 0.85), best 0.8  0.05
    #   3      0.7   no  (0.7 >= 0.65), bad 1         reduce: 0.025
    curve = EpochCurve([1.0, 0.9, 0.8, 0.7])
    net = small_net(8)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    trainer = _trainer(tmp_path, net, opt, monitor=Monitor("val_loss", min_delta=0.15), eval_step_fn=curve,
                       schedulers=[Scheduler(plateau, name="plateau")])
    curve.trainer = trainer
    run = trainer.fit(*loaders(batch_size=16, n_train=48), epochs=4)

    assert [d.improved for d in of_kind(run.run_dir, "monitor_decided")] == [True, False, True, False]
    stepped = of_kind(run.run_dir, "scheduler_stepped")
    assert [s.lrs[0] for s in stepped] == pytest.approx([0.1, 0.05, 0.05, 0.025])
    assert [s.plateau.best for s in stepped] == pytest.approx([1.0, 1.0, 0.8, 0.8], abs=1e-6)
    assert [b.epoch for b in of_kind(run.run_dir, "best_committed")] == [0, 2]


# --- scenario 5: a designed validation curve ------------------------------------------------


def test_plateau_best_and_early_stopping_on_a_designed_validation_curve(tmp_path):
    # Hand computation, Monitor("val_loss", min_delta=0), ReduceLROnPlateau(patience=1, factor=0.5),
    # EarlyStopping(patience=3):
    #   epoch  val    improved  best  bad | plateau bad -> reduce?        lr after | ES
    #   0      1.00   yes       1.00  0   | 0                            0.1      |
    #   1      0.80   yes       0.80  0   | 0                            0.1      |
    #   2      0.85   no        0.80  1   | 1                            0.1      |
    #   3      0.90   no        0.80  2   | 2 > 1 -> reduce, reset 0     0.05     |
    #   4      0.70   yes       0.70  0   | 0                            0.05     |
    #   5      0.75   no        0.70  1   | 1                            0.05     |
    #   6      0.76   no        0.70  2   | 2 > 1 -> reduce, reset 0     0.025    |
    #   7      0.77   no        0.70  3   | 1                            0.025    | 3 >= 3: stop
    # LR reduced at epochs 3 and 6; BEST at 0, 1, 4; stop after epoch 7 (epochs 8, 9 never run).
    curve_values = [1.0, 0.8, 0.85, 0.9, 0.7, 0.75, 0.76, 0.77, 0.78, 0.79]
    net = small_net(7)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    curve = EpochCurve(curve_values)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    trainer = _trainer(tmp_path, net, opt, monitor=Monitor("val_loss", min_delta=0.0), eval_step_fn=curve,
                       schedulers=[Scheduler(plateau, name="plateau")], callbacks=[EarlyStopping(patience=3)])
    curve.trainer = trainer
    run = trainer.fit(*loaders(batch_size=16, n_train=48), epochs=10)

    assert [v.metrics["val_loss"] for v in of_kind(run.run_dir, "validation_done")] == pytest.approx(
        curve_values[:8], abs=1e-6)
    stepped = of_kind(run.run_dir, "scheduler_stepped")
    lrs = [LR] + [s.lrs[0] for s in stepped]
    assert [i - 1 for i in _lr_changes(lrs)] == [3, 6]
    assert [s.lrs[0] for s in stepped] == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025])
    assert [b.epoch for b in of_kind(run.run_dir, "best_committed")] == [0, 1, 4]
    (stop,) = of_kind(run.run_dir, "stop_requested")
    assert (stop.epoch, stop.reason) == (7, "early_stopping")
    assert run.status == "stopped" and len(run.history) == 8 and run.best.epoch == 4

    # the three consumers agree with the recorded decisions
    decisions = of_kind(run.run_dir, "monitor_decided")
    assert [d.improved for d in decisions] == [True, True, False, False, True, False, False, False]
    assert [b.epoch for b in of_kind(run.run_dir, "best_committed")] == [d.epoch for d in decisions if d.improved]
    assert stop.epoch == next(d.epoch for d in decisions if d.bad_epochs >= 3)
    bad = 0
    expected_plateau = []
    for d in decisions:  # torch's ReduceLROnPlateau rule, fed the decisions' improved flags
        bad = 0 if d.improved else bad + 1
        reduce = bad > 1
        expected_plateau.append((d.best, 0 if reduce else bad, reduce))
        bad = 0 if reduce else bad
    assert [s.plateau.best for s in stepped] == [b for b, _, _ in expected_plateau]
    assert [s.plateau.num_bad_epochs for s in stepped] == [n for _, n, _ in expected_plateau]
    assert [i - 1 for i in _lr_changes(lrs)] == [i for i, (_, _, r) in enumerate(expected_plateau) if r]
    assert load_result(run.run_dir).best.epoch == 4
