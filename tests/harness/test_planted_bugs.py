"""The public crash harness (nnx_es.testing) against set-ups with planted resume bugs, and on
the digits job: each bug is reported at the points that expose it, with its divergence."""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from nnx_es import Callback, Trainer
from nnx_es.testing import Fit, HarnessFailure, crash_test, fault_test
from trainkit import blobs_data, loaders, small_net

EPOCHS = 3


def make_build(*, callbacks=(), net_factory=small_net, train_loader=None):
    def build(runs_root, run_id):
        net = net_factory(0)
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        trainer = Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", callbacks=[c() for c in callbacks],
                          runs_root=runs_root, run_id=run_id, seed=0, progress=False)
        train, val = loaders(batch_size=8, n_train=32, n_val=24)
        return Fit(trainer, train_loader() if train_loader else train, val)

    return build


def epoch_last_seqs(build, runs_root) -> list[int]:
    """Seqs of the reference's LAST commits that follow an epoch (not the initial or final one)."""
    from trainkit import read_events

    build(runs_root, "probe").run(epochs=EPOCHS)
    seqs = [s for s, e in read_events(runs_root / "probe") if e.KIND == "last_committed"]
    return seqs[1:-1]


class WarmupWithoutState(Callback):
    """Planted bug: counts epochs to warm the learning rate up, but checkpoints nothing."""

    def __init__(self):
        self.epochs_seen = 0

    def on_epoch_begin(self, ctx):
        for opt in ctx.trainer.optimizers.values():
            for g in opt.param_groups:
                g["lr"] = 0.05 * min(1.0, (self.epochs_seen + 1) / EPOCHS)
        self.epochs_seen += 1


class NoisyNet(nn.Module):
    """Planted bug: input noise drawn from a generator of its own, which no checkpoint holds."""

    def __init__(self, seed):
        super().__init__()
        self.body = small_net(seed)
        self.noise = torch.Generator().manual_seed(seed)

    def forward(self, x):
        if self.training:
            x = x + 0.1 * torch.randn(x.shape, generator=self.noise)
        return self.body(x)


class EpochSeededSampler(Sampler):
    """Planted bug: shuffles with a seed from its own epoch count, which starts at 0 in every process."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def __iter__(self):
        order = list(range(self.n))
        random.Random(self.epoch).shuffle(order)
        self.epoch += 1
        return iter(order)

    def __len__(self):
        return self.n


def reshuffling_loader():
    x, y = blobs_data(56, 0)
    return DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8, sampler=EpochSeededSampler(32))


@pytest.mark.parametrize("bug", ["callback state not checkpointed", "rng stream not restored", "loader reshuffles"])
def test_a_planted_resume_bug_is_reported_at_the_points_after_the_first_epoch_commit(bug, tmp_path):
    build = {
        "callback state not checkpointed": make_build(callbacks=[WarmupWithoutState]),
        "rng stream not restored": make_build(net_factory=NoisyNet),
        "loader reshuffles": make_build(train_loader=reshuffling_loader),
    }[bug]
    report = crash_test(build, epochs=EPOCHS, points=24, runs_root=tmp_path)
    assert not report.ok
    text = str(report)
    assert "FAILED" in text and str(len(report.failures)) + " failed" in text
    with pytest.raises(HarnessFailure):
        report.raise_for_failures()
    failed = {f.point for f in report.failures}
    assert all(report.outcomes[p] == "failed" for p in failed)
    # the right points: a kill before epoch 0's LAST resumes from the initial checkpoint (nothing
    # missed yet), one after the last epoch's commit group has no training left; the kills between
    # (once epoch 0's commit group is durable) fail, as one block
    first, final = epoch_last_seqs(build, tmp_path)[0], epoch_last_seqs(build, tmp_path / "again")[-1]
    events = [(int(p.split(":")[1]), report.outcomes[p] == "failed") for p in report.tried if p.startswith("event:")]
    assert not any(bad for n, bad in events if n <= first or n > final + 8), (events, first, final)
    flags = "".join("x" if bad else "." for _, bad in events)
    assert "x" in flags and flags.strip(".").count(".") == 0, (flags, events)
    for f in report.failures:
        # caught by the resume check, with the step where training diverged and the first tensor
        assert "resumed run" in f.check, f
        assert f.divergence and "the first update after the resume that differs" in f.divergence, f
        assert "final LAST checkpoint: model[" in f.divergence, f
    # the point names the event seq and kind (or the persistence step) of the reference
    assert any("before event seq" in f.where for f in report.failures)


def test_a_planted_rng_bug_names_the_first_resumed_step_and_the_first_tensor(tmp_path):
    report = crash_test(make_build(net_factory=NoisyNet), epochs=EPOCHS, points=12, runs_root=tmp_path)
    assert not report.ok
    f = report.failures[0]
    # the first step after a resume from epoch k's LAST is step 4k + 1 (4 updates an epoch)
    assert "step " in f.divergence and "loss" in f.divergence
    assert "model['body.0.weight']" in f.divergence or "model['body" in f.divergence
    # the promise is named as a promise; the epoch that broke it is in what was expected and found
    history = [f for f in report.failures if "history" in f.check]
    assert history, [f.check for f in report.failures]
    for f in history:
        assert f.check == "the resumed run's history is the reference's", f.check
        epoch = f.expected.split(":")[0]
        assert epoch.startswith("epoch ") and f.found.startswith(epoch + ":"), (f.expected, f.found)


def test_a_correct_set_up_holds_at_every_crash_and_fault_point(tmp_path):
    build = make_build()
    crash = crash_test(build, epochs=2, points="all", runs_root=tmp_path)
    assert crash.ok, crash
    assert len(crash.tried) == crash.available
    assert set(crash.outcomes.values()) == {"refused", "resumed"}
    faults = fault_test(build, epochs=2, runs_root=tmp_path)
    assert faults.ok, faults  # a failed first commit included: the log returns to what was written
    assert len(faults.tried) == faults.available and faults.tried[0].startswith("ENOSPC ")


def test_a_sample_of_points_is_spread_over_the_run_and_reproducible(tmp_path):
    build = make_build()
    a = crash_test(build, epochs=2, points=12, seed=3, runs_root=tmp_path)
    b = crash_test(build, epochs=2, points=12, seed=3, runs_root=tmp_path)
    assert a.ok and a.tried == b.tried and len(a.tried) == 12
    kinds = {p.split(":")[0] for p in a.tried}
    assert kinds == {"event", "io", "sync"}
    events = sorted(int(p.split(":")[1]) for p in a.tried if p.startswith("event:"))
    assert events[0] < 8 and events[-1] > 30  # from the start to the end of the run (~40 events)


def test_the_digits_job_survives_50_sampled_crash_points_in_under_a_minute(tmp_path):
    pytest.importorskip("sklearn")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from digits import digits_splits, make_net

    from nnx_es import EarlyStopping, Monitor, NNModel, Scheduler

    data = digits_splits(0)

    def build(runs_root, run_id):
        model = NNModel(make_net())
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=3)
        train = DataLoader(TensorDataset(*data["train"]), batch_size=32, shuffle=True,
                           generator=torch.Generator().manual_seed(0))
        val = DataLoader(TensorDataset(*data["val"]), batch_size=256)
        return Fit(model, train, val, dict(
            optimizer=opt, loss=nn.CrossEntropyLoss(), monitor=Monitor("val_loss", mode="min", min_delta=1e-4),
            schedulers=[Scheduler(plateau, clock="epoch", name="plateau")], callbacks=[EarlyStopping(patience=6)],
            runs_root=runs_root, run_id=run_id, seed=0, progress=False))

    t0 = time.perf_counter()
    report = crash_test(build, epochs=3, points=50)
    elapsed = time.perf_counter() - t0
    print(f"\ndigits crash test: {report}  (measured {elapsed:.1f} s)")
    assert report.ok, report
    assert len(report.tried) == 50


def test_a_failed_first_commit_leaves_a_log_that_audits_clean(tmp_path):
    report = fault_test(make_build(), epochs=1, faults=("ENOSPC",), points="all", runs_root=tmp_path)
    assert report.ok, report



def test_a_killed_child_whose_own_fork_keeps_the_pipe_open_does_not_hang_the_harness(tmp_path):
    """A DataLoader worker forked by the killed run inherits the report pipe: wait for the run, not the pipe."""
    import os
    import signal
    import time

    from nnx_es.testing.harness import run_in_child

    marker = tmp_path / "orphan.pid"

    def run() -> None:
        orphan = os.fork()
        if orphan == 0:  # outlives its parent, holding the pipe's write end
            time.sleep(120)
            os._exit(0)
        marker.write_text(str(orphan))
        os.kill(os.getpid(), signal.SIGKILL)

    started = time.monotonic()
    try:
        assert run_in_child(run) == "killed"
        # reading to the pipe's end would wait out the orphan's 120 s (a bound on a hang, not a speed)
        assert time.monotonic() - started < 100
    finally:
        os.kill(int(marker.read_text()), signal.SIGKILL)


# --- the report as a test failure shows it ---------------------------------------------------


def test_a_failing_report_starts_with_a_summary_names_the_first_divergence_once_and_groups_identical_failures(
        tmp_path):
    report = crash_test(make_build(callbacks=[WarmupWithoutState]), epochs=EPOCHS, points=16, runs_root=tmp_path)
    assert not report.ok and len(report.failures) >= 3
    lines = str(report).splitlines()
    n = len(report.failures)
    assert lines[0].startswith(f"crash test: FAILED -- 16 of {report.available} points over 3 epoch(s)"), lines[0]
    assert f"{n} failed (diverged)" in lines[0] and "resumed bitwise" in lines[0] and "refused" in lines[0], lines[0]
    # the first divergence, once, with the state it lives in: the warm-up's learning rate, not a weight
    assert lines[1].startswith(f"first divergence at {report.failures[0].point}: "
                               "optimizer/adam['param_groups'][0]['lr']: expected "), lines[1]
    assert "; step " in lines[1], lines[1]
    assert sum("first divergence at" in line for line in lines) == 1
    # one block per broken promise, the others named by their points
    groups = report.groups()
    assert len(groups) < n
    assert sum(line.strip().startswith("expected:") for line in lines) == len(groups)
    for check, group in groups.items():
        assert any(line.startswith(f"{len(group)} point(s) break: {check} -- {group[0].point}") for line in lines)
    # what pytest shows for `assert report.ok, report` at the default verbosity: saferepr, 240 characters
    assert len(repr(report)) <= 238 and repr(report).startswith(lines[0]) and "['lr']: expected" in repr(report)


def test_a_crash_test_does_not_warn_of_stale_temporaries_at_every_resumed_point(tmp_path, capfd):
    report = crash_test(make_build(), epochs=1, points="all", runs_root=tmp_path)
    assert report.ok, report
    # a kill after a temporary's write leaves it; that point's resume removes it (by design here)
    assert any(p.startswith("io:") for p in report.tried)
    assert "removed stale temporaries" not in capfd.readouterr().err


def test_a_users_own_resume_still_warns_of_the_stale_temporaries_it_removes(tmp_path):
    from structlog.testing import capture_logs

    build = make_build()
    build(tmp_path, "mine").run(epochs=1)
    (tmp_path / "mine" / "views" / ".summary.json.99999.deadbeef.tmp").write_text("{")
    with capture_logs() as logs:
        build(tmp_path, "mine").run(epochs=2, resume_from=tmp_path / "mine")
    warned = [e for e in logs if e["event"] == "removed stale temporaries"]
    assert warned and warned[0]["log_level"] == "warning", logs
