"""Callback failures: a begin hook, an epoch-end hook, and cleanup hooks that raise.

Failure semantics (DESIGN.md): callbacks whose begin hook completed are finalized even on
failure, in reverse order; every cleanup hook is attempted; a cleanup error never masks the
training error; the failing epoch's history is not committed. Beyond the basics in
``tests/integration/test_trainer_run.py``, these tests pin the exact log each failure
leaves, check it against the audit, and resume from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from torch import nn

from events.schema import CallbackFinalized, LastCommitted, RunFailed, RunFinalized, RunResumed
from nnx_es import Callback, Trainer
from nnx_es.audit import audit_run
from nnx_es.errors import ResumeError
from projections import project
from trainkit import kinds, loaders, read_events, small_net

torch.set_num_threads(1)

EPOCHS = 3
RUN_ID = "r"


class Hooked(Callback):
    """Appends ``<name>.<hook>`` to a shared list; raises ``errors[hook]`` (when its epoch matches)."""

    def __init__(self, name: str, seen: list[str], errors: dict[str, BaseException] | None = None,
                 at_epoch: int | None = None) -> None:
        self._name, self.seen, self.errors, self.at_epoch = name, seen, errors or {}, at_epoch
        self.epochs = 0

    @property
    def name(self) -> str:
        return self._name

    def _hook(self, hook: str, ctx: Any) -> None:
        self.seen.append(f"{self._name}.{hook}")
        exc = self.errors.get(hook)
        if exc is not None and (self.at_epoch is None or ctx.epoch == self.at_epoch):
            raise exc

    def on_train_begin(self, ctx):
        self._hook("begin", ctx)

    def on_epoch_end(self, ctx):
        self.epochs += 1
        self._hook("epoch_end", ctx)

    def on_train_end(self, ctx):
        self._hook("end", ctx)

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


def make_trainer(runs: Path, run_id: str | None, callbacks: list[Callback]) -> Trainer:
    net = small_net(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", callbacks=callbacks,
                   runs_root=runs, run_id=run_id, seed=0, progress=False)


def fit(trainer: Trainer, **kw: Any):
    return trainer.fit(*loaders(batch_size=16, n_train=32), epochs=EPOCHS, **kw)


def _finalized(run_dir: Path) -> list[tuple[str, int, str | None]]:
    return [(e.name, e.index, e.error) for _, e in read_events(run_dir) if isinstance(e, CallbackFinalized)]


def _audit_ok(run_dir: Path) -> None:
    report = audit_run(run_dir)
    assert report.ok, [v.line() for v in report.violations]


def _untimed_history(run_dir: Path) -> list[Any]:
    return [msgspec.structs.replace(r, wall_time_s=0.0) for r in project(read_events(run_dir)).history.records]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, Any]:
    """The same run without failures: its final parameters and history."""
    runs = tmp_path_factory.mktemp("clean")
    seen: list[str] = []
    trainer = make_trainer(runs, RUN_ID, [Hooked("a", seen), Hooked("b", seen), Hooked("c", seen)])
    fit(trainer)
    return {"params": {k: v.clone() for k, v in trainer.net.state_dict().items()},
            "history": _untimed_history(runs / RUN_ID)}


# --- a begin hook fails ------------------------------------------------------------------


def test_second_begin_hook_failing_finalizes_only_the_first_and_leaves_nothing_to_resume(tmp_path):
    seen: list[str] = []
    boom = ValueError("b cannot begin")
    cbs = [Hooked("a", seen), Hooked("b", seen, {"begin": boom}), Hooked("c", seen)]
    runs = tmp_path / "runs"
    with pytest.raises(ValueError) as info:
        fit(make_trainer(runs, RUN_ID, cbs))
    assert info.value is boom  # the very exception, re-raised after finalization
    assert seen == ["a.begin", "b.begin", "a.end"]  # c never began; b never ended
    run_dir = runs / RUN_ID
    assert kinds(run_dir) == ["run_started", "callback_began", "run_failed", "callback_finalized", "run_finalized"]
    events = [e for _, e in read_events(run_dir)]
    assert events[1].name == "a"
    failed = events[2]
    assert isinstance(failed, RunFailed)
    assert (failed.error_type, failed.message, failed.epoch, failed.step) == ("ValueError", "b cannot begin", 0, 0)
    assert "b cannot begin" in failed.traceback
    assert _finalized(run_dir) == [("a", 0, None)]
    assert isinstance(events[-1], RunFinalized) and events[-1].status == "failed"
    p = project(read_events(run_dir))
    assert p.status.status == "failed" and p.status.error_type == "ValueError"
    assert p.checkpoints.last is None and p.history.records == ()
    _audit_ok(run_dir)
    # no LAST was ever committed: a resume is refused, and appends nothing
    before = read_events(run_dir)
    with pytest.raises(ResumeError, match="no committed LAST"):
        fit(make_trainer(runs, None, [Hooked("a", []), Hooked("b", []), Hooked("c", [])]), resume_from=run_dir)
    assert read_events(run_dir) == before


def test_a_begin_hook_failing_on_resume_keeps_the_committed_run_and_a_later_resume_is_exact(tmp_path, clean):
    runs = tmp_path / "runs"
    run_dir = runs / RUN_ID
    seen: list[str] = []
    stop = RuntimeError("interrupted in epoch 1")
    with pytest.raises(RuntimeError):
        fit(make_trainer(runs, RUN_ID, [Hooked("a", seen), Hooked("b", seen, {"epoch_end": stop}, at_epoch=1),
                                        Hooked("c", seen)]))
    committed = project(read_events(run_dir))
    assert [r.epoch for r in committed.history.records] == [0]
    # the resumed session fails in b's begin hook: only a (begun in this session) is finalized
    seen.clear()
    boom = OSError("b's resource is gone")
    with pytest.raises(OSError) as info:
        fit(make_trainer(runs, None, [Hooked("a", seen), Hooked("b", seen, {"begin": boom}), Hooked("c", seen)]),
            resume_from=run_dir)
    assert info.value is boom
    assert seen == ["a.begin", "b.begin", "a.end"]
    events = read_events(run_dir)
    resumed_at = max(s for s, e in events if isinstance(e, RunResumed))
    assert [e.KIND for _, e in events[resumed_at:]] == [
        "run_resumed", "callback_began", "run_failed", "callback_finalized", "run_finalized"]
    after = project(events)
    assert after.history == committed.history and after.checkpoints.last == committed.checkpoints.last
    assert after.status.status == "failed" and after.status.error_type == "OSError"
    _audit_ok(run_dir)
    # a clean resume then reaches the uninterrupted run bitwise
    trainer = make_trainer(runs, None, [Hooked("a", []), Hooked("b", []), Hooked("c", [])])
    assert fit(trainer, resume_from=run_dir).status == "completed"
    for k, v in trainer.net.state_dict().items():
        assert torch.equal(v, clean["params"][k]), k
    assert _untimed_history(run_dir) == clean["history"]
    _audit_ok(run_dir)


# --- on_epoch_end fails ------------------------------------------------------------------


def test_epoch_end_failure_rolls_back_the_epoch_records_the_failure_and_finalizes_every_callback(tmp_path, clean):
    seen: list[str] = []
    boom = KeyError("epoch end broke")
    cbs = [Hooked("a", seen), Hooked("b", seen, {"epoch_end": boom}, at_epoch=1), Hooked("c", seen)]
    runs = tmp_path / "runs"
    trainer = make_trainer(runs, RUN_ID, cbs)
    with pytest.raises(KeyError) as info:
        fit(trainer)
    assert info.value is boom
    # b raised at epoch 1's end: c's epoch-end hook did not run for epoch 1; all three ended, in reverse
    assert seen == ["a.begin", "b.begin", "c.begin",
                    "a.epoch_end", "b.epoch_end", "c.epoch_end",
                    "a.epoch_end", "b.epoch_end",
                    "c.end", "b.end", "a.end"]
    run_dir = runs / RUN_ID
    events = read_events(run_dir)
    ks = [e.KIND for _, e in events]
    # epoch 1 ran up to its scheduler steps and monitor decision, then failed: no history, no LAST for it
    failed_at = ks.index("run_failed")
    epoch1 = ks[ks.index("epoch_began", ks.index("epoch_began") + 1):failed_at]
    assert "history_appended" not in epoch1 and "last_committed" not in epoch1
    assert epoch1[-1] == "monitor_decided"
    assert ks[failed_at:] == ["run_failed", "callback_finalized", "callback_finalized", "callback_finalized",
                              "run_finalized"]
    failed = events[failed_at][1]
    assert (failed.error_type, failed.epoch) == ("KeyError", 1) and "epoch end broke" in failed.message
    assert _finalized(run_dir) == [("c", 2, None), ("b", 1, None), ("a", 0, None)]
    # LAST stays at epoch 0 (never refreshed after a failure); the committed view ends there
    lasts = [e for _, e in events if isinstance(e, LastCommitted)]
    assert [(e.epoch, e.final) for e in lasts] == [(-1, False), (0, False)]
    p = project(events)
    assert [r.epoch for r in p.history.records] == [0]
    assert p.checkpoints.last.epoch == 0 and p.counters.epoch == 1
    assert p.status.status == "failed" and p.status.error_type == "KeyError"
    assert events[-1][1].status == "failed"
    _audit_ok(run_dir)
    # the epoch is rolled back in the trainer's checkpointed callback state too: a resume is exact
    resumed = make_trainer(runs, None, [Hooked("a", []), Hooked("b", []), Hooked("c", [])])
    fit(resumed, resume_from=run_dir)
    assert [cb.epochs for cb in resumed.callbacks] == [EPOCHS] * 3
    for k, v in resumed.net.state_dict().items():
        assert torch.equal(v, clean["params"][k]), k
    assert _untimed_history(run_dir) == clean["history"]
    _audit_ok(run_dir)


def test_keyboard_interrupt_in_epoch_end_is_finalized_recorded_and_re_raised(tmp_path):
    seen: list[str] = []
    cbs = [Hooked("a", seen), Hooked("b", seen, {"epoch_end": KeyboardInterrupt()}, at_epoch=0)]
    runs = tmp_path / "runs"
    with pytest.raises(KeyboardInterrupt):
        fit(make_trainer(runs, RUN_ID, cbs))
    assert seen[-2:] == ["b.end", "a.end"]
    p = project(read_events(runs / RUN_ID))
    assert p.status.status == "interrupted" and p.status.error_type == "KeyboardInterrupt"  # resumable
    assert p.history.records == () and p.checkpoints.last.epoch == -1
    _audit_ok(runs / RUN_ID)


# --- cleanup hooks fail --------------------------------------------------------------------


def test_cleanup_errors_while_training_failed_never_mask_it_and_every_cleanup_runs(tmp_path):
    seen: list[str] = []
    training_error = ZeroDivisionError("the step diverged")

    def step(net, batch):
        raise training_error

    cbs = [Hooked("a", seen, {"end": RuntimeError("a cleanup broke")}),
           Hooked("b", seen),
           Hooked("c", seen, {"end": OSError("c cleanup broke")})]
    runs = tmp_path / "runs"
    net = small_net(0)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), callbacks=cbs,
                      train_step_fn=step, runs_root=runs, run_id=RUN_ID, progress=False)
    with pytest.raises(ZeroDivisionError) as info:
        fit(trainer)
    assert info.value is training_error
    assert seen == ["a.begin", "b.begin", "c.begin", "c.end", "b.end", "a.end"]  # every cleanup ran
    run_dir = runs / RUN_ID
    assert _finalized(run_dir) == [("c", 2, "OSError: c cleanup broke"), ("b", 1, None),
                                   ("a", 0, "RuntimeError: a cleanup broke")]
    failed = [e for _, e in read_events(run_dir) if isinstance(e, RunFailed)]
    assert len(failed) == 1 and failed[0].error_type == "ZeroDivisionError"  # the training error, only
    p = project(read_events(run_dir))
    assert p.status.status == "failed" and p.status.error == "the step diverged"
    _audit_ok(run_dir)


def test_a_cleanup_error_after_a_successful_run_fails_it_and_is_raised_after_everything_ran(tmp_path):
    seen: list[str] = []
    cleanup_error = RuntimeError("could not upload the artifacts")
    cbs = [Hooked("a", seen), Hooked("b", seen, {"end": cleanup_error}), Hooked("c", seen)]
    runs = tmp_path / "runs"
    with pytest.raises(RuntimeError) as info:
        fit(make_trainer(runs, RUN_ID, cbs))
    assert info.value is cleanup_error
    assert seen[-3:] == ["c.end", "b.end", "a.end"]
    run_dir = runs / RUN_ID
    events = read_events(run_dir)
    assert [e.KIND for _, e in events][-5:] == [
        "callback_finalized", "callback_finalized", "callback_finalized", "run_failed", "run_finalized"]
    assert _finalized(run_dir) == [("c", 2, None), ("b", 1, "RuntimeError: could not upload the artifacts"),
                                   ("a", 0, None)]
    # the trained epochs stay committed; LAST is not refreshed after a failed finalization
    p = project(events)
    assert [r.epoch for r in p.history.records] == list(range(EPOCHS))
    assert not any(e.final for _, e in events if isinstance(e, LastCommitted))
    assert p.status.status == "failed" and p.status.error_type == "RuntimeError"
    # views were still materialized, and agree with the log
    assert (run_dir / "views" / "summary.json").exists()
    _audit_ok(run_dir)
