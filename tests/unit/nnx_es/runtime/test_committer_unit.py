"""The committer alone: over an in-memory log and recorder, with no Trainer (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import torch
from torch import nn

from events.logbase import MemoryLog
from events.schema import MonitorDecided
from nnx_es.callbacks import Callback, CallbackList
from nnx_es.checkpoint import read_manifest
from nnx_es.runtime.commit import Committer, checkpoint_lag
from nnx_es.lifecycle import Lifecycle
from nnx_es.objective import Objective
from nnx_es.runtime.recording import Recorder
from nnx_es.rng import LoaderGenerators
from nnx_es.runtime.run_state import RunState
from nnx_es.runtime.context import TrainContext
from nnx_es.runtime.engine import UpdateEngine
from nnx_es.runtime.steps import StepRecorder
from nnx_es.runtime.components import RunComponents, load_state
from nnx_es.storage import BlobStore


class Artifact(Callback):
    """A callback with a deferred checkpoint of its own and restart-critical state."""

    def __init__(self) -> None:
        self.epochs = 0

    def checkpoint(self, ctx):
        return f"artifact at epoch {ctx.epoch}".encode()

    def state_dict(self):
        return {"epochs": self.epochs}


def _committer(tmp_path, lifecycle: str, *, lag: int = 0, phase_every=None, keep_phases=None):
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = UpdateEngine(net, {"sgd": opt}, Objective(nn.CrossEntropyLoss()))
    artifact = Artifact()
    components = RunComponents(net=net, optimizers={"sgd": opt}, schedulers=[], engine=engine, update_hooks=[],
                               monitor=None, callbacks=[artifact])
    components.generators = {"train": LoaderGenerators.of(None), "val": LoaderGenerators.of(None)}
    log = MemoryLog()
    store = BlobStore(tmp_path / "blobs", log=log)
    state = RunState(run_id="unit", runs_root=tmp_path, recorder=Recorder(log, Lifecycle(lifecycle)), store=store)
    callbacks = CallbackList([artifact])
    ctx = TrainContext(state=state, steps=StepRecorder(engine, state.recorder, callbacks), net=net,
                       optimizers={"sgd": opt}, schedulers=[], monitor=None)
    committer = Committer(state, components, callbacks, ctx, lag=lag, phase_every=phase_every,
                          keep_phases=keep_phases)
    return committer, state, log, net, artifact


def _decision(epoch: int) -> MonitorDecided:
    return MonitorDecided(epoch=epoch, monitor="val_loss", mode="min", value=1.0 / (epoch + 1), improved=True,
                          best=1.0 / (epoch + 1), best_epoch=epoch, bad_epochs=0)


def test_an_epoch_commit_writes_last_and_its_group_in_one_synced_write(tmp_path):
    committer, state, log, net, artifact = _committer(tmp_path, "recorded", phase_every=1, keep_phases=1)
    artifact.epochs = 3
    committer.submit(epoch=0, covers=-1, decision=_decision(0))
    assert committer.pending is None  # lag 0: complete before submit returns
    assert log.syncs == 1 and log.durable_seq == log.next_seq  # all of it durable
    events = [e for _, e in log.read()]
    assert [e.KIND for e in events] == ["checkpoint_stored", "last_committed", "best_committed", "phase_committed",
                                        "callback_checkpointed"]
    last = events[1]
    assert events[2].manifest == events[3].manifest == last.manifest
    manifest = read_manifest(state.store, last.manifest)
    restored = load_state(state.store, manifest)
    assert all(torch.equal(restored["model"][k], v) for k, v in net.state_dict().items())
    assert restored["callback/Artifact"] == {"epochs": 3}
    assert state.store.get(events[4].blob) == b"artifact at epoch 0"


def test_phases_rotate_and_name_what_they_drop(tmp_path):
    committer, state, log, net, _ = _committer(tmp_path, "recorded", phase_every=1, keep_phases=1)
    committer.submit(epoch=0, decision=None)
    state.recorder.lifecycle.state = "recorded"  # the next epoch's history, as the loop would append it
    committer.submit(epoch=1, decision=None)
    phases = [e for _, e in log.read() if e.KIND == "phase_committed"]
    assert [(p.name, p.removed) for p in phases] == [("epoch-0000", []), ("epoch-0001", ["epoch-0000"])]
    assert committer.phases == ["epoch-0001"]


def test_a_deferred_commit_appends_last_after_lag_updates(tmp_path):
    committer, state, log, net, _ = _committer(tmp_path, "in_epoch~", lag=2)
    committer.submit(epoch=0, covers=7, decision=None)
    assert committer.pending is not None
    committer.on_update()
    state.recorder.flush()
    assert not [e for _, e in log.read() if e.KIND == "last_committed"]
    committer.on_update()
    assert committer.pending is None
    (last,) = [e for _, e in log.read() if e.KIND == "last_committed"]
    assert last.covers == 7 and last.epoch == 0
    committer.close()


def test_the_final_refresh_names_the_last_manifest_again_when_nothing_changed(tmp_path):
    committer, state, log, net, _ = _committer(tmp_path, "training")
    committer.commit_now(epoch=-1)
    state.recorder.lifecycle.state = "finalizing"
    committer.commit_now(epoch=-1, final=True, state_may_have_changed=False)
    lasts = [e for _, e in log.read() if e.KIND == "last_committed"]
    assert len(lasts) == 2 and lasts[1].final and lasts[1].manifest == lasts[0].manifest
    assert [e.KIND for _, e in log.read()].count("checkpoint_stored") == 1  # nothing captured again


def test_checkpoint_lag_reads_epoch_and_refuses_other_values():
    import pytest

    from nnx_es.errors import ConfigError

    assert checkpoint_lag(0) == 0 and checkpoint_lag(3) == 3 and checkpoint_lag("epoch") > 10**12
    for bad in (-1, True, "1", 1.5):
        with pytest.raises(ConfigError, match="checkpoint_lag"):
            checkpoint_lag(bad)
