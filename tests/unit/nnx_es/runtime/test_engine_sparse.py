"""Sparse (COO) gradients in the update engine: the same updates, norms, skips and resumes as dense.

Every expectation comes from the same model with a dense embedding (``sparse=False``),
or from arithmetic written here -- never from a previous run of the sparse path.
The data always repeat embedding indices inside a window, so a gradient holds duplicate
indices: a norm that did not sum them first, or a division skipped for sparse
gradients, changes the numbers these tests compare.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from crashkit import kill_at_event, run_killed
from events.schema import LastCommitted
from nnx_es import Trainer
from nnx_es.checkpoint import read_manifest
from nnx_es.storage import BlobStore
from trainkit import of_kind, read_events

torch.set_num_threads(1)  # fork-safe parent (the resume test forks)

VOCAB, DIM, CLASSES, LR = 6, 4, 3, 0.5


class EmbedNet(nn.Module):
    """Embedding (VOCAB, DIM) -> Linear(DIM, CLASSES); the same weights for either layout.

    ``x``: int64 (B,) indices into the embedding, or float32 (B, DIM) fed to the linear
    layer directly (the embedding then gets no gradient in that microbatch).
    """

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e = nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.l = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(self.e(x) if x.dtype == torch.long else x)


def index_batches(sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Microbatches ``(x int64 (n,), y int64 (n,))`` of the given sizes over a VOCAB-word vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (n,), generator=g), torch.randint(0, CLASSES, (n,), generator=g)) for n in sizes]


SIZES = [7, 9, 8, 11, 7, 12]  # each > VOCAB: every microbatch repeats an index


def _fit(tmp: Path, sparse: bool, data, *, epochs: int = 2, opt_kw=None, **kw):
    net = EmbedNet(sparse)
    opt = torch.optim.SGD(net.parameters(), lr=LR, **(opt_kw or {}))
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=tmp / "runs", run_id="sparse" if sparse else "dense",
                      progress=False, **kw)
    run = trainer.fit(data, epochs=epochs)
    return trainer, run


def _windows(run_dir: Path) -> list[tuple]:
    """Each window's outcome: (kind, reason or clipped, grad_norm)."""
    out = []
    for _, e in read_events(run_dir):
        if e.KIND == "update_committed":
            out.append(("committed", e.clipped, e.grad_norm))
        elif e.KIND == "update_skipped":
            out.append(("skipped", e.reason, None))
    return out


def _assert_same_training(tmp: Path, data, **kw) -> None:
    """The sparse model's run equals the dense model's: weights, window outcomes and grad norms."""
    sparse, run_s = _fit(tmp / "s", True, data, **kw)
    dense, run_d = _fit(tmp / "d", False, data, **kw)
    assert sparse.engine.grads.sparse and not dense.engine.grads.sparse
    ws, wd = _windows(run_s.run_dir), _windows(run_d.run_dir)
    assert [w[:2] for w in ws] == [w[:2] for w in wd] and any(w[0] == "committed" for w in ws)
    for (_, _, ns), (_, _, nd) in zip(ws, wd):
        assert (ns is None) == (nd is None)
        if ns is not None:
            assert ns == pytest.approx(nd, rel=1e-6, abs=1e-9)
    d = dense.net.state_dict()
    for k, v in sparse.net.state_dict().items():
        assert torch.allclose(v, d[k], rtol=1e-6, atol=1e-7), k


# --- the reported failure -------------------------------------------------------------------------


def test_the_reported_sparse_embedding_model_trains_two_epochs(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(20, 4, sparse=True)
            self.l = nn.Linear(4, 3)

        def forward(self, x):
            return self.l(self.e(x))

    torch.manual_seed(0)
    net = M()
    before = net.e.weight.detach().clone()
    ds = torch.utils.data.TensorDataset(torch.randint(0, 20, (64,)), torch.randint(0, 3, (64,)))
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      progress=False)
    run = trainer.fit(torch.utils.data.DataLoader(ds, batch_size=16), epochs=2)
    assert len(of_kind(run.run_dir, "update_committed")) == 8 and not of_kind(run.run_dir, "update_skipped")
    assert not torch.equal(net.e.weight, before)


# --- the same updates as the dense model ----------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"accumulation": 3},
        {"clip_grad_norm": 0.05},
        {"accumulation": 3, "clip_grad_norm": 0.05},
        {"accumulation": 2, "track_grad_norm": True},
        {"accumulation": 3, "clip_grad_norm": 0.1, "precision": "fp16"},
    ],
    ids=["acc1", "acc3", "acc1_clipped", "acc3_clipped", "acc2_tracked_norm", "acc3_clipped_fp16"],
)
def test_a_sparse_embedding_trains_to_the_weights_of_the_dense_one(tmp_path, kw):
    data = index_batches(SIZES)
    assert all(len(set(x.tolist())) < len(x) for x, _ in data)
    _assert_same_training(tmp_path, data, **kw)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=7),
    accumulation=st.integers(1, 4),
    clip=st.sampled_from([None, 0.02, 0.3, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_any_windows_of_sparse_gradients_update_like_dense_ones(sizes, accumulation, clip, seed):
    with tempfile.TemporaryDirectory() as tmp:
        _assert_same_training(Path(tmp), index_batches(sizes, seed), epochs=1, accumulation=accumulation,
                              clip_grad_norm=clip, track_grad_norm=True)


def test_an_embedding_whose_gradient_first_appears_in_a_later_window_still_updates_like_dense(tmp_path):
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, DIM, generator=g), torch.randint(0, CLASSES, (4,), generator=g)) for _ in range(3)]
    data += index_batches([5, 6, 7], seed=4)  # the embedding is used from the 4th microbatch on
    _assert_same_training(tmp_path, data, epochs=1, accumulation=2, clip_grad_norm=0.05)


def test_a_dense_model_looks_at_its_gradient_layouts_in_the_first_window_only(tmp_path, monkeypatch):
    from nnx_es.grads import WindowGradients

    calls = []
    real = WindowGradients.strided
    monkeypatch.setattr(WindowGradients, "strided", lambda self: (calls.append(1), real(self))[1])
    trainer, run = _fit(tmp_path, False, index_batches(SIZES), clip_grad_norm=0.05)
    assert len(of_kind(run.run_dir, "update_committed")) == 2 * len(SIZES)
    assert calls == [1] and not trainer.engine.grads.sparse and trainer.engine.grads.unseen == []


# --- duplicates summed before the norm, and the division by W --------------------------------------


class Planted:
    """A hook on the embedding weight: its gradient in each microbatch becomes ``values`` at ``rows``
    (an uncoalesced sparse COO gradient, or the dense equivalent for a dense embedding)."""

    def __init__(self, rows: list[int], values: list[list[float]], sparse: bool) -> None:
        self.rows, self.values, self.sparse = rows, values, sparse

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        planted = torch.sparse_coo_tensor(torch.tensor([self.rows]), torch.tensor(self.values), (VOCAB, DIM),
                                          check_invariants=True)
        assert not planted.is_coalesced()
        return planted if self.sparse else planted.to_dense()


def _planted_runs(tmp_path, rows, values, data, **trainer_kw):
    """Train one epoch of SGD on the embedding alone, its gradient replaced by the planted one
    (sparse, then dense); yield (sparse, the weight change, the update's receipt)."""
    for sparse in (True, False):
        net = EmbedNet(sparse)
        before = net.e.weight.detach().clone()
        net.e.weight.register_hook(Planted(rows, values, sparse))
        net.l.requires_grad_(False)
        trainer = Trainer(net, torch.optim.SGD(net.e.parameters(), lr=LR), nn.CrossEntropyLoss(),
                          runs_root=tmp_path / str(sparse), progress=False, **trainer_kw)
        run = trainer.fit(data, epochs=1)
        (receipt,) = of_kind(run.run_dir, "update_committed")
        yield sparse, before - net.e.weight.detach(), receipt


def test_the_grad_norm_sums_duplicate_indices_before_squaring_and_follows_the_division_by_w(tmp_path):
    # each of two microbatches (2 and 3 rows: W = 5) plants row 1: [3, 0, 0, 0] and [4, 0, 0, 0];
    # the window's gradient is row 1 = (3 + 4 + 3 + 4) / 5 = 2.8, its norm 2.8 (not the norm of the
    # uncoalesced values, sqrt(50) / 5, nor the undivided 14)
    rows, values = [1, 1], [[3.0, 0, 0, 0], [4.0, 0, 0, 0]]
    for sparse, delta, receipt in _planted_runs(tmp_path, rows, values, index_batches([2, 3], seed=5),
                                                accumulation=2, track_grad_norm=True):
        expected = torch.zeros(VOCAB, DIM)
        expected[1, 0] = LR * 2.8
        assert torch.allclose(delta, expected, atol=1e-6), sparse
        assert receipt.grad_norm == pytest.approx(2.8, rel=1e-6), sparse


def test_clipping_scales_a_sparse_gradient_to_max_norm_like_a_dense_one(tmp_path):
    rows, values = [2, 2, 4], [[1.0, 2.0, 0, 0], [2.0, 2.0, 0, 0], [0, 0, 5.0, 0]]
    steps = {}
    for sparse, delta, receipt in _planted_runs(tmp_path, rows, values, index_batches([3], seed=6),
                                                clip_grad_norm=1.0):
        # the planted gradient, coalesced: row 2 = [3, 4], row 4 = [0, 0, 5]: norm sqrt(50)
        assert receipt.clipped and receipt.grad_norm == pytest.approx(math.sqrt(50.0), rel=1e-6)
        steps[sparse] = delta / LR
    assert torch.linalg.vector_norm(steps[True]).item() == pytest.approx(1.0, rel=1e-5)
    assert torch.allclose(steps[True], steps[False], atol=1e-7)


# --- a non-finite sparse gradient skips its window ---------------------------------------------------


class PlantOnce:
    """Replace the embedding's gradient in the first microbatch only (a sparse COO gradient of
    ``values`` at ``rows``); later microbatches keep their real gradient."""

    def __init__(self, rows: list[int], values: list[list[float]]) -> None:
        self.rows, self.values, self.calls = rows, values, 0

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        if self.calls > 1:
            return None
        return torch.sparse_coo_tensor(torch.tensor([self.rows]), torch.tensor(self.values), (VOCAB, DIM),
                                       check_invariants=True)


BAD = {
    "inf": ([0, 3], [[1.0, 0, 0, 0], [math.inf, 0, 0, 0]]),
    "nan": ([3, 0], [[1.0, 0, 0, 0], [0, math.nan, 0, 0]]),
    "-inf_duplicate": ([2, 2], [[-math.inf, 0, 0, 0], [1.0, 0, 0, 0]]),
    # each value finite; their sum at the duplicate index overflows float32, as the dense gradient's does
    "overflow_when_summed": ([5, 5], [[3e38, 0, 0, 0], [3e38, 0, 0, 0]]),
}


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("check", ["fused_check", "norm"])
def test_a_window_whose_sparse_gradient_is_not_finite_is_skipped_as_nonfinite(tmp_path, bad, check):
    rows, values = BAD[bad]
    data = index_batches([4, 5], seed=7)
    kw = {"track_grad_norm": True} if check == "norm" else {}
    net = EmbedNet(True)
    net.e.weight.register_hook(PlantOnce(rows, values))
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=LR), nn.CrossEntropyLoss(), runs_root=tmp_path / "r",
                      progress=False, **kw)
    run = trainer.fit(data, epochs=1)
    (skipped,) = of_kind(run.run_dir, "update_skipped")
    assert skipped.reason == "nonfinite" and skipped.detail == "a gradient is not finite"
    assert len(of_kind(run.run_dir, "update_committed")) == 1
    # the skipped window changed nothing: the weights are those of a run on the second microbatch alone
    ref, _ = _fit(tmp_path / "ref", True, data[1:], epochs=1, **kw)
    for k, v in ref.net.state_dict().items():
        assert torch.equal(trainer.net.state_dict()[k], v), k


# --- checkpoints and exact resume ------------------------------------------------------------------


def _resume_trainer(runs: Path, run_id: str | None, momentum: float) -> Trainer:
    net = EmbedNet(True)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=momentum)
    return Trainer(net, opt, nn.CrossEntropyLoss(), accumulation=2, clip_grad_norm=0.3, runs_root=runs,
                   run_id=run_id, progress=False, seed=0)


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["sgd", "sgd_sparse_momentum"])
def test_a_sparse_model_resumes_after_sigkill_bitwise_like_the_uninterrupted_run(tmp_path, momentum):
    epochs = 4
    ref = _resume_trainer(tmp_path / "ref", "ref", momentum)
    ref.fit(index_batches(SIZES), epochs=epochs)
    kinds = [e.KIND for _, e in read_events(tmp_path / "ref" / "ref")]
    at = [i for i, k in enumerate(kinds) if k == "microbatch_done"][2 * len(SIZES) + 3]  # mid epoch 2
    runs = tmp_path / "runs"
    outcome = run_killed(lambda: _resume_trainer(runs, "r", momentum).fit(index_batches(SIZES), epochs=epochs),
                         kill_at_event(at))
    assert outcome == "killed"
    last = [e for _, e in read_events(runs / "r") if isinstance(e, LastCommitted)][-1]
    codecs = {n: c.codec for n, c in read_manifest(BlobStore(runs / "r" / "blobs"), last.manifest).components.items()}
    # SGD's momentum buffer of a sparse gradient is itself sparse: the tensors codec refuses it, torch.save keeps it
    assert codecs["model"] == "tensors" and codecs["optimizer/sgd"] == ("torch" if momentum else "tensors")
    resumed = _resume_trainer(runs, None, momentum)
    resumed.fit(index_batches(SIZES), epochs=epochs, resume_from=runs / "r")
    for k, v in ref.net.state_dict().items():
        assert torch.equal(resumed.net.state_dict()[k], v), k
    assert _windows(runs / "r")[-2 * 3:] == _windows(tmp_path / "ref" / "ref")[-2 * 3:]
    if momentum:
        ref_state, res_state = ref.optimizers["sgd"].state, resumed.optimizers["sgd"].state
        for p_ref, p_res in zip(ref.net.parameters(), resumed.net.parameters()):
            a, b = ref_state[p_ref]["momentum_buffer"], res_state[p_res]["momentum_buffer"]
            assert a.layout == b.layout and torch.equal(a.to_dense(), b.to_dense())
        assert ref_state[ref.net.e.weight]["momentum_buffer"].is_sparse
