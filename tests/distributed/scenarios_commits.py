"""Scenario cases, parts 4-6: one writer and agreed commits, resume, callback declarations, the
parameter digest, a rank killed mid-epoch."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import launch  # noqa: E402
from nnx_es.distributed import DDP  # noqa: E402
from nnx_es.runtime.run_state import World  # noqa: E402
from scenario_base import case, error, train  # noqa: E402


# --- part 4: one writer, agreed commits, resume ------------------------------------------


@case
def writer_only(world: World, out: Path) -> dict[str, Any]:
    """Each rank names its own runs root: only the writer's may appear on disk."""
    import ddpkit

    model, t, result = train(world, out, "wo", epochs=1, runs_root=out / f"roots-rank{world.rank}")
    return {"digest": ddpkit.digest(model), "run_dir": result.run_dir, "status": result.status,
            "own_root_exists": (out / f"roots-rank{world.rank}").exists(),
            "history": len(result.history), "last": result.last.manifest if result.last else None}


@case
def commit_fault(world: World, out: Path) -> dict[str, Any]:
    """A write fault on the writer at epoch 1's commit stops both ranks; epoch 0 stays committed."""
    import nnx_es.runtime.commit as commit_mod
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
        train(world, out, "fault", epochs=3)
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"raised": error(exc)}
    finally:
        commit_mod.encode_checkpoint = real


@case
def resume_other_world(world: World, out: Path) -> dict[str, Any]:
    """A one-process run's LAST resumed statefully by 2 ranks: refused on both, nothing restored."""
    ref = Path(os.environ["NNX_TEST_REF"])
    try:
        train(world, out, ref.name, epochs=3, runs_root=ref.parent, fit={"resume": "auto"})
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"raised": error(exc)}


@case
def resume_auto(world: World, out: Path) -> dict[str, Any]:
    """1 epoch, then resume='auto' to 2: the parameters of the uninterrupted 2-epoch run (equivalence)."""
    import ddpkit

    train(world, out, "resumed", epochs=1, fit={"resume": "auto"})
    model, t, result = train(world, out, "resumed", epochs=2, fit={"resume": "auto"})
    return {"digest": ddpkit.digest(model), "status": result.status, "history": len(result.history)}


@case
def sha_refusal(world: World, out: Path) -> dict[str, Any]:
    """The LAST's model blob corrupted on disk: the writer's check refuses the resume on every rank."""
    import datetime as _dt

    from events.log import LmdbLog
    from nnx_es.result import load_result

    train(world, out, "corrupt", epochs=1)
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
        train(world, out, "corrupt", epochs=2, fit={"resume": "auto"})
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"raised": error(exc)}


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
        train(world, out, "undeclared", epochs=1, callbacks=[Undeclared()])
    except Exception as exc:  # noqa: BLE001
        got["undeclared"] = error(exc)
    try:
        train(world, out, "lambda", epochs=1, callbacks=[LambdaCallback(on_epoch_end=lambda ctx: None)])
    except Exception as exc:  # noqa: BLE001
        got["lambda"] = error(exc)
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
    train(world, out, "roles", epochs=1, callbacks=[writer_only(factory), Writes(), everywhere])
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
        train(world, out, "diverged", epochs=3,
               callbacks=[LambdaCallback(name="nudge", distributed="all", on_epoch_begin=nudge)])
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"raised": error(exc)}


@case
def digest_every(world: World, out: Path) -> dict[str, Any]:
    """``DDP(digest_every=3)``: the ranks compare digests every 3 committed updates, not at the epochs' ends."""
    import ddpkit
    from nnx_es.distributed import train_loader

    t = ddpkit.trainer(ddpkit.net(), runs_root=out / "runs", run_id="digest_every",
                       distributed=DDP(timeout_seconds=30, digest_every=3))
    result = t.fit(train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED), epochs=5)  # 2 updates an epoch
    return {"status": result.status}


@case
def digest_beyond_run(world: World, out: Path) -> dict[str, Any]:
    """Found by a fresh user: ``DDP(digest_every=K)`` with K beyond the run's updates compared nothing, so a
    rank whose weights drifted completed. The end of training compares once more (final=True)."""
    import ddpkit
    from nnx_es import LambdaCallback
    from nnx_es.distributed import train_loader

    def nudge(ctx: Any) -> None:
        if ctx.epoch == 1 and ctx.state.world.rank == 1:
            with torch.no_grad():
                next(ctx.net.parameters()).view(-1)[0] += 1e-6

    got: dict[str, Any] = {}
    for name, callbacks in (("clean", []), ("nudged", [LambdaCallback(name="nudge", distributed="all",
                                                                      on_epoch_begin=nudge)])):
        t = ddpkit.trainer(ddpkit.net(), runs_root=out / "runs", run_id=f"beyond_{name}",
                           distributed=DDP(timeout_seconds=30, digest_every=1000), callbacks=callbacks)
        try:
            got[name] = t.fit(train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED), epochs=3).status
        except Exception as exc:  # noqa: BLE001
            got[name] = error(exc)
    return got


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
        res = {"ok": True, "raised": error(exc)}
    res["elapsed_s"] = time.monotonic() - t0
    launch.write_result(out, "killed", world.rank, res)
    os._exit(0)


@case
def peer_error(world: World, out: Path) -> dict[str, Any]:
    """Rank 1's callback raises in epoch 1; rank 1 leaves (exit 0); rank 0 fails on the broken group. Found by a
    fresh user: the writer's run_failed recorded only gloo's "Connection closed by peer"."""
    import ddpkit
    from nnx_es import LambdaCallback
    from nnx_es.distributed import DDP, train_loader

    def boom(ctx: Any) -> None:
        if ctx.epoch == 1 and ctx.batch_index == 1 and ctx.state.world.rank == 1:
            raise ValueError("boom on rank 1")

    t = ddpkit.trainer(ddpkit.net(), runs_root=out / "runs", run_id="peer_error", distributed=DDP(timeout_seconds=20),
                       callbacks=[LambdaCallback(name="boom", distributed="all", on_batch_end=boom)])
    try:
        t.fit(train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED), epochs=3)
        res: dict[str, Any] = {"ok": True, "raised": None}
    except Exception as exc:  # noqa: BLE001
        res = {"ok": True, "raised": error(exc), "notes": getattr(exc, "__notes__", [])}
    launch.write_result(out, "peer_error", world.rank, res)
    os._exit(0)


@case
def resume_killed(world: World, out: Path) -> dict[str, Any]:
    """The killed run, resumed by a new group with resume='auto': the uninterrupted run's parameters."""
    import ddpkit

    killed_dir = Path(os.environ["NNX_TEST_KILLED"])
    model, t, result = train(world, out, killed_dir.name, epochs=2, runs_root=killed_dir.parent,
                              fit={"resume": "auto"})
    return {"digest": ddpkit.digest(model), "status": result.status, "history": len(result.history)}
