"""Scenario script under torchrun for global records: per-row records (in the log, in a history journal,
across a resume), torchmetrics metrics, and the parameters a run commits -- each against one process
on the union of the ranks' batches (the tests compute it).

    python -m torch.distributed.run ... tests/distributed/records_scenarios.py OUT_DIR rows_ddp,...
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import scenario_base  # noqa: E402
import scenarios  # noqa: E402
from nnx_es.runtime.run_state import World  # noqa: E402

N_VAL = 9  # odd: the ranks' validation shards differ in size (5 and 4 rows)


def val_data() -> TensorDataset:
    """x (9, 5), y (9,) in 0..2."""
    g = torch.Generator().manual_seed(23)
    return TensorDataset(torch.randn(N_VAL, 5, generator=g), torch.randint(0, 3, (N_VAL,), generator=g))


def unit_weights() -> TensorDataset:
    """:func:`ddpkit.dataset` with its weights 2.5 made 1 (torchmetrics takes rows of weight 0 or 1 only)."""
    import ddpkit

    x, y, w = ddpkit.dataset().tensors
    return TensorDataset(x, y, torch.where(w > 0, torch.ones_like(w), w))


def torchmetrics_of() -> dict[str, Any]:
    import torchmetrics

    return {"f1": torchmetrics.classification.MulticlassF1Score(num_classes=3, average="macro"),
            "auroc": torchmetrics.classification.MulticlassAUROC(num_classes=3)}


def _columns(view: Any) -> dict[str, list]:
    c = view.columns()
    return {k: v.tolist() for k, v in c.items()}


def _fit_rows(world: World, out: Path, run_id: str, epochs: int, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """Per-row records of a DDP fit; ``seen``: what ctx.idps showed this rank at each epoch's end."""
    import ddpkit
    from nnx_es import LambdaCallback
    from nnx_es.distributed import DDP, train_loader, validation_loader
    from nnx_es.rows import with_row_ids

    seen: dict[str, Any] = {}

    def look(ctx: Any) -> None:
        seen[str(ctx.epoch)] = {"epochs": list(ctx.idps.epochs), "rows": len(ctx.idps)}

    fit = kw.pop("fit", {})
    model = ddpkit.net()
    t = ddpkit.trainer(model, runs_root=out / "runs", run_id=run_id, distributed=DDP(timeout_seconds=30),
                       callbacks=[LambdaCallback(name="look", distributed="all", on_epoch_end=look)], **kw)
    result = t.fit(train_loader(with_row_ids(ddpkit.dataset()), ddpkit.BATCH, seed=ddpkit.SEED),
                   validation_loader(with_row_ids(val_data()), 2), epochs=epochs, **fit)
    return t, {"seen": seen, "status": result.status, "digest": ddpkit.digest(model)}


@scenario_base.case
def rows_ddp(world: World, out: Path) -> dict[str, Any]:
    """Records in the log (2 epochs); then a journal run of 1 epoch resumed to 2 (window 2)."""
    from nnx_es.audit import audit_run
    from nnx_es.rows import HistoryJournal, read_rows

    t, got = _fit_rows(world, out, "rows", 2)
    _fit_rows(world, out, "journal", 1, history=HistoryJournal(window=2, chunk_rows=5))
    tj, resumed = _fit_rows(world, out, "journal", 2, history=HistoryJournal(window=2, chunk_rows=5),
                            fit={"resume_from": out / "runs" / "journal"})
    got["resumed"] = resumed
    if world.is_writer:
        got["records"] = _columns(read_rows(t.run_dir))
        got["journal_records"] = _columns(read_rows(tj.run_dir))
        got["audit"] = [audit_run(t.run_dir).ok, audit_run(tj.run_dir).ok]
    return got


@scenario_base.case
def rows_padded(world: World, out: Path) -> dict[str, Any]:
    """Records over a partition that pads (25 rows, 2 ranks, policy 'pad'): refused before training."""
    import ddpkit
    from nnx_es.distributed import DDP, train_loader
    from nnx_es.rows import with_row_ids

    x, y, w = ddpkit.dataset(25).tensors
    t = ddpkit.trainer(ddpkit.net(), runs_root=out / "padded", run_id="padded", distributed=DDP(timeout_seconds=30))
    try:
        t.fit(train_loader(with_row_ids(TensorDataset(x, y, w)), ddpkit.BATCH, seed=ddpkit.SEED), epochs=1)
        got: dict[str, Any] = {"raised": None}
    except Exception as exc:  # noqa: BLE001
        got = {"raised": scenario_base.error(exc)}
    got["wrote"] = (out / "padded").exists()
    return got


@scenario_base.case
def torchmetrics_ddp(world: World, out: Path) -> dict[str, Any]:
    """F1 and AUROC (torchmetrics) in training and validation on 2 ranks."""
    import ddpkit
    from nnx_es.distributed import DDP, train_loader, validation_loader

    t = ddpkit.trainer(ddpkit.net(), runs_root=out / "runs", run_id="tm", distributed=DDP(timeout_seconds=30),
                       metrics=torchmetrics_of())
    result = t.fit(train_loader(unit_weights(), ddpkit.BATCH, seed=ddpkit.SEED), validation_loader(val_data(), 2),
                   epochs=2)
    return {"history": [{**r.train, **r.val} for r in result.history]}


@scenario_base.case
def union_params(world: World, out: Path) -> dict[str, Any]:
    """The committed parameters of the reference DDP fit (scenario_base.train, 2 epochs)."""
    import ddpkit

    model, _, _ = scenario_base.train(world, out, "union")
    return {"params": ddpkit.params(model), "digest": ddpkit.digest(model)}


if __name__ == "__main__":
    scenarios.main()
