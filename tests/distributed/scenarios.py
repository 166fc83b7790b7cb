"""Scenario script run under torchrun: several cases one after another in ONE process group.

    python -m torch.distributed.run ... tests/distributed/scenarios.py OUT_DIR case1,case2,...

Each case is a function ``case(world, out_dir) -> dict`` run on every rank; its result (or the
error it raised: type and message) is written per rank as ``OUT_DIR/<case>.rank<r>.json``
(:func:`launch.write_result`). After each case the ranks meet at a bounded barrier, so a case
that fails on one rank only still leaves the next case a synchronized group.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import launch  # noqa: E402
from nnx_es.distributed import DDP, partition_indices, shard_indices, shutdown  # noqa: E402
from nnx_es.run_state import World  # noqa: E402

torch.set_num_threads(1)

Case = Callable[[World, Path], dict[str, Any]]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


# --- part 1: the group, agreement primitives, partitions ------------------------------------


@case
def agree(world: World, out: Path) -> dict[str, Any]:
    t = torch.tensor([float(world.rank + 1), 2.0 ** -30 * (world.rank + 1), float(world.rank)], dtype=torch.float64)
    world.agree(t, "sum")
    mx = world.agree(torch.tensor([float(world.rank)]), "max")
    return {"sum": t.tolist(), "max": mx.tolist(), "flag_any": world.agree_flag(world.rank == 1),
            "flag_none": world.agree_flag(False), "gathered": world.gather({"rank": world.rank}),
            "shared": world.share(f"from {world.rank}"), "size": world.size, "writer": world.is_writer,
            # one rank's object larger than the gather's frame: every rank grows it alike and gathers again
            "big": [len(x) for x in world.gather("x" * (100_000 if world.rank == 1 else 3))],
            "after_big": world.gather((world.rank, "y" * 5))}


@case
def partitions(world: World, out: Path) -> dict[str, Any]:
    from nnx_es.distributed import train_loader, validation_loader

    data = torch.utils.data.TensorDataset(torch.arange(11.0))
    tl = train_loader(data, 2, policy="pad", seed=3)
    rows = {}
    for epoch in (0, 1):
        tl.sampler.set_epoch(epoch)
        rows[epoch] = [int(x) for b in tl for x in b[0]]
    vl = validation_loader(data, 4)
    return {"train": rows, "val": [int(x) for b in vl for x in b[0]],
            "expect0": partition_indices(11, rank=world.rank, world_size=world.size, epoch=0, seed=3),
            "expect_val": shard_indices(11, rank=world.rank, world_size=world.size)}


@case
def fused_hook(world: World, out: Path) -> dict[str, Any]:
    """FusedAgreement on a float32 and a float64 model: the gradients bitwise those of DDP's own hook,
    the values summed exactly (float32 parts), a value the parts cannot carry summed in float64."""
    from torch.nn.parallel import DistributedDataParallel

    from nnx_es.distributed.fused import FusedAgreement, float32_sum

    got: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        base = torch.nn.Linear(6, 3).to(dtype)
        plain = DistributedDataParallel(base)
        fused_net = torch.nn.Linear(6, 3).to(dtype)
        fused_net.load_state_dict(base.state_dict())
        fused_ddp = DistributedDataParallel(fused_net)
        agreement = FusedAgreement(fused_ddp)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(world.rank + 1), dtype=dtype)
        runs = []
        for values in ([float(torch.tensor(0.1 * (world.rank + 1), dtype=torch.float32)) * 3, 4.0 + world.rank * 2.5],
                       [2.0 ** -200 if world.rank == 0 else 1.0, 3.0],  # not a float32 sum: the float64 path
                       [1e300 * (world.rank + 1), 1.0]):  # a float32 sum beyond 2**128: non-finite parts
            for m in (plain, fused_ddp):
                m.zero_grad()
            plain(x).square().sum().backward()
            agreement.stage(torch.tensor(values, dtype=torch.float64),
                            float32_sums=all(float32_sum(v) for v in values))  # declared on the host
            fused_ddp(x).square().sum().backward()
            exact = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(exact)
            runs.append({"sum": agreement.result(), "float64": exact.tolist(), "fallbacks": agreement.fallbacks,
                         "same_grads": all(torch.equal(a.grad, b.grad) for a, b in
                                           zip(base.parameters(), fused_net.parameters()))})
        got[str(dtype)] = runs
    return got


# --- part 2: the trainer path ------------------------------------------------------------


def _train(world: World, out: Path, run_id: str, epochs: int = 2, runs_root: Path | None = None,
           fit: dict[str, Any] | None = None, **kw: Any) -> tuple[Any, Any, Any]:
    import ddpkit
    from nnx_es.distributed import DDP, train_loader

    model = ddpkit.net()
    t = ddpkit.trainer(model, runs_root=runs_root or out / "runs", run_id=run_id,
                       distributed=DDP(timeout_seconds=30), **kw)
    loader = train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED)
    result = t.fit(loader, epochs=epochs, **(fit or {}))
    return model, t, result


def _error(exc: BaseException) -> list[str]:
    return [type(exc).__name__, str(exc), *[c.__name__ for c in type(exc).__mro__]]


@case
def equivalence(world: World, out: Path) -> dict[str, Any]:
    import ddpkit

    model, t, result = _train(world, out, "equiv")
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
            got[name] = _error(exc)
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
               "fine": validation_loader(val, 4)}
    got: dict[str, Any] = {}
    for name, loader in loaders.items():
        t = ddpkit.trainer(ddpkit.net(), runs_root=out / "vm", run_id=name, distributed=DDP(timeout_seconds=30))
        try:
            got[name] = t.fit(train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED), loader,
                              epochs=1).status
        except Exception as exc:  # noqa: BLE001
            got[name] = _error(exc)
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
        got["recorded"] = _error(exc)
    world.gather(None)
    from events.log import LmdbLog

    with LmdbLog(out / "ev" / "ev" / "events.lmdb", readonly=True) as log:
        got["evaluations"] = sum(1 for _ in log.read(kinds=("evaluation_recorded",)))
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
            got[name] = _error(exc)
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
            got[name] = _error(exc)
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


# --- part 4: one writer, agreed commits, resume ------------------------------------------


@case
def writer_only(world: World, out: Path) -> dict[str, Any]:
    """Each rank names its own runs root: only the writer's may appear on disk."""
    import ddpkit

    model, t, result = _train(world, out, "wo", epochs=1, runs_root=out / f"roots-rank{world.rank}")
    return {"digest": ddpkit.digest(model), "run_dir": result.run_dir, "status": result.status,
            "own_root_exists": (out / f"roots-rank{world.rank}").exists(),
            "history": len(result.history), "last": result.last.manifest if result.last else None}


@case
def commit_fault(world: World, out: Path) -> dict[str, Any]:
    """A write fault on the writer at epoch 1's commit stops both ranks; epoch 0 stays committed."""
    import nnx_es.commit as commit_mod
    from nnx_es.errors import CheckpointWriteError

    real = commit_mod.encode_checkpoint
    calls = {"n": 0}

    def faulty(*a: Any, **k: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # the opening checkpoint, epoch 0, then epoch 1
            raise CheckpointWriteError("injected: disk full while writing the epoch-1 checkpoint")
        return real(*a, **k)

    if world.is_writer:
        commit_mod.encode_checkpoint = faulty
    try:
        _train(world, out, "fault", epochs=3)
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"raised": _error(exc)}
    finally:
        commit_mod.encode_checkpoint = real


@case
def resume_other_world(world: World, out: Path) -> dict[str, Any]:
    """A one-process run's LAST resumed statefully by 2 ranks: refused on both, nothing restored."""
    ref = Path(os.environ["NNX_TEST_REF"])
    try:
        _train(world, out, ref.name, epochs=3, runs_root=ref.parent, fit={"resume": "auto"})
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"raised": _error(exc)}


@case
def resume_auto(world: World, out: Path) -> dict[str, Any]:
    """1 epoch, then resume='auto' to 2: the parameters of the uninterrupted 2-epoch run (equivalence)."""
    import ddpkit

    _train(world, out, "resumed", epochs=1, fit={"resume": "auto"})
    model, t, result = _train(world, out, "resumed", epochs=2, fit={"resume": "auto"})
    return {"digest": ddpkit.digest(model), "status": result.status, "history": len(result.history)}


@case
def sha_refusal(world: World, out: Path) -> dict[str, Any]:
    """The LAST's model blob corrupted on disk: the writer's check refuses the resume on every rank."""
    import datetime as _dt

    from events.log import LmdbLog
    from nnx_es.result import load_result

    _train(world, out, "corrupt", epochs=1)
    if world.is_writer:
        run_dir = out / "runs" / "corrupt"
        manifest = load_result(run_dir).last.manifest
        from nnx_es.checkpoint import read_manifest
        from nnx_es.storage import BlobStore

        m = read_manifest(BlobStore(run_dir / "blobs"), manifest)
        blob = m.components["model"].blob
        path = run_dir / "blobs" / "sha256" / blob
        if path.exists():
            path.write_bytes(b"not the model")
        else:  # a small model lives in its manifest, in the log: corrupt the manifest there
            with LmdbLog(run_dir / "events.lmdb") as log:
                log.put_blob_raw(manifest.encode(), b"not the manifest")
    dist.monitored_barrier(timeout=_dt.timedelta(seconds=30))
    try:
        _train(world, out, "corrupt", epochs=2, fit={"resume": "auto"})
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"raised": _error(exc)}


# --- part 5: callback declarations ----------------------------------------------------------


@case
def callback_roles(world: World, out: Path) -> dict[str, Any]:
    from nnx_es import Callback, LambdaCallback
    from nnx_es.distributed import writer_only

    class Undeclared(Callback):
        def on_epoch_end(self, ctx: Any) -> None:
            pass

    got: dict[str, Any] = {}
    try:
        _train(world, out, "undeclared", epochs=1, callbacks=[Undeclared()])
    except Exception as exc:  # noqa: BLE001
        got["undeclared"] = _error(exc)
    try:
        _train(world, out, "lambda", epochs=1, callbacks=[LambdaCallback(on_epoch_end=lambda ctx: None)])
    except Exception as exc:  # noqa: BLE001
        got["lambda"] = _error(exc)
    got["undeclared_written"] = (out / "runs" / "undeclared").exists()
    built: list[int] = []
    ran: list[str] = []

    class Writes(Callback):
        distributed = "writer"

        def on_epoch_end(self, ctx: Any) -> None:
            ran.append("writes")

    def factory() -> Callback:
        built.append(world.rank)
        return LambdaCallback(name="logger", distributed="writer", on_epoch_end=lambda ctx: ran.append("logger"))

    everywhere = LambdaCallback(name="every", distributed="all", on_epoch_end=lambda ctx: ran.append("every"))
    _train(world, out, "roles", epochs=1, callbacks=[writer_only(factory), Writes(), everywhere])
    got.update(built=built, ran=ran)
    return got


# --- part 6: the parameter digest ----------------------------------------------------------


@case
def divergence(world: World, out: Path) -> dict[str, Any]:
    """Rank 1 alone nudges a weight at the start of epoch 1: the epoch's digest catches it on both ranks."""
    from nnx_es import LambdaCallback

    def nudge(ctx: Any) -> None:
        if ctx.epoch == 1 and ctx.state.world.rank == 1:
            with torch.no_grad():
                next(ctx.net.parameters()).view(-1)[0] += 1e-6

    try:
        _train(world, out, "diverged", epochs=3,
               callbacks=[LambdaCallback(name="nudge", distributed="all", on_epoch_begin=nudge)])
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"raised": _error(exc)}


# --- a rank killed mid-epoch -----------------------------------------------------------------


@case
def killed(world: World, out: Path) -> dict[str, Any]:
    """Rank 1 dies in epoch 1 (after epoch 0's LAST); rank 0 must fail within the group's bound."""
    import time

    import ddpkit
    from nnx_es import LambdaCallback
    from nnx_es.distributed import DDP, train_loader

    def die(ctx: Any) -> None:
        if ctx.epoch == 1 and ctx.batch_index == 1 and ctx.state.world.rank == 1:
            launch.write_result(out, "killed", 1, {"ok": True, "died": True})
            os._exit(0)  # exit 0: torchrun leaves rank 0 alone, so rank 0's own bound is what ends it

    model = ddpkit.net()
    t = ddpkit.trainer(model, runs_root=out / "runs", run_id="killed", distributed=DDP(timeout_seconds=20),
                       callbacks=[LambdaCallback(name="die", distributed="all", on_batch_end=die)])
    t0 = time.monotonic()
    try:
        t.fit(train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED), epochs=2)
        res: dict[str, Any] = {"ok": True, "raised": None}
    except Exception as exc:  # noqa: BLE001
        res = {"ok": True, "raised": _error(exc)}
    res["elapsed_s"] = time.monotonic() - t0
    launch.write_result(out, "killed", world.rank, res)
    os._exit(0)


@case
def resume_killed(world: World, out: Path) -> dict[str, Any]:
    """The killed run, resumed by a new group with resume='auto': the uninterrupted run's parameters."""
    import ddpkit

    killed_dir = Path(os.environ["NNX_TEST_KILLED"])
    model, t, result = _train(world, out, killed_dir.name, epochs=2, runs_root=killed_dir.parent,
                              fit={"resume": "auto"})
    return {"digest": ddpkit.digest(model), "status": result.status, "history": len(result.history)}


def main() -> None:
    out = Path(sys.argv[1])
    names = [n for n in sys.argv[2].split(",") if n]
    world = DDP(timeout_seconds=float(os.environ.get("NNX_TEST_PG_TIMEOUT", "30"))).world()
    for name in names:
        if name == "shutdown_missing":  # the last case: rank 1 leaves; the others must raise within the bound
            if world.rank == 1:
                launch.write_result(out, name, world.rank, {"ok": True, "left": True})
                os._exit(0)
            try:
                shutdown(timeout_seconds=3)
                res: dict[str, Any] = {"ok": True, "raised": None}
            except RuntimeError as exc:
                res = {"ok": True, "raised": "RuntimeError", "message": str(exc)}
            launch.write_result(out, name, world.rank, res)
            os._exit(0)
        try:
            res = {"ok": True, **CASES[name](world, out)}
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            res = {"ok": False, "error": type(exc).__name__, "message": str(exc),
                   "mro": [c.__name__ for c in type(exc).__mro__], "traceback": traceback.format_exc()}
        launch.write_result(out, name, world.rank, res)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    shutdown(timeout_seconds=30)
    shutdown(timeout_seconds=30)  # a second call does nothing
    launch.write_result(out, "shutdown_ok", world.rank, {"ok": True, "initialized": dist.is_initialized()})


if __name__ == "__main__":
    main()
