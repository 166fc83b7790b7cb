"""Scenario cases, parts 2-3: the trainer path (one exact update, refusals, evaluate) and agreed records and decisions."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nnx_es.distributed import DDP  # noqa: E402
from nnx_es.runtime.run_state import World  # noqa: E402
from scenario_base import case, error, train  # noqa: E402


# --- part 2: the trainer path ------------------------------------------------------------


@case
def equivalence(world: World, out: Path) -> dict[str, Any]:
    import ddpkit

    model, t, result = train(world, out, "equiv")
    return {"params": ddpkit.params(model), "digest": ddpkit.digest(model), "status": result.status,
            "steps": result.counters.step, "wrapped": type(t.net).__name__,
            "keys": sorted(model.state_dict()), "runs_listing": sorted(p.name for p in (out / "runs").iterdir())
            if (out / "runs").exists() else []}


def _fit_rows(out: Path, run_id: str, data: Any, **kw: Any) -> tuple[Any, Any]:
    import ddpkit
    from nnx_es.distributed import DDP, train_loader

    model = ddpkit.net()
    t = ddpkit.trainer(model, runs_root=out / "runs", run_id=run_id, distributed=DDP(timeout_seconds=30),
                       accumulation=1, **kw)
    result = t.fit(train_loader(data, 2, shuffle=False), epochs=1)
    return model, result


@case
def ignored_targets(world: World, out: Path) -> dict[str, Any]:
    """Unweighted CrossEntropyLoss with ignore_index targets, unequal per rank (rank 0 holds more):
    every update is torch's mean over the union's kept targets (the staged W carries them)."""
    import ddpkit
    from nnx_es import Trainer
    from nnx_es.distributed import DDP, train_loader

    x, y = ddpkit.ignored_data()
    model = ddpkit.net()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), torch.nn.CrossEntropyLoss(),
                runs_root=out / "runs", run_id="ignored", distributed=DDP(timeout_seconds=30), progress=False)
    result = t.fit(train_loader(torch.utils.data.TensorDataset(x, y), 2, shuffle=False), epochs=1)
    return {"params": ddpkit.params(model), "digest": ddpkit.digest(model), "steps": result.counters.step,
            "status": result.status}


@case
def masked_window(world: World, out: Path) -> dict[str, Any]:
    """Rows are dealt in order (rank r: r, r+2, ...), 2 per batch. Batch 0: every weight 0 on both ranks
    (W == 0: skipped everywhere); batch 1: 0 on rank 0 only (W > 0: committed everywhere)."""
    import ddpkit

    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    y = torch.arange(12) % 3
    w = torch.ones(12)
    w[[0, 1, 2, 3, 4, 6]] = 0.0
    model, result = _fit_rows(out, "masked", torch.utils.data.TensorDataset(x, y, w))
    return {"digest": ddpkit.digest(model), "steps": result.counters.step, "status": result.status}


@case
def nonfinite_window(world: World, out: Path) -> dict[str, Any]:
    """A NaN feature in rank 1's batch 1 only: that update is skipped on both ranks."""
    import ddpkit

    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    x[5, 2] = float("nan")  # row 5: rank 1, its batch 1 (rows 5, 7)
    y = torch.arange(12) % 3
    model, result = _fit_rows(out, "nonfinite", torch.utils.data.TensorDataset(x, y, torch.ones(12)))
    return {"digest": ddpkit.digest(model), "steps": result.counters.step, "status": result.status,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


@case
def refusals(world: World, out: Path) -> dict[str, Any]:
    import ddpkit
    from nnx_es.distributed import DDP

    got: dict[str, Any] = {}
    try:
        ddpkit.trainer(torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3)), runs_root=out / "r",
                       run_id="bn", distributed=DDP())
    except Exception as exc:  # noqa: BLE001
        got["batchnorm"] = [type(exc).__name__, str(exc)]
    try:
        t = ddpkit.trainer(ddpkit.net(), runs_root=out / "r", run_id="single")
        t.fit([(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), torch.ones(2))], epochs=1)
    except Exception as exc:  # noqa: BLE001
        got["single"] = [type(exc).__name__, str(exc)]
    got["wrote"] = (out / "r").exists()
    return got


@case
def not_alike(world: World, out: Path) -> dict[str, Any]:
    """Found by a fresh user (issue 13): a setting that differs on one rank trained something else there and the
    run completed (a loss argument, the learning rate, the window, epochs, the data, a callback); each is
    refused on both ranks before training. A writer-only callback and a partition of the user's own
    (each rank its own rows) are not differences."""
    import ddpkit
    from nnx_es import LambdaCallback
    from nnx_es.distributed import DDP, train_loader, writer_only

    one = world.rank == 1
    got: dict[str, Any] = {}

    def fit(name: str, *, loss: Any = None, lr: float = 0.2, data: Any = None, epochs: int = 1,
            loader: Any = None, ddp: Any = None, model: Any = None, gamma: float | None = None, **kw: Any) -> None:
        model = model or ddpkit.net()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        from nnx_es import Scheduler, Trainer

        if gamma is not None:
            kw["schedulers"] = [Scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma))]
        t = Trainer(model, opt, loss or torch.nn.CrossEntropyLoss(), runs_root=out / "na", run_id=name,
                    distributed=ddp or DDP(timeout_seconds=30), progress=False, sample_weights=True, **kw)
        try:
            t.fit(loader or train_loader(data or ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED), epochs=epochs)
            got[name] = "completed"
        except Exception as exc:  # noqa: BLE001
            got[name] = error(exc)

    fit("loss", loss=torch.nn.CrossEntropyLoss(label_smoothing=0.5 if one else 0.0))
    fit("lr", lr=0.4 if one else 0.2)
    fit("accumulation", accumulation=2 if one else 1)
    fit("epochs", epochs=2 if one else 1)
    other = ddpkit.dataset()
    if one:
        other.tensors[0][0] += 1.0  # the same length and shapes: another data set all the same
    fit("data", data=other)
    fit("callback", callbacks=[LambdaCallback(name="extra", distributed="all")] if one else [])
    # a second fresh user's: what the first comparison missed
    import functools

    from nnx_es import EMA, EarlyStopping

    fit("partial_loss", loss=functools.partial(torch.nn.functional.cross_entropy, reduction="none",
                                               label_smoothing=0.3 if one else 0.0))
    fit("train_step_fn", train_step_fn=lambda net, batch, s=2.0 if one else 1.0: (net(batch[0] * s), batch[1], batch[2]))
    # a third fresh user's: what a process keeps of its own is no difference of the recipe
    import os
    import time

    class Stamped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.started_at, self.pid = ddpkit.net(), time.time(), os.getpid()

        def forward(self, x: Any) -> Any:
            return self.net(x)

    started = time.time()
    ce = torch.nn.functional.cross_entropy
    fit("process_specific", model=Stamped(),
        loss=lambda out, y: ce(out, y, reduction="none") + 0.0 * (time.time() - started))
    fit("dropout", model=torch.nn.Sequential(ddpkit.net(), torch.nn.Dropout(0.5 if one else 0.0)))
    fit("ema", hooks=[EMA(0.5 if one else 0.99)])
    fit("patience", callbacks=[EarlyStopping(patience=1 if one else 50)], monitor="loss")
    fit("gamma", gamma=0.5 if one else 0.9)
    fit("recipe", recipe={"data_dir": f"/host{world.rank}/data"})  # metadata: logged, not refused
    fit("writer_callback", callbacks=[writer_only(lambda: LambdaCallback(name="w", distributed="writer"))])
    own = torch.utils.data.DataLoader(torch.utils.data.Subset(ddpkit.dataset(), range(world.rank, 24, 2)), batch_size=5)
    fit("own_partition", loader=own, ddp=DDP(timeout_seconds=30, own_partition=True))
    got["wrote"] = sorted(p.name for p in (out / "na").iterdir()) if (out / "na").exists() else []
    return got


@case
def partition_mismatch(world: World, out: Path) -> dict[str, Any]:
    """Train partitions the ranks do not share: each rank seeded by its rank (rows overlap and go
    missing, yet every rank takes the same number of steps), and a loader built for another rank."""
    import ddpkit
    from nnx_es.distributed import DDP, train_loader

    got: dict[str, Any] = {}
    loaders = {"seed_per_rank": train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=world.rank),
               "rank_zero_everywhere": train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED, rank=0,
                                                    world_size=world.size),
               "one_process_loader": train_loader(torch.utils.data.Subset(ddpkit.dataset(), range(12)), ddpkit.BATCH, seed=ddpkit.SEED, rank=0,
                                                  world_size=1)}
    for name, loader in loaders.items():
        t = ddpkit.trainer(ddpkit.net(), runs_root=out / "pm", run_id=name, distributed=DDP(timeout_seconds=30))
        try:
            t.fit(loader, epochs=1)
            got[name] = None
        except Exception as exc:  # noqa: BLE001
            got[name] = error(exc)
    got["wrote"] = sorted(p.name for p in (out / "pm").iterdir()) if (out / "pm").exists() else []
    return got


@case
def validation_mismatch(world: World, out: Path) -> dict[str, Any]:
    """Validation loaders that would score some row twice (padding) or never, under DDP."""
    import ddpkit
    from torch.utils.data import DataLoader, DistributedSampler

    from nnx_es.distributed import DDP, train_loader, validation_loader

    val = torch.utils.data.Subset(ddpkit.dataset(), range(7))  # 7 rows on 2 ranks: padding repeats one
    loaders = {"train_loader_as_val": train_loader(val, 4, seed=0),
               "distributed_sampler": DataLoader(val, batch_size=4, sampler=DistributedSampler(val, shuffle=False)),
               "shard_for_rank_zero": validation_loader(val, 4, rank=0, world_size=world.size),
               # found by a fresh user: a plain DataLoader scored every row on every rank, and one rank's
               # plain loader beside the other's shard completed with another val_loss than the union's
               "plain": DataLoader(val, batch_size=4),
               "mixed": DataLoader(val, batch_size=4) if world.rank == 1 else validation_loader(val, 4),
               "own_partition": DataLoader(torch.utils.data.Subset(val, range(world.rank, 7, 2)), batch_size=4),
               "fine": validation_loader(val, 4)}
    got: dict[str, Any] = {}
    for name, loader in loaders.items():
        ddp = DDP(timeout_seconds=30, own_partition=name == "own_partition")  # its own shard: said so
        t = ddpkit.trainer(ddpkit.net(), runs_root=out / "vm", run_id=name, distributed=ddp)
        try:
            got[name] = t.fit(train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED), loader,
                              epochs=1).status
        except Exception as exc:  # noqa: BLE001
            got[name] = error(exc)
    return got


@case
def evaluate_record(world: World, out: Path) -> dict[str, Any]:
    """NNModel.evaluate(record=True) on every rank after a DDP train: each rank holds only its shard."""
    import ddpkit

    from nnx_es import NNModel
    from nnx_es.distributed import DDP, train_loader, validation_loader

    model = NNModel(ddpkit.net())
    val = validation_loader(torch.utils.data.Subset(ddpkit.dataset(), range(7)), 4)
    model.train(train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED), val, epochs=1,
                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss=torch.nn.CrossEntropyLoss(),
                runs_root=out / "ev", run_id="ev", progress=False, distributed=DDP(timeout_seconds=30),
                sample_weights=True)
    got: dict[str, Any] = {"plain": sorted(model.evaluate(val, loss=torch.nn.CrossEntropyLoss(), sample_weights=True))}
    world.gather(None)  # both ranks trained and evaluated before either records
    try:
        got["recorded"] = model.evaluate(val, loss=torch.nn.CrossEntropyLoss(), sample_weights=True, record=True)
    except Exception as exc:  # noqa: BLE001
        got["recorded"] = error(exc)
    world.gather(None)
    from events.log import LmdbLog

    with LmdbLog(out / "ev" / "ev" / "events.lmdb", readonly=True) as log:
        got["evaluations"] = sum(1 for _ in log.read(kinds=("evaluation_recorded",)))
    return got


@case
def evaluate_mixed_weights(world: World, out: Path) -> dict[str, Any]:
    """A fresh user's eval_mixed.py: the writer loaded BEST, the other rank kept other weights, and
    NNModel.evaluate returned the metrics of a mix of two models on every rank."""
    import ddpkit

    from nnx_es import NNModel
    from nnx_es.distributed import validation_loader

    val = validation_loader(ddpkit.dataset(), 4)
    loss = torch.nn.CrossEntropyLoss()
    model = NNModel(ddpkit.net())  # seeded: the same weights on every rank
    got: dict[str, Any] = {"equal": model.evaluate(val, loss=loss, sample_weights=True)}
    if world.rank == 1:
        with torch.no_grad():
            model.net[0].bias.add_(1e-3)  # rank 1 did not load what the writer loaded
    try:
        got["mixed"] = model.evaluate(val, loss=loss, sample_weights=True)
    except Exception as exc:  # noqa: BLE001
        got["mixed"] = error(exc)
    if world.rank == 1:
        model.net.load_state_dict(ddpkit.net().state_dict())  # loaded on every rank: agreed again
    got["reloaded"] = model.evaluate(val, loss=loss, sample_weights=True)
    return got


@case
def plain_loader(world: World, out: Path) -> dict[str, Any]:
    """Found in review (issue 13): a plain DataLoader under DDP trained every rank on the same rows."""
    import ddpkit
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    from nnx_es.distributed import DDP

    data = ddpkit.dataset()
    cases = {"plain": (DataLoader(data, batch_size=5), DDP(timeout_seconds=30)),
             "shuffled": (DataLoader(data, batch_size=5, shuffle=True), DDP(timeout_seconds=30)),
             "list_of_batches": ([tuple(t[:5] for t in data.tensors)], DDP(timeout_seconds=30)),
             "distributed_sampler": (DataLoader(data, batch_size=5, sampler=DistributedSampler(data, shuffle=False)),
                                     DDP(timeout_seconds=30)),
             "own_partition": (DataLoader(Subset(data, range(world.rank, len(data), world.size)), batch_size=5),
                               DDP(timeout_seconds=30, own_partition=True))}
    got: dict[str, Any] = {}
    for name, (loader, ddp) in cases.items():
        model = ddpkit.net()
        t = ddpkit.trainer(model, runs_root=out / "pl", run_id=name, distributed=ddp)
        try:
            got[name] = t.fit(loader, epochs=1).status
        except Exception as exc:  # noqa: BLE001
            got[name] = error(exc)
    got["wrote"] = sorted(p.name for p in (out / "pl").iterdir() if not p.name.startswith(".")) \
        if (out / "pl").exists() else []  # run directories (the lease directory aside)
    return got


@case
def evaluate_whole(world: World, out: Path) -> dict[str, Any]:
    """Found in review (issue 13): NNModel.evaluate(loader) under DDP returned the rank's shard's metrics."""
    import ddpkit
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    from nnx_es import NNModel
    from nnx_es.batches import weighted_forward
    from nnx_es.distributed import DDP, train_loader, validation_loader
    from nnx_es.metrics import evaluate
    from nnx_es.objective import Objective

    model = NNModel(ddpkit.net())
    val_set = Subset(ddpkit.dataset(), range(7))
    val = validation_loader(val_set, 4)
    model.train(train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED), val, epochs=1,
                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss=torch.nn.CrossEntropyLoss(),
                runs_root=out / "ew", run_id="ew", progress=False, distributed=DDP(timeout_seconds=30),
                sample_weights=True)
    loss = torch.nn.CrossEntropyLoss()
    got: dict[str, Any] = {"gathered": model.evaluate(val, loss=loss, sample_weights=True)}
    objective = Objective(loss)
    got["whole"] = {k.removeprefix("val_"): v for k, v in evaluate(
        model.net, DataLoader(val_set, 7), objective, weighted_forward, ("accuracy",))[0].items()}
    got["shard"] = {k.removeprefix("val_"): v for k, v in evaluate(
        model.net, val, objective, weighted_forward, ("accuracy",))[0].items()}
    for name, loader in (("padded", DataLoader(val_set, batch_size=4, sampler=DistributedSampler(val_set, shuffle=False))),
                         ("training_partition", train_loader(val_set, 4, seed=0))):
        try:
            got[name] = model.evaluate(loader, loss=loss, sample_weights=True)
        except Exception as exc:  # noqa: BLE001
            got[name] = error(exc)
    return got


# --- part 3: records and decisions agreed ------------------------------------------------


class Seen:
    """What this rank decided each epoch (validation, the monitor, lrs, stop), to compare the ranks."""

    distributed = "all"

    def __init__(self, stop_rank: int | None = None, stop_epoch: int = 1) -> None:
        from nnx_es import Callback

        seen: list[dict[str, Any]] = []
        stop_rank_, stop_epoch_ = stop_rank, stop_epoch

        class _Seen(Callback):
            distributed = "all"

            def on_epoch_end(self, ctx: Any) -> None:
                d = ctx.decision
                seen.append({"epoch": ctx.epoch, "val": dict(ctx.validation or {}), "train": dict(ctx.train_metrics),
                             "improved": d.improved if d is not None else None,
                             "lrs": [g["lr"] for g in next(iter(ctx.optimizers.values())).param_groups]})
                if stop_rank_ is not None and ctx.state.world.rank == stop_rank_ and ctx.epoch == stop_epoch_:
                    ctx.request_stop("rank_local", f"rank {stop_rank_}")

        self.callback = _Seen()
        self.seen = seen


def _decide(out: Path, run_id: str, *, stop_rank: int | None, epochs: int = 4) -> dict[str, Any]:
    import ddpkit
    from nnx_es import EarlyStopping, Scheduler
    from nnx_es.distributed import DDP, train_loader, validation_loader

    model = ddpkit.net()
    seen = Seen(stop_rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    from nnx_es import Trainer

    plateau = Scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5), name="plateau")
    t = Trainer(model, opt, torch.nn.CrossEntropyLoss(), sample_weights=True, metrics=["accuracy"],
                monitor="val_loss", schedulers=[plateau], callbacks=[seen.callback, EarlyStopping(patience=1)],
                runs_root=out / "runs", run_id=run_id, distributed=DDP(timeout_seconds=30), progress=False)
    data = ddpkit.dataset()
    val = torch.utils.data.TensorDataset(*(x[:7] for x in ddpkit.dataset(31).tensors))
    result = t.fit(train_loader(data, ddpkit.BATCH, seed=ddpkit.SEED), validation_loader(val, 2), epochs=epochs)
    from nnx_es.batches import weighted_forward
    from nnx_es.metrics import evaluate

    world = t.state.world
    whole = evaluate(model, torch.utils.data.DataLoader(val, 7), t.objective, weighted_forward, ("accuracy",))
    shards = evaluate(model, validation_loader(val, 2), t.objective, weighted_forward, ("accuracy",), world=world)
    return {"seen": seen.seen, "status": result.status, "epochs": len(result.history), "whole": whole,
            "shards": shards, "shard_rows": len(validation_loader(val, 2).sampler),
            "history": [{"val": h.val, "train": h.train, "improved": h.improved} for h in result.history],
            "best": result.best_epoch, "digest": ddpkit.digest(model)}


@case
def decisions(world: World, out: Path) -> dict[str, Any]:
    return _decide(out, "decide", stop_rank=None)


@case
def local_stop(world: World, out: Path) -> dict[str, Any]:
    return _decide(out, "localstop", stop_rank=1)
