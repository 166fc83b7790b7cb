"""The update engine alone: over an in-memory log and recorder, with no Trainer (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import math

import torch
from torch import nn

from events.logbase import MemoryLog
from nnx_es.callbacks import Callback, CallbackList
from nnx_es.lifecycle import Lifecycle
from nnx_es.objective import Objective
from nnx_es.runtime.recording import Recorder
from nnx_es.runtime.run_state import RunState
from nnx_es.runtime.context import TrainContext
from nnx_es.runtime.engine import UpdateEngine, UpdateSettings
from nnx_es.runtime.steps import StepRecorder, finalize_step
from nnx_es.schedulers import Scheduler
from nnx_es.storage import BlobStore


class Receipts(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def on_optimizer_update(self, ctx, receipt) -> None:
        self.seen.append((receipt.step, receipt.optimizer))


def _engine(tmp_path, *, accumulation: int, seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    sched = Scheduler(torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step), clock="optimizer_update",
                      name="halving")
    sched.optimizer_name = "sgd"
    engine = UpdateEngine(net, {"sgd": opt}, Objective(nn.CrossEntropyLoss()), UpdateSettings(accumulation=accumulation))
    log = MemoryLog()
    state = RunState(run_id="unit", runs_root=tmp_path, recorder=Recorder(log, Lifecycle("in_epoch")),
                     store=BlobStore(tmp_path / "blobs", log=log))
    receipts = Receipts()
    steps = StepRecorder(engine, state.recorder, CallbackList([receipts]), [sched])
    steps.begin_epoch(0)
    ctx = TrainContext(state=state, steps=steps, net=net, optimizers={"sgd": opt}, schedulers=[sched], monitor=None)
    return steps, ctx, state, log, receipts, net


def _events(state, log):
    state.recorder.flush()
    return [e for _, e in log.read()]


def _batches(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)) for n in (4, 2)]


def test_a_window_of_unequal_microbatches_steps_once_on_the_mean_loss_of_its_rows(tmp_path):
    steps, ctx, state, log, receipts, net = _engine(tmp_path, accumulation=2)
    reference = nn.Linear(3, 2)
    reference.load_state_dict(net.state_dict())
    batches = _batches()
    for i, batch in enumerate(batches):
        ctx.batch_index, ctx.batch = i, batch
        steps.recorded = False
        steps.train(ctx, batch, i, update=False)
        assert steps.recorded
    assert steps.engine.window_full
    assert finalize_step(ctx) is True
    assert steps.update.reason is None

    # by hand: one SGD step on the mean cross-entropy over the window's 6 rows
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    nn.functional.cross_entropy(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    for a, b in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

    kinds = [e.KIND for e in _events(state, log)]
    assert kinds == ["microbatch_done", "microbatch_done", "update_committed", "scheduler_stepped"]
    receipt = [e for e in _events(state, log) if e.KIND == "update_committed"][0]
    assert (receipt.step, receipt.microbatches, receipt.local_examples, receipt.lrs) == (1, 2, 6.0, [0.5])
    assert receipts.seen == [(1, "sgd")]  # on_optimizer_update, before the update-clock scheduler
    assert state.recorder.counters.step == 1


def test_a_nonfinite_window_is_skipped_without_a_step_or_a_scheduler_step(tmp_path):
    steps, ctx, state, log, receipts, net = _engine(tmp_path, accumulation=1)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = _batches()[0]
    x[0, 0] = math.nan
    ctx.batch = (x, y)
    steps.train(ctx, (x, y), 0, update=False)
    assert finalize_step(ctx) is False
    assert steps.update.reason is not None
    events = _events(state, log)
    assert [e.KIND for e in events] == ["microbatch_done", "update_skipped"]
    skipped = events[-1]
    assert skipped.reason == "nonfinite"
    assert receipts.seen == []
    for a, b in zip(net.parameters(), before):
        assert torch.equal(a, b)
    assert steps.totals.skipped == 1 and steps.totals.updates == 0


def _windows_of_a_power_of_two_rows(tmp_path, monkeypatch, *, fold: bool, poison: int | None = None):
    """Three windows of 2 x 4 rows (W = 8, a power of two) through an accumulating engine; ``fold``:
    whether the window's division may ride in the fused finiteness check; ``poison``: a window whose
    gradient is made infinite (a huge input) after its loss is formed (a finite loss: skipped by the check)."""
    import nnx_es.runtime.engine as engine_module

    if not fold:
        monkeypatch.setattr(engine_module, "exact_reciprocal", lambda x: False)
    divisions = []
    div = torch._foreach_div_
    monkeypatch.setattr(torch, "_foreach_div_", lambda ts, x: (divisions.append(x), div(ts, x))[1])
    steps, ctx, state, log, receipts, net = _engine(tmp_path / str(fold), accumulation=2)
    g = torch.Generator().manual_seed(3)
    grads, reasons = [], []
    for w in range(3):
        for i in range(2):
            x, y = torch.randn(4, 3, generator=g), torch.randint(0, 2, (4,), generator=g)
            ctx.batch_index, ctx.batch = 2 * w + i, (x, y)
            steps.train(ctx, (x, y), 2 * w + i, update=False)
        if w == poison:
            net.weight.grad[0, 0] = math.inf
        committed = finalize_step(ctx)
        reasons.append("committed" if committed else steps.update.reason)
        grads.append([p.detach().clone() for p in net.parameters()])
    return grads, reasons, [e for e in _events(state, log)], divisions


def test_a_window_division_folded_into_the_finiteness_check_is_bitwise_the_division(tmp_path, monkeypatch):
    for poison in (None, 1):
        folded = _windows_of_a_power_of_two_rows(tmp_path / f"a{poison}", monkeypatch, fold=True, poison=poison)
        monkeypatch.undo()
        plain = _windows_of_a_power_of_two_rows(tmp_path / f"b{poison}", monkeypatch, fold=False, poison=poison)
        monkeypatch.undo()
        assert folded[1] == plain[1]
        assert folded[1][1] == ("nonfinite" if poison == 1 else "committed")
        for a, b in zip(folded[0], plain[0]):  # the parameters after each window, bit for bit
            for x, y in zip(a, b):
                assert torch.equal(x.view(torch.int32), y.view(torch.int32))
        assert folded[2] == plain[2]  # the same events, every float
        # the first window's division is an op of its own (no fused check seen yet), the others ride in the check
        assert (folded[3], plain[3]) == ([8.0], [8.0, 8.0, 8.0])  # W = 8


def test_the_fused_check_divides_by_a_power_of_two_as_the_division_does() -> None:
    from nnx_es.grads import WindowGradients, exact_reciprocal

    assert [exact_reciprocal(x) for x in (1.0, 2.0, 32.0, 2.0**126, 3.0, 0.5, 2.0**127, 48.0)] == \
        [True, True, True, True, False, False, False, False]
    net = nn.Linear(16, 8)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(8, 16, generator=g) * 1e30, torch.randn(8, generator=g) * 1e-38]  # huge and subnormal
    wg = WindowGradients(list(net.parameters()))
    divided = [v.clone() for v in values]
    torch._foreach_div_(divided, 64.0)
    checked = [v.clone() for v in values]
    flag, found = wg.nonfinite_flag(checked, 64.0)
    assert flag is not None and flag.item() == 0.0 and wg.fused_checks
    for a, b in zip(checked, divided):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
