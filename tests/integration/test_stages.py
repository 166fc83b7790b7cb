"""Training stages, stage hooks, and update hooks owning the replacement stages."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnx_es import Callback, ConfigError, Scheduler, Trainer
from nnx_es.checkpoint import verify_checkpoint
from nnx_es.stages import TrainingStage
from nnx_es.storage import BlobStore
from nnx_es.update_hooks import EMA, MixedPrecision, UpdateHook
from trainkit import batches, kinds, loaders, of_kind, params_of, small_net

LR = 0.1
S = TrainingStage


def _trainer(tmp_path: Path, net: nn.Module, opt=None, run_id: str = "r", **kw) -> Trainer:
    opt = opt if opt is not None else torch.optim.SGD(net.parameters(), lr=LR)
    return Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=tmp_path / "runs", run_id=run_id, progress=False, **kw)


def test_training_stage_has_exactly_the_seventeen_stages_in_lifecycle_order():
    assert [s.name for s in TrainingStage] == [
        "BEFORE_TRAINING", "BEFORE_EPOCH", "BEFORE_BATCH", "BEFORE_FORWARD", "AFTER_FORWARD", "BEFORE_LOSS",
        "AFTER_LOSS", "BEFORE_BACKWARD", "DO_BACKWARD", "AFTER_BACKWARD", "BEFORE_OPTIMIZER_STEP",
        "DO_OPTIMIZER_STEP", "AFTER_OPTIMIZER_STEP", "AFTER_BATCH", "AFTER_EPOCH", "AFTER_TRAINING",
        "AFTER_VALIDATION",
    ]


# --- observation stages -------------------------------------------------------------------


class StageLog:
    """A stage hook recording (stage, batch_count, step_count, epoch_count, epoch_step_count)."""

    def __init__(self, stage: TrainingStage, log: list, frequency: int = 1) -> None:
        self.stage, self.frequency, self.log = stage, frequency, log
        self.checks: list[bool] = []

    def __call__(self, ctx, stage):
        assert stage is self.stage
        self.log.append((stage.name, ctx.batch_count, ctx.step_count, ctx.epoch_count, ctx.epoch_step_count))
        with torch.no_grad():
            if stage is S.AFTER_FORWARD:  # the predictions are the net's outputs on this batch
                self.checks.append(torch.allclose(ctx.predictions, ctx.net(ctx.batch[0])))
            elif stage is S.AFTER_LOSS:  # the loss is this microbatch's mean loss
                self.checks.append(abs(ctx.loss - float(F.cross_entropy(ctx.predictions, ctx.batch[1]))) < 1e-6)
            elif stage is S.AFTER_VALIDATION:
                self.checks.append(dict(ctx.validation))


OBSERVATION = [s for s in TrainingStage if s not in (S.DO_BACKWARD, S.DO_OPTIMIZER_STEP)]


def test_stage_hooks_run_in_lifecycle_order_and_see_consistent_counters(tmp_path):
    log: list[tuple] = []
    hooks = {s: StageLog(s, log) for s in OBSERVATION}
    every_other: list[tuple] = []
    net = small_net(0)
    train, val = loaders(batch_size=24, n_train=48, shuffle=False)  # 2 microbatches per epoch
    run = _trainer(tmp_path, net, hooks=[*hooks.values(), StageLog(S.AFTER_BATCH, every_other, frequency=2),
                                         StageLog(S.BEFORE_FORWARD, every_other, frequency=3)]).fit(
        train, val, epochs=2)

    # counters: a microbatch counts once its forward+backward is recorded (before the window closes);
    # a step counts once its update committed; an epoch once it is summarized (before AFTER_EPOCH).
    def microbatch(b: int, s: int, e: int, es: int) -> list[tuple]:
        before = (b, s, e, es)
        return [
            ("BEFORE_BATCH", *before), ("BEFORE_FORWARD", *before), ("AFTER_FORWARD", *before),
            ("BEFORE_LOSS", *before), ("AFTER_LOSS", *before), ("BEFORE_BACKWARD", *before),
            ("AFTER_BACKWARD", *before),
            ("BEFORE_OPTIMIZER_STEP", b + 1, s, e, es + 1), ("AFTER_OPTIMIZER_STEP", b + 1, s + 1, e, es + 1),
            ("AFTER_BATCH", b + 1, s + 1, e, es + 1),
        ]

    expected = (
        [("BEFORE_TRAINING", 0, 0, 0, 0), ("BEFORE_EPOCH", 0, 0, 0, 0)]
        + microbatch(0, 0, 0, 0) + microbatch(1, 1, 0, 1)
        + [("AFTER_VALIDATION", 2, 2, 0, 2), ("AFTER_EPOCH", 2, 2, 1, 2), ("BEFORE_EPOCH", 2, 2, 1, 0)]
        + microbatch(2, 2, 1, 0) + microbatch(3, 3, 1, 1)
        + [("AFTER_VALIDATION", 4, 4, 1, 2), ("AFTER_EPOCH", 4, 4, 2, 2), ("AFTER_TRAINING", 4, 4, 2, 2)]
    )
    assert log == expected
    # frequency N: every N-th arrival at the stage (AFTER_BATCH arrivals 2, 4; BEFORE_FORWARD arrival 3)
    assert every_other == [("AFTER_BATCH", 2, 2, 0, 2), ("BEFORE_FORWARD", 2, 2, 1, 0), ("AFTER_BATCH", 4, 4, 1, 2)]
    assert hooks[S.AFTER_FORWARD].checks == [True] * 4
    assert hooks[S.AFTER_LOSS].checks == [True] * 4
    assert hooks[S.AFTER_VALIDATION].checks == [v.metrics for v in of_kind(run.run_dir, "validation_done")]


# --- ownership of the replacement stages --------------------------------------------------


class OwnBackwardA(UpdateHook):
    owns = frozenset({S.DO_BACKWARD})


class OwnBackwardB(UpdateHook):
    owns = frozenset({S.DO_BACKWARD})


def test_two_owners_of_a_replacement_stage_are_refused_at_construction(tmp_path):
    with pytest.raises(ConfigError, match="DO_BACKWARD.*OwnBackwardA.*OwnBackwardB"):
        _trainer(tmp_path, small_net(), hooks=[OwnBackwardA(), OwnBackwardB()])
    with pytest.raises(ConfigError, match="has two owners: MixedPrecision and MixedPrecision"):
        _trainer(tmp_path, small_net(), hooks=[MixedPrecision("fp16"), MixedPrecision("fp16")])
    with pytest.raises(ConfigError, match="precision='fp16' and a MixedPrecision hook"):
        _trainer(tmp_path, small_net(), hooks=[MixedPrecision("fp16")], precision="fp16")

    class StageHookOnBackward:
        stage = S.DO_BACKWARD
        frequency = 1

        def __call__(self, ctx, stage):
            pass

    with pytest.raises(ConfigError, match="DO_BACKWARD"):
        _trainer(tmp_path, small_net(), hooks=[StageHookOnBackward()])
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


class VetoEveryOther(UpdateHook):
    def __init__(self) -> None:
        self.windows = 0

    def veto(self, ctx):
        self.windows += 1
        return self.windows % 2 == 0


class Snapshots(Callback):
    def __init__(self) -> None:
        self.after: list[dict[str, torch.Tensor]] = []

    def on_batch_end(self, ctx):
        self.after.append(params_of(ctx.net))


def test_an_update_hook_veto_skips_the_update_and_the_update_clock(tmp_path):
    net = small_net(1)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    snaps = Snapshots()
    initial = params_of(net)
    run = _trainer(tmp_path, net, opt, hooks=[VetoEveryOther()], callbacks=[snaps],
                   schedulers=[Scheduler(sched, clock="optimizer_update", name="decay")]).fit(
        batches([3] * 6, seed=1), None, epochs=1)

    skipped = of_kind(run.run_dir, "update_skipped")
    assert [(s.reason, s.step) for s in skipped] == [("vetoed", 1), ("vetoed", 2), ("vetoed", 3)]
    assert [r.step for r in of_kind(run.run_dir, "update_committed")] == [1, 2, 3]
    before = [initial] + snaps.after[:-1]
    for i in range(6):
        changed = any(not torch.equal(before[i][k], snaps.after[i][k]) for k in initial)
        assert changed == (i % 2 == 0), i  # windows 1, 3, 5 (0-based) were vetoed
    assert sched.last_epoch == 3 and [s.step for s in of_kind(run.run_dir, "scheduler_stepped")] == [1, 2, 3]
    assert [r.lrs[0] for r in of_kind(run.run_dir, "update_committed")] == pytest.approx([0.1, 0.05, 0.025])


class DoubleBackward(UpdateHook):
    owns = frozenset({S.DO_BACKWARD})

    def __init__(self) -> None:
        self.calls = 0

    def backward(self, ctx, total):
        self.calls += 1
        (2 * total).backward()


def test_a_custom_backward_owner_replaces_the_default_backward(tmp_path):
    data = batches([6], seed=2)
    net = small_net(2)
    ref = copy.deepcopy(net)
    owner = DoubleBackward()
    _trainer(tmp_path, net, hooks=[owner]).fit(data, None, epochs=1)

    x, y = data[0]
    loss = F.cross_entropy(ref(x), y)
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    with torch.no_grad():
        for p, g in zip(ref.parameters(), grads, strict=True):
            p -= LR * 2 * g  # the gradient of 2 * mean loss
    assert owner.calls == 1
    for (k, a), b in zip(net.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), k


# --- built-in update hooks ----------------------------------------------------------------


class AfterStepSnapshots:
    stage = S.AFTER_OPTIMIZER_STEP
    frequency = 1

    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []

    def __call__(self, ctx, stage):
        self.params.append(params_of(ctx.net))


def test_ema_validates_the_averaged_weights_and_is_checkpointed(tmp_path):
    net = small_net(3)
    snaps = AfterStepSnapshots()
    train = batches([8, 8, 8], seed=3)
    val = batches([12], seed=4)
    run = _trainer(tmp_path, net, hooks=[EMA(decay=0.5), snaps]).fit(train, val, epochs=1)

    # torch.optim.swa_utils.AveragedModel with an EMA avg fn: the first update copies the weights,
    # then ema <- 0.5 * ema + 0.5 * weights after each committed update
    assert len(snaps.params) == 3
    ema = dict(snaps.params[0])
    for p in snaps.params[1:]:
        ema = {k: 0.5 * ema[k] + 0.5 * p[k] for k in ema}
    averaged = copy.deepcopy(net)
    averaged.load_state_dict(ema)
    x, y = val[0]
    with torch.no_grad():
        ema_loss = float(F.cross_entropy(averaged(x), y))
        raw_loss = float(F.cross_entropy(net(x), y))
    (validation,) = of_kind(run.run_dir, "validation_done")
    assert validation.metrics["val_loss"] == pytest.approx(ema_loss, abs=1e-6)
    assert abs(ema_loss - raw_loss) > 1e-4  # the check would notice the raw weights
    store = BlobStore(Path(run.run_dir) / "blobs")
    manifest = verify_checkpoint(store, run.last.manifest)
    assert "update_hook/EMA" in manifest.components


def test_bf16_autocast_runs_and_receipts_record_the_precision(tmp_path):
    dtypes: list[torch.dtype] = []

    class Dtype:
        stage = S.AFTER_FORWARD
        frequency = 1

        def __call__(self, ctx, stage):
            dtypes.append(ctx.predictions.dtype)

    run = _trainer(tmp_path, small_net(4), precision="bf16", hooks=[Dtype()], track_grad_norm=True).fit(
        *loaders(batch_size=16, n_train=32), epochs=1)
    assert run.status == "completed"
    assert dtypes == [torch.bfloat16, torch.bfloat16]
    receipts = of_kind(run.run_dir, "update_committed")
    assert [r.precision for r in receipts] == ["bf16", "bf16"]
    assert all(r.grad_norm is not None and r.grad_norm > 0 for r in receipts)


def test_step_cadence_validation_runs_every_n_updates_and_makes_no_monitor_decision(tmp_path):
    net = small_net(5)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    train, val = loaders(batch_size=16, n_train=48, shuffle=False)  # 3 updates per epoch
    run = _trainer(tmp_path, net, opt, monitor="val_loss", validate_every_steps=2,
                   schedulers=[Scheduler(plateau, name="plateau")]).fit(train, val, epochs=2)

    validations = of_kind(run.run_dir, "validation_done")
    # steps 2, 4, 6 (cadence) and the epoch ends at steps 3 and 6
    assert [(v.epoch, v.step) for v in validations] == [(0, 2), (0, 3), (1, 4), (1, 6), (1, 6)]
    seq = kinds(run.run_dir)
    cadence = [i for i, k in enumerate(seq) if k == "validation_done"]
    assert [seq[i - 1] for i in cadence] == [
        "update_committed", "update_committed", "update_committed", "update_committed", "validation_done"]
    decisions = of_kind(run.run_dir, "monitor_decided")
    assert [d.epoch for d in decisions] == [0, 1]
    # each decision is made on the epoch-end validation, not on a cadence one
    assert [d.value for d in decisions] == [validations[1].metrics["val_loss"], validations[4].metrics["val_loss"]]
    assert validations[0].metrics["val_loss"] != validations[1].metrics["val_loss"]
    assert [s.epoch for s in of_kind(run.run_dir, "scheduler_stepped")] == [0, 1]
    assert [r.val for r in run.history] == [validations[1].metrics, validations[4].metrics]
