"""Exact resume after a SIGKILL, weights-only continuations, and a verified resume point."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from torch import nn

from crashkit import kill_at_event, run_killed
from events.log import LmdbLog
from events.schema import LastCommitted, RunResumed, RunStarted, UpdateCommitted
from nnx_es import Callback, EarlyStopping, Trainer, checkpoint
from nnx_es.runtime import components as snapshot
from nnx_es.checkpoint import read_manifest
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.storage import BlobStore
from projections import committed, project
from trainkit import loaders, read_blob, read_events, small_net, write_blob

torch.set_num_threads(1)  # fork-safe parent

EPOCHS = 4


class BatchLog(Callback):
    """Stateful callback: counts epochs (checkpointed) and records each batch's targets (not checkpointed)."""

    def __init__(self) -> None:
        self.epochs_seen = 0
        self.batches: dict[int, list[list[int]]] = {}

    def on_batch_end(self, ctx):
        self.batches.setdefault(ctx.epoch, []).append(ctx.batch[1].tolist())

    def on_epoch_end(self, ctx):
        self.epochs_seen += 1

    def state_dict(self):
        return {"epochs_seen": self.epochs_seen}

    def load_state_dict(self, state):
        self.epochs_seen = state["epochs_seen"]


def make_trainer(runs: Path, run_id: str | None, batch_log: BatchLog | None = None, seed: int = 0) -> Trainer:
    net = small_net(seed)
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    return Trainer(
        net, opt, nn.CrossEntropyLoss(), monitor="val_loss", schedulers=[plateau],
        callbacks=[EarlyStopping(patience=50), batch_log or BatchLog()], accumulation=2,
        runs_root=runs, run_id=run_id, seed=seed, progress=False, phase_every=1, keep_phases=2,
    )


def fit(trainer: Trainer, **kw):
    return trainer.fit(*loaders(batch_size=8, n_train=48), epochs=EPOCHS, **kw)


def _history(run) -> list:
    return [msgspec.structs.replace(r, wall_time_s=0.0) for r in run.history]


def _step_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(e.step, e.loss) for _, e in committed(read_events(run_dir)) if isinstance(e, UpdateCommitted)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    runs = tmp_path_factory.mktemp("ref")
    log = BatchLog()
    trainer = make_trainer(runs, "ref", log)
    run = fit(trainer)
    kinds = [e.KIND for _, e in read_events(run.run_dir)]
    return {"run": run, "params": trainer.net.state_dict(), "batches": log.batches, "kinds": kinds,
            "events": read_events(run.run_dir)}


def _index(kinds: list[str], kind: str, occurrence: int) -> int:
    return [i for i, k in enumerate(kinds) if k == kind][occurrence]


CASES = {
    # name -> (kind, occurrence): SIGKILL just before that event is written
    "first_epoch_first_microbatch": ("microbatch_done", 0),
    "first_epoch_mid_window": ("update_committed", 1),
    "between_epochs_after_last": ("best_committed", 1),
    "epoch_2_mid_epoch": ("microbatch_done", 2 * 6 + 3),
    "epoch_3_before_history": ("history_appended", 3),
    "during_finalization": ("callback_finalized", 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_after_sigkill_is_bitwise_identical_to_the_uninterrupted_run(case, reference, tmp_path):
    kind, occurrence = CASES[case]
    at = _index(reference["kinds"], kind, occurrence)
    runs = tmp_path / "runs"
    outcome = run_killed(lambda: fit(make_trainer(runs, "r")), kill_at_event(at))
    assert outcome == "killed"
    before = read_events(runs / "r")
    batch_log = BatchLog()
    resumed_trainer = make_trainer(runs, None, batch_log)
    run = fit(resumed_trainer, resume_from=runs / "r")
    # parameters: bitwise
    ref_params = reference["params"]
    for k, v in resumed_trainer.net.state_dict().items():
        assert torch.equal(v, ref_params[k]), k
    # committed history: identical (wall-clock fields aside)
    assert _history(run) == _history(reference["run"])
    # scenario: every committed step's loss equals the uninterrupted run's, exactly
    assert _step_losses(runs / "r") == _step_losses(reference["run"].run_dir)
    # scenario: the shuffled batch order of every resumed epoch equals the uninterrupted order
    for epoch, batches in batch_log.batches.items():
        assert batches == reference["batches"][epoch], epoch
    # the log records the resume and the discarded tail, which stays in the log for audit
    after = read_events(runs / "r")
    assert after[: len(before)] == before
    resumed = [e for _, e in after if isinstance(e, RunResumed)]
    assert len(resumed) == 1
    r = resumed[0]
    last_seqs = [s for s, e in before if isinstance(e, LastCommitted)]
    assert r.last_seq in last_seqs
    assert r.discard_to == len(before) and r.discard_from <= r.discard_to
    # the range starts at the first event the committed view left out, and holds all of them
    kept = {s for s, _ in committed(before)}
    left_out = [s for s, _ in before if s not in kept]
    assert left_out == [s for s in range(r.discard_from, r.discard_to) if s not in kept]
    assert not left_out or left_out[0] == r.discard_from
    # the resumed session trained only the remaining epochs
    trained = sorted(batch_log.batches)
    assert trained == list(range(r.epoch + 1, EPOCHS))


def test_a_resumed_run_with_nothing_left_trains_no_epoch(reference, tmp_path):
    runs = tmp_path / "runs"
    fit(make_trainer(runs, "done"))
    batch_log = BatchLog()
    run = fit(make_trainer(runs, None, batch_log), resume_from=runs / "done")
    assert batch_log.batches == {} and len(run.history) == EPOCHS and run.status == "completed"


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "lock.mdb"}


def test_weights_only_starts_a_new_run_recording_its_source_and_never_writes_the_source(reference, tmp_path):
    runs = tmp_path / "runs"
    src = fit(make_trainer(runs, "src"))
    before = _tree_digest(runs / "src")
    trainer = make_trainer(runs, "child")
    with torch.no_grad():
        for p in trainer.net.parameters():
            p.zero_()
    child = trainer.fit(*loaders(batch_size=8), epochs=0, resume_from=runs / "src", resume_mode="weights_only")
    assert _tree_digest(runs / "src") == before
    started = [e for _, e in read_events(child.run_dir) if isinstance(e, RunStarted)][0]
    src_last_seq = [s for s, e in read_events(runs / "src") if isinstance(e, LastCommitted)][-1]
    assert started.source is not None
    assert (started.source.run_id, started.source.last_seq, started.source.manifest) == (
        "src", src_last_seq, src.last.manifest)
    # weights came from the source's LAST; nothing else (counters start at zero)
    src_params = make_trainer(runs / "x", "y").net  # fresh net to load into
    from nnx_es import NNModel

    m = NNModel(src_params)
    m.load(runs / "src", "last")
    for k, v in trainer.net.state_dict().items():
        assert torch.equal(v, m.net.state_dict()[k])
    assert child.counters.step == 0


def test_weights_only_refuses_to_write_into_its_source(tmp_path):
    runs = tmp_path / "runs"
    fit(make_trainer(runs, "src"))
    with pytest.raises(Exception, match="own run"):
        make_trainer(runs, "src").fit(*loaders(), epochs=1, resume_from=runs / "src", resume_mode="weights_only")


def _last_manifest(run_dir: Path) -> str:
    return project(read_events(run_dir)).checkpoints.last.manifest


def _break_empty(run_dir: Path, digest: str) -> str:
    write_blob(run_dir, digest, b"")
    return "is empty"


def _break_torn(run_dir: Path, digest: str) -> str:
    write_blob(run_dir, digest, read_blob(run_dir, digest)[:-7])
    return "corrupt"


def _break_blob(run_dir: Path, digest: str) -> str:
    from nnx_es.checkpoint import read_manifest

    m = read_manifest(BlobStore(run_dir / "blobs"), digest)
    data = bytearray(read_blob(run_dir, m.components["model"].blob))
    data[10] ^= 0x01
    write_blob(run_dir, m.components["model"].blob, bytes(data))
    return m.components["model"].blob


def _break_missing(run_dir: Path, digest: str) -> str:
    write_blob(run_dir, digest, None)
    return "missing"


@pytest.mark.parametrize("breaker", [_break_empty, _break_torn, _break_blob, _break_missing])
def test_a_bad_last_is_refused_with_a_named_reason_and_history_is_kept(breaker, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    if breaker is _break_blob:  # the model in a blob file of its own, as a model too big to keep inline is
        monkeypatch.setattr(checkpoint, "INLINE_MAX", 0)
    fit(make_trainer(runs, "r"))
    expected = breaker(runs / "r", _last_manifest(runs / "r"))
    before = read_events(runs / "r")
    with pytest.raises(ResumeError, match=expected):
        fit(make_trainer(runs, None), resume_from=runs / "r")
    assert read_events(runs / "r") == before  # nothing erased, nothing appended


def test_a_mixed_last_from_another_run_is_refused(tmp_path):
    runs = tmp_path / "runs"
    fit(make_trainer(runs, "a"))
    fit(make_trainer(runs, "b"))
    # b's LAST names a's manifest (blobs copied over): mixed
    a_manifest = _last_manifest(runs / "a")
    for p in (runs / "a" / "blobs").rglob("*"):
        if p.is_file():
            dest = runs / "b" / "blobs" / p.relative_to(runs / "a" / "blobs")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(p.read_bytes())
    with LmdbLog(runs / "b" / "events.lmdb") as log:
        last = [e for _, e in log.read() if isinstance(e, LastCommitted)][-1]
        log.commit(msgspec.structs.replace(last, manifest=a_manifest))
    with pytest.raises(ResumeError, match="mixed"):
        fit(make_trainer(runs, None), resume_from=runs / "b")


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/nnx_es_pwned_marker",))


def test_a_pickle_payload_that_would_run_code_is_refused_on_resume(tmp_path):
    marker = Path("/tmp/nnx_es_pwned_marker")
    marker.unlink(missing_ok=True)
    runs = tmp_path / "runs"
    fit(make_trainer(runs, "r"))
    from nnx_es.checkpoint import component_bytes, read_manifest, write_checkpoint

    store = BlobStore(runs / "r" / "blobs")  # opens the log for each read, closes it after
    m = read_manifest(store, _last_manifest(runs / "r"))
    parts = {}
    for name, comp in m.components.items():
        parts[name] = (comp.codec, component_bytes(store, name, comp))
    buf = __import__("io").BytesIO()
    torch.save({"weight": _Evil()}, buf, _use_new_zipfile_serialization=True, pickle_module=pickle)
    parts["model"] = ("torch", buf.getvalue())
    digest, _ = write_checkpoint(store, run_id="r", epoch=m.epoch, step=m.step, counters=m.counters, parts=parts)
    with LmdbLog(runs / "r" / "events.lmdb") as log:
        last = [e for _, e in log.read() if isinstance(e, LastCommitted)][-1]
        log.commit(msgspec.structs.replace(last, manifest=digest))
    with pytest.raises(Exception, match="safe loader|refuses|Unsafe|weights_only"):
        fit(make_trainer(runs, None), resume_from=runs / "r")
    assert not marker.exists()


def test_a_numpy_learning_rate_resumes_exactly(tmp_path):
    """np.float32 arithmetic differs from float's: the optimizer's lr must come back as it was."""

    def trainer(runs: Path, run_id: str | None) -> Trainer:
        net = small_net(0)
        opt = torch.optim.Adam(net.parameters(), lr=np.float32(0.02))
        return Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=runs, run_id=run_id, seed=0, progress=False)

    clean = trainer(tmp_path / "clean", "r")
    fit(clean)
    runs = tmp_path / "runs"
    assert run_killed(lambda: fit(trainer(runs, "r")), kill_at_event(40)) == "killed"
    resumed = trainer(runs, None)
    fit(resumed, resume_from=runs / "r")
    lr = next(iter(resumed.optimizers.values())).param_groups[0]["lr"]
    assert type(lr) is np.float32
    for k, v in clean.net.state_dict().items():
        assert torch.equal(v, resumed.net.state_dict()[k]), k


class Tag:
    """A custom object in a param group: torch.save pickles it, weights_only refuses it."""


def _unpicklable(x):
    return x


_unpicklable.__qualname__ = "<lambda>"  # as a lambda is: pickle cannot look it up by name


@pytest.mark.parametrize("value, why", [
    (Tag(), r"holds a value no safe loader can read back \(.*Tag\)"),
    (_unpicklable, r"holds a value that cannot be saved \(Can't pickle"),
])
def test_a_state_no_safe_loader_can_read_is_refused_when_written_not_at_resume(tmp_path, value, why):
    net = small_net(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt.param_groups[0]["extra"] = value
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=tmp_path, run_id="r", progress=False)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ConfigError, match=r"component 'optimizer/sgd' " + why):
        fit(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # refused before any update
    assert not [e for _, e in read_events(tmp_path / "r") if isinstance(e, LastCommitted)]


@pytest.mark.parametrize("codec", ["tensors", "torch"])
def test_resume_loads_through_the_safe_loader_only(reference, tmp_path, monkeypatch, codec):
    runs = tmp_path / "runs"
    if codec == "torch":  # state dicts the tensors codec cannot hold go through torch.save
        monkeypatch.setattr(snapshot, "encode_state", lambda state: None)
    outcome = run_killed(lambda: fit(make_trainer(runs, "r")), kill_at_event(_index(reference["kinds"], "epoch_began", 2)))
    assert outcome == "killed"
    manifest = read_manifest(BlobStore(runs / "r" / "blobs"), _last_manifest(runs / "r"))
    states = [c.codec for n, c in manifest.components.items() if n.split("/")[0] in ("model", "optimizer", "scheduler")]
    assert len(states) >= 2 and set(states) == {codec}
    calls = []
    real_load = torch.load

    def guarded_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("pickle.loads must not be used on resume")

    monkeypatch.setattr(torch, "load", guarded_load)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    trainer = make_trainer(runs, None)
    fit(trainer, resume_from=runs / "r")
    # the tensors codec unpickles nothing; torch.save'd states load with weights_only only
    assert (calls == []) if codec == "tensors" else (calls and all(c is True for c in calls))
    for k, v in trainer.net.state_dict().items():
        assert torch.equal(v, reference["params"][k])


def test_rotating_phases_never_drop_an_old_phase_before_the_new_one_is_committed(reference):
    events = reference["events"]
    committed_phases: list[str] = []
    for seq, e in events:
        if e.KIND == "phase_committed":
            assert e.name not in e.removed
            # the removal and the new pointer are one event: no prefix of the log has fewer phases
            before = len(committed_phases)
            committed_phases = [p for p in committed_phases if p not in e.removed] + [e.name]
            assert len(committed_phases) >= min(before, 2)
            assert len(committed_phases) <= 2
        state = project(events[: seq + 1]).checkpoints.phases
        assert set(state) <= set(committed_phases) | set()
    assert committed_phases == [f"epoch-{EPOCHS - 2:04d}", f"epoch-{EPOCHS - 1:04d}"]
    # every phase that was ever committed still has its blobs (nothing is deleted)
