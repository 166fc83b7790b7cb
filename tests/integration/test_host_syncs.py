"""The host-sync budget of the hot path: no host read inside an accumulation window, one per window.

Every read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``.cpu()``) stalls an accelerator's queue. Counted under a ``TorchDispatchMode``: the scalar
reads (``aten::_local_scalar_dense``) and the device-to-host copies; on the CPU a ``.tolist()``
dispatches nothing, so those are counted where they are called. The same tests run unchanged on
every device this machine has (``available_devices``).
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nnx_es import Trainer
from nnx_es.callbacks import Callback
from nnx_es.device import available_devices
from nnx_es.objective import Objective
from trainkit import batches, of_kind, read_events, small_net

DEVICES = available_devices()
_aten = torch.ops.aten


class HostReads(TorchDispatchMode):
    """Counts host reads of device values while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.scalar = 0  # aten::_local_scalar_dense: .item(), float(t), bool(t)
        self.to_host = 0  # device-to-host copies (.tolist(), .cpu() of a device tensor)
        self.listed = 0  # .tolist() of a CPU tensor (dispatches nothing)
        self.counting = True

    @property
    def reads(self) -> int:
        return self.scalar + self.to_host + self.listed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting:
            if func is _aten._local_scalar_dense.default:
                self.scalar += 1
            elif func is _aten._to_copy.default:
                dst = kwargs.get("device")
                if args[0].device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu":
                    self.to_host += 1
            elif func is _aten.copy_.default:
                if args[1].device.type != "cpu" and args[0].device.type == "cpu":
                    self.to_host += 1
        return func(*args, **kwargs)


@pytest.fixture
def host_reads(monkeypatch):
    import nnx_es.runtime.window

    # the device path on every device: the CPU's own reads value by value (nnx_es.runtime.window.READ_EACH_ON_CPU,
    # nothing to wait for there; the same floats: test_losses_read_once_...) are not what is budgeted
    monkeypatch.setattr(nnx_es.runtime.window, "READ_EACH_ON_CPU", False)
    mode = HostReads()
    real = torch.Tensor.tolist

    def tolist(self):
        if mode.counting and self.device.type == "cpu":
            mode.listed += 1
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return mode


class ReadsPerBatch(Callback):
    """Host reads between consecutive batch ends, and from the last one to the epoch's end."""

    def __init__(self, mode: HostReads) -> None:
        self.mode = mode
        self.per_batch: list[tuple[int, int]] = []  # (reads since the previous batch, updates committed)
        self.trailing: list[int] = []
        self._reads = 0
        self._steps = 0

    def on_epoch_begin(self, ctx) -> None:
        self.mode.counting = True
        self._reads, self._steps = self.mode.reads, ctx.step_count

    def on_batch_end(self, ctx) -> None:
        self.per_batch.append((self.mode.reads - self._reads, ctx.step_count - self._steps))
        self._reads, self._steps = self.mode.reads, ctx.step_count

    def on_epoch_end(self, ctx) -> None:
        self.trailing.append(self.mode.reads - self._reads)
        self.mode.counting = False  # the epoch's commit (a checkpoint copies the state to the host) is not the hot path


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("norm", [{}, {"clip_grad_norm": 0.5}, {"track_grad_norm": True}], ids=["fused", "clip", "norm"])
def test_a_fit_with_plain_sgd_reads_the_host_once_per_update_and_never_inside_a_window(
        tmp_path, host_reads, device, accumulation, norm):
    # a list of batches: a DataLoader reads host tensors of its own (its seed, a shuffle's order)
    train = batches([5] * 9 + [2])  # 10 microbatches an epoch, the last of 2 rows
    net = small_net(0)
    watch = ReadsPerBatch(host_reads)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="r", progress=False, accumulation=accumulation, callbacks=[watch], device=device,
                      **norm)
    host_reads.counting = False
    with host_reads:
        run = trainer.fit(train, epochs=2)
    windows_per_epoch = math.ceil(10 / accumulation)
    assert run.counters.step == 2 * windows_per_epoch
    for i, (reads, updates) in enumerate(watch.per_batch):
        closes_window = (i % 10 + 1) % accumulation == 0
        assert (reads, updates) == ((1, 1) if closes_window else (0, 0)), f"microbatch {i}"
    # a window cut short by the epoch's end is closed (and read, once) after the last batch
    assert watch.trailing == [0 if 10 % accumulation == 0 else 1] * 2
    assert sum(r for r, _ in watch.per_batch) + sum(watch.trailing) == run.counters.step  # exactly one read per update


@pytest.mark.parametrize("device", DEVICES)
def test_progress_reads_the_loss_at_updates_only(tmp_path, host_reads, device):
    train = batches([5] * 8)
    net = small_net(0)
    watch = ReadsPerBatch(host_reads)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="r", progress=True, accumulation=4, callbacks=[watch], device=device)
    host_reads.counting = False
    with host_reads:
        trainer.fit(train, epochs=1)
    assert [r for r, _ in watch.per_batch] == [0, 0, 0, 1, 0, 0, 0, 1]


def _trainer(tmp_path, run_id, *, callbacks=(), device="cpu", **kw):
    net = small_net(3)
    objective = Objective({"ce": nn.CrossEntropyLoss(), "ls": (nn.CrossEntropyLoss(label_smoothing=0.2), 0.5)})
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), objective, runs_root=tmp_path, run_id=run_id,
                   progress=False, callbacks=list(callbacks), device=device, **kw)


class EagerLoss(Callback):
    """Reads ``ctx.loss`` at every microbatch (one host read each) when ``read``: what the log held before."""

    def __init__(self, read: bool) -> None:
        self.read = read
        self.losses: list[float] = []

    def on_batch_end(self, ctx) -> None:
        if self.read:
            self.losses.append(ctx.loss)


def _content(run_dir):
    """Every event's kind; the training record's events whole (checkpoints differ by the callback's state)."""
    whole = {"microbatch_done", "update_committed", "update_skipped", "epoch_summarized", "history_appended"}
    drop = {"wall_time_s", "duration_s"}
    out = []
    for _, e in read_events(run_dir):
        if e.KIND in whole:
            fields = {k: v for k, v in msgspec.structs.asdict(e).items() if k not in drop}
            if e.KIND == "history_appended":
                fields = {k: v for k, v in msgspec.structs.asdict(fields["record"]).items() if k not in drop}
            out.append((e.KIND, repr(fields)))
        else:
            out.append((e.KIND, ""))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulation", [1, 3])
def test_losses_read_once_per_window_are_the_floats_a_read_per_microbatch_gives(tmp_path, device, accumulation):
    """Losses, terms, skips (a NaN microbatch, a masked one), receipts and epoch sums: the same log."""
    data = batches([4, 4, 3, 4, 4, 2, 4], seed=5, nan_at=(3,), masks={5: [0.0, 0.0]})
    eager = EagerLoss(read=True)
    a = _trainer(tmp_path, "eager", callbacks=[eager], device=device, accumulation=accumulation,
                 sample_weights=True).fit(data, epochs=2)
    b = _trainer(tmp_path, "deferred", callbacks=[EagerLoss(read=False)], device=device, accumulation=accumulation,
                 sample_weights=True).fit(data, epochs=2)
    assert _content(a.run_dir) == _content(b.run_dir)
    done = of_kind(b.run_dir, "microbatch_done")
    assert [repr(d.loss) for d in done] == [repr(x) for x in eager.losses]
    assert math.isnan(done[3].loss) and math.isnan(done[5].loss) and set(done[0].terms) == {"ce", "ls"}
    assert {s.reason for s in of_kind(b.run_dir, "update_skipped")} >= {"nonfinite"}


def _fit_watched(tmp_path, host_reads, train, *, accumulation, device, before=(), **kw):  # noqa: ANN001, ANN202
    """Two epochs of 10 microbatches each, the host reads counted per batch; asserts the budget: one read
    at each microbatch that closes a window (with its update), none at the others. ``before``: callbacks
    dispatched before the counting one (their epoch-end reads land in ``watch.trailing``). Returns
    (trainer, run, watch)."""
    net = small_net(0)
    watch = ReadsPerBatch(host_reads)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="r", progress=False, accumulation=accumulation, callbacks=[*before, watch], device=device,
                      **kw)
    host_reads.counting = False
    with host_reads:
        run = trainer.fit(train, epochs=2)
    for i, (reads, updates) in enumerate(watch.per_batch):
        closes_window = (i % 10 + 1) % accumulation == 0
        assert (reads, updates) == ((1, 1) if closes_window else (0, 0)), f"microbatch {i}"
    return trainer, run, watch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulation", [1, 4])
def test_per_row_records_add_no_host_read_inside_a_window(tmp_path, host_reads, device, accumulation):
    # batches carrying row ids: every row's values stay on the device until the epoch's close
    plain = batches([5] * 9 + [2])
    starts = [sum(len(b[0]) for b in plain[:i]) for i in range(len(plain))]
    train = [{"x": b[0], "y": b[1], "idx": torch.arange(s, s + len(b[0]))} for s, b in zip(starts, plain)]
    trainer, run, watch = _fit_watched(tmp_path, host_reads, train, accumulation=accumulation, device=device)
    assert sum(r for r, _ in watch.per_batch) + sum(watch.trailing) <= run.counters.step + 2 * 2  # + the close's reads
    assert len(of_kind(trainer.run_dir, "rows_recorded")) == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("norm", [{}, {"clip_grad_norm": 0.5}], ids=["fused", "clip"])
def test_ignored_targets_add_no_host_read_inside_a_window(tmp_path, host_reads, device, accumulation, norm,
                                                          monkeypatch):
    """Targets an ignore_index leaves out are counted on the device and read with the window's one read
    (as on an accelerator: the host count of CPU targets is turned off here)."""
    import nnx_es.objective

    monkeypatch.setattr(nnx_es.objective, "HOST_COUNT_ON_CPU", False)
    train = batches([5] * 9 + [2])
    for i, (_, y) in enumerate(train):
        y[i % len(y)] = -100  # one ignored target in every microbatch
    _, run, watch = _fit_watched(tmp_path, host_reads, train, accumulation=accumulation, device=device, **norm)
    assert watch.trailing == [0 if 10 % accumulation == 0 else 1] * 2
    assert [m.examples for m in of_kind(run.run_dir, "microbatch_done")] == [4.0] * 9 + [1.0] + [4.0] * 9 + [1.0]



@pytest.mark.parametrize(("terms", "accumulation", "weighted", "extra"), [
    (2, 1, True, {}), (2, 2, True, {"clip_grad_norm": 0.5}), (1, 4, True, {}), (1, 1, True, {"track_grad_norm": True}),
    (2, 1, False, {}), (1, 2, False, {"clip_grad_norm": 0.5}), (2, 3, True, {"read_max": 0}), (1, 4, False, {}),
], ids=["two-terms", "two-terms-acc2-clip", "one-term-acc4", "one-term-norm", "ignored-two-terms",
        "ignored-acc2-clip", "two-terms-acc3-all-stacked", "ignored-acc4-stacked"])
def test_the_cpu_reads_value_by_value_write_the_log_the_stacked_read_writes(tmp_path, monkeypatch, terms,
                                                                          accumulation, weighted, extra):
    """nnx_es.runtime.window.READ_EACH_ON_CPU: a window's losses, terms, ignored rows (counted on the device) and
    gradients' flag or norm read one by one on the CPU give the floats of the one stacked read: the same log
    (a NaN microbatch, a masked one, ignored targets). A window of more than _READ_EACH_MAX values is stacked."""
    import nnx_es.runtime.window
    import nnx_es.objective

    monkeypatch.setattr(nnx_es.objective, "HOST_COUNT_ON_CPU", False)  # ignored rows: a float64 tensor read
    extra = dict(extra)
    read_max = extra.pop("read_max", nnx_es.runtime.window.READ_EACH_MAX)
    monkeypatch.setattr(nnx_es.runtime.window, "READ_EACH_MAX", read_max)  # 0: every window stacked
    sizes = [4, 4, 3, 4, 4, 2, 4]
    data = batches(sizes, seed=5, nan_at=(3,), masks={5: [0.0, 0.0]} if weighted else None)
    for i, batch in enumerate(data):
        if i % 2:
            batch[1][-1] = -100  # an ignored target (not the NaN row)

    def fit(run_id, read_each):
        monkeypatch.setattr(nnx_es.runtime.window, "READ_EACH_ON_CPU", read_each)
        objective = {"ce": nn.CrossEntropyLoss(), "ls": (nn.CrossEntropyLoss(label_smoothing=0.2), 0.5)}
        net = small_net(3)
        trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1),
                          Objective(objective) if terms == 2 else nn.CrossEntropyLoss(), runs_root=tmp_path,
                          run_id=run_id, progress=False, accumulation=accumulation, sample_weights=weighted, **extra)
        mode = HostReads()
        with mode:
            run = trainer.fit(data, epochs=2)
        return run, mode.scalar

    each, each_reads = fit("each", True)
    stacked, stacked_reads = fit("stacked", False)
    assert _content(each.run_dir) == _content(stacked.run_dir)
    # a window's values: each microbatch's loss, its terms (of several), its ignored rows (unweighted); the flag
    values = accumulation * (1 + (terms if terms > 1 else 0) + (0 if weighted else 1)) + 1
    # one term's ignored rows are an integer count (a sum of bools): not a float, so stacked (promoted) as before
    if values <= read_max and not (terms == 1 and not weighted):
        assert each_reads > stacked_reads  # the reads were value by value (Tensor.item)
    elif read_max == 0:
        assert each_reads == stacked_reads  # every window stacked
    done = of_kind(each.run_dir, "microbatch_done")
    assert math.isnan(done[3].loss) and done[1].examples == 3.0 and len(done) == 2 * len(sizes)
    assert math.isnan(done[5].loss) if weighted else done[5].examples == 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulation", [1, 4])
def test_diagnostics_add_no_host_read_inside_an_epoch_and_one_at_its_end(tmp_path, host_reads, device, accumulation):
    """Diagnostics(every=1) records every update (gradients, weights, the update's size, activations: a Tanh) on
    the device; the epoch's records are read at its end in one transfer, before the epoch's commit."""
    from nnx_es import Diagnostics

    _, run, watch = _fit_watched(tmp_path, host_reads, batches([5] * 9 + [2]), accumulation=accumulation,
                                 device=device, before=[Diagnostics(every=1)])
    assert watch.trailing == [(0 if 10 % accumulation == 0 else 1) + 1] * 2  # + the diagnostics' one read
    records = of_kind(run.run_dir, "diagnostics_recorded")
    assert [r.step for r in records] == list(range(1, run.counters.step + 1))
    assert all(r.activation_mean.keys() == {"1"} and r.grad_norm.keys() == {"0", "2"} for r in records)
