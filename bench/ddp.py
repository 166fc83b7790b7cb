"""Benchmark 4: a 2-rank gloo run of nnx_es (``distributed=DDP()``) against a hand-written DDP loop.

``python -m bench.ddp [--reps 7] [--epochs 10] [--markdown FILE] [--profile DIR]`` starts one
``torchrun --standalone --nproc-per-node=2`` launch (gloo, CPU, loopback, one torch thread a
rank) whose ranks run every contender, interleaved (A B C D, A B C D, ...), ``--reps`` times,
in the same process group, so drift on a shared machine hits them alike and no launch is timed.

The workload of every contender: scikit-learn's digits (1,797 rows), the MLP 64-128-10,
Adam(lr=1e-3), 32 rows per rank per batch, the partition of :func:`nnx_es.distributed.train_loader`
(seed + epoch, ``pad``; each rank 899 rows, 29 batches an epoch), no validation:

* ``hand DDP loop``: ``torch.nn.parallel.DistributedDataParallel`` over the same loader, the
  mean loss per rank (equal to nnx_es's sum / global W here: every rank's batch has 32 rows
  but the last), backward, step;
* ``hand DDP loop + torch.save each epoch``: the same, the writer rank saving a resumable
  checkpoint (model, optimizer, epoch, RNG) atomically each epoch -- the like-for-like
  baseline, since every nnx_es run commits LAST each epoch;
* the floor: the hand loop with the host-staged agreement and exactly the records the target asks
  of any implementation, no trainer around them -- on the writer rank two events a microbatch
  (``microbatch_done``, ``update_committed``) appended to an LMDB event log, and each epoch, in
  place of torch.save, a checkpoint (model, optimizer; ``"tensors"`` codec) staged in the log with
  ``checkpoint_stored`` and ``last_committed`` and one synced write. Its ratio bounds from below
  what nnx_es (or any trainer keeping these records) can reach here;
* ``nnx_es DDP, batch_gather=False``: ``Trainer(distributed=DDP(), batch_gather=False)``
  iterating the DataLoader as the hand loop does (the like-for-like row);
* ``nnx_es DDP``: every default (``batch_gather`` fetches each batch with one gather per tensor).

Each contender's time on one rep is taken between two barriers; ``wall`` is the slower rank's
(perf_counter), ``cpu`` the two ranks' process_time summed (a shared machine disturbs it far
less than wall time). The headline ratio is CPU time, nnx_es like-for-like over the hand loop
with a save (target <= 1.10x); the per-microbatch overhead is the CPU-time difference over
every rank's microbatches. ``--profile DIR`` adds one nnx_es run per rank under cProfile
(``DIR/rank<r>.prof``) and prints each rank's top functions.

Timings belong here, never in tests.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import inspect
import io
import json
import math
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HAND, HAND_SAVE = "hand DDP loop", "hand DDP loop + torch.save each epoch"
NNX_ROWS, NNX = "nnx_es DDP, batch_gather=False", "nnx_es DDP (every default)"
HAND_SEPARATE = "hand DDP loop + save + a second all_reduce per step (nnx_es's agreement before the fusion)"
HAND_FUSED = "hand DDP loop + save + the agreement in the last gradient bucket (comm hook, float32 parts)"
HAND_HOST = "hand DDP loop + save + the same, its parts cut on the host (stage_host: nnx_es's way on the CPU)"
HAND_FUSED64 = "hand DDP loop + save + the agreement in a float64 copy of the last bucket (the hook before)"
HAND_PYHOOK = "hand DDP loop + save + a Python comm hook doing what DDP's C++ one does"
FLOOR = ("hand DDP loop + the records the target requires (the floor: host-staged agreement, two events a "
         "microbatch on the writer, a checkpoint committed in the log each epoch)")
BATCH = 32
TARGET = 1.10


# --- inside a rank ---------------------------------------------------------------------------------


def _dataset():
    import torch
    from sklearn.datasets import load_digits
    from torch.utils.data import TensorDataset

    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))


def _loader(dataset):
    from nnx_es.distributed import train_loader

    return train_loader(dataset, BATCH, policy="pad", seed=0)


def _net():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _atomic_save(obj: object, path: Path) -> None:
    """torch.save through an owned temporary file, fsync, atomic rename and a directory fsync."""
    import torch

    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_hand(dataset, epochs: int, root: Path, *, save: bool = False, agree: str = "", records: bool = False) -> int:
    """The hand-written DDP loop; returns the microbatches this rank trained.

    ``agree``: ``"separate"`` adds what nnx_es's window end did before the fusion -- a second, blocking
    all_reduce of ``[numerator, denominator, non-finite flag]`` (float64) after backward and a
    host read of it; ``"fused"`` carries the same three values in the gradients' last bucket
    (:class:`nnx_es.distributed.fused.FusedAgreement`, a DDP comm hook: no second collective);
    ``"fused64"`` the same hook widening the bucket to float64 (``carry="float64"``, as before the
    float32 parts); ``"host"`` the float32 parts cut on the host from the loss read as a float
    (``FusedAgreement.stage_host``, what nnx_es does on the CPU); ``"pyhook"`` torch's Python
    ``allreduce_hook`` (the cost of a Python hook alone).

    ``records`` (with ``agree="host"``; the floor): every rank skips the step its agreement found
    non-finite, and the writer keeps the records the target asks of any implementation -- per
    microbatch ``MicrobatchDone`` and ``UpdateCommitted`` appended to an ``LmdbLog`` (the local loss
    the agreement read on the host, the global one from its sums: no second read), per epoch, in
    place of torch.save, a checkpoint (model, optimizer; ``"tensors"`` codec) encoded by
    :func:`nnx_es.checkpoint.encode_checkpoint`, staged in the log with ``CheckpointStored`` and
    ``LastCommitted``, and one ``flush(sync=True)``.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    if records and agree != "host":
        raise ValueError("records=True takes agree='host' (the loss it reads on the host)")
    net = _net()
    model = DistributedDataParallel(net)
    fused = None
    if agree in ("fused", "fused64", "host"):
        from nnx_es.distributed.fused import FusedAgreement

        fused = FusedAgreement(model, carry="float64" if agree == "fused64" else "auto")
    elif agree == "pyhook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    loader = _loader(dataset)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    writer = dist.get_rank() == 0
    world = dist.get_world_size()
    log = store = None
    if records and writer:
        from events.log import LmdbLog
        from events.schema import CheckpointStored, LastCommitted, MicrobatchDone, UpdateCommitted
        from events.values import Counters
        from nnx_es.checkpoint import encode_checkpoint
        from nnx_es.state_codec import encode_state
        from nnx_es.storage import BlobStore

        log = LmdbLog(root / "events.lmdb")
        store = BlobStore(root / "blobs", log)
    steps = updates = 0
    try:
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                if agree == "host":
                    value = loss.detach().item()  # the same three values, read as floats
                    fused.stage_host([value * len(y), float(len(y)), 0.0 if math.isfinite(value) else 1.0],
                                     float32_sums=True)
                elif fused is not None:
                    fused.stage(torch.stack([loss.detach().double() * len(y),
                                             torch.tensor(float(len(y)), dtype=torch.float64),
                                             (~torch.isfinite(loss.detach())).double()]), float32_sums=True)
                loss.backward()
                if agree == "separate":
                    t = torch.stack([loss.detach().double() * len(y), torch.tensor(float(len(y)), dtype=torch.float64),
                                     (~torch.isfinite(loss.detach())).double()])
                    dist.all_reduce(t)
                    t.tolist()
                elif fused is not None:
                    sums = fused.result()
                steps += 1
                if records:  # sums: numerator, denominator, non-finite ranks (Python floats, read once)
                    rows = len(y)
                    if log is not None:
                        log.append(MicrobatchDone(epoch=epoch, batch=i, rows=rows, examples=float(rows), loss=value))
                    if sums[2] or not math.isfinite(sums[0]):
                        continue
                    opt.step()
                    updates += 1
                    if log is not None:
                        log.append(UpdateCommitted(step=updates, epoch=epoch, microbatches=1,
                                                   local_examples=float(rows), global_examples=sums[1],
                                                   loss=sums[0] / sums[1], lrs=[g["lr"] for g in opt.param_groups],
                                                   data_parallel_size=world))
                    continue
                opt.step()
            if save and writer:
                _atomic_save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                              "rng": torch.get_rng_state()}, root / "last.pt")
            if log is not None:
                counters = Counters(batch=steps, step=updates, global_step=updates * world, epoch=epoch + 1)
                parts = {"model": ("tensors", encode_state(net.state_dict())),
                         "optimizer": ("tensors", encode_state(opt.state_dict()))}
                digest, manifest, data = encode_checkpoint(store, run_id="floor", epoch=epoch, step=updates,
                                                           counters=counters, parts=parts,  # type: ignore[arg-type]
                                                           world_size=world)
                store.stage(data, digest)
                log.append(CheckpointStored(manifest=digest, epoch=epoch, step=updates,
                                            components={k: c.blob for k, c in manifest.components.items()}))
                log.append(LastCommitted(manifest=digest, epoch=epoch, step=updates, counters=counters))
                log.flush(sync=True)
    finally:
        if log is not None:
            log.close()
    return steps


BIG_HIDDEN, BIG_STEPS = 1536, 8
BIG = {"DDP's C++ hook": None, "FusedAgreement, float64 copy of the bucket (before)": "float64",
       "FusedAgreement, float32 parts (now)": "auto"}


def run_big_bucket(carry: str | None, steps: int = BIG_STEPS) -> int:
    """The comm hook alone on a bucket of 9.9 MB: the MLP 64-1536-1536-10 (2,476,042 parameters, one
    bucket, so the agreement rides in all of it), SGD, 32 random rows per rank, ``steps`` steps;
    ``carry``: None (DDP's own C++ hook) or :class:`~nnx_es.distributed.fused.FusedAgreement`'s."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from nnx_es.distributed.fused import FusedAgreement

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, BIG_HIDDEN), nn.ReLU(), nn.Linear(BIG_HIDDEN, BIG_HIDDEN), nn.ReLU(),
                        nn.Linear(BIG_HIDDEN, 10))
    model = DistributedDataParallel(net, bucket_cap_mb=1000)
    fused = FusedAgreement(model, carry=carry) if carry is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        if fused is not None:
            fused.stage(torch.stack([loss.detach().double() * len(y), torch.tensor(float(len(y)), dtype=torch.float64)]),
                        float32_sums=True)
        loss.backward()
        if fused is not None:
            fused.result()
        opt.step()
    return steps


def nnx_available() -> bool:
    """Whether this tree's Trainer takes ``distributed=`` (the DDP trainer path)."""
    from nnx_es import Trainer

    return "distributed" in inspect.signature(Trainer.__init__).parameters


def run_nnx(dataset, epochs: int, root: Path, *, batch_gather: bool = False) -> int:
    """nnx_es under ``distributed=DDP()``; returns the microbatches this rank trained."""
    import torch
    from torch import nn

    from nnx_es import Trainer
    from nnx_es.distributed import DDP

    net = _net()
    loader = _loader(dataset)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=root, run_id="bench", progress=False,
                      batch_gather=batch_gather, distributed=DDP(timeout_seconds=60))
    trainer.fit(loader, epochs=epochs)
    return epochs * len(loader)


def _contenders(with_nnx: bool) -> dict[str, Callable[[Any, int, Path], int]]:
    out: dict[str, Callable[[Any, int, Path], int]] = {
        HAND: run_hand,
        HAND_SAVE: lambda d, e, r: run_hand(d, e, r, save=True),
        HAND_SEPARATE: lambda d, e, r: run_hand(d, e, r, save=True, agree="separate"),
        HAND_PYHOOK: lambda d, e, r: run_hand(d, e, r, save=True, agree="pyhook"),
        HAND_FUSED64: lambda d, e, r: run_hand(d, e, r, save=True, agree="fused64"),
        HAND_FUSED: lambda d, e, r: run_hand(d, e, r, save=True, agree="fused"),
        HAND_HOST: lambda d, e, r: run_hand(d, e, r, save=True, agree="host"),
        FLOOR: lambda d, e, r: run_hand(d, e, r, agree="host", records=True),
    }
    if with_nnx:
        out[NNX_ROWS] = run_nnx
        out[NNX] = lambda d, e, r: run_nnx(d, e, r, batch_gather=True)
    return out


def _timed(fn: Callable[[Any, int, Path], int], dataset, epochs: int) -> dict[str, float]:
    import time

    import torch.distributed as dist

    root = Path(tempfile.mkdtemp(prefix=f"ddp_bench_r{dist.get_rank()}_"))
    try:
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        steps = fn(dataset, epochs, root)
        dist.barrier()
        return {"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0, "steps": steps}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def worker(args: argparse.Namespace) -> int:
    """One rank: every contender interleaved ``reps`` times; rank 0 writes the JSON to ``args.out``."""
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    dataset = _dataset()
    with_nnx = nnx_available()
    contenders = _contenders(with_nnx)
    for fn in contenders.values():  # warm-up
        _timed(fn, dataset, 1)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in contenders}
    for _ in range(args.reps):
        for name, fn in contenders.items():
            mine = _timed(fn, dataset, args.epochs)
            both = [None] * dist.get_world_size()
            dist.all_gather_object(both, mine)
            runs[name].append({"wall": max(t["wall"] for t in both), "cpu": sum(t["cpu"] for t in both),
                               "steps": sum(t["steps"] for t in both)})
    big: dict[str, list[float]] = {k: [] for k in BIG}  # CPU ms per step over both ranks, per rep
    for carry in BIG.values():  # warm-up
        run_big_bucket(carry, 1)
    for _ in range(args.reps):
        for name, carry in BIG.items():
            dist.barrier()
            c0 = time.process_time()
            steps = run_big_bucket(carry)
            dist.barrier()
            both = [None] * dist.get_world_size()
            dist.all_gather_object(both, time.process_time() - c0)
            big[name].append(sum(both) / steps * 1e3)
    profile = None
    if args.profile and with_nnx:
        prof_dir = Path(args.profile)
        prof_dir.mkdir(parents=True, exist_ok=True)
        pr = cProfile.Profile()
        pr.enable()
        _timed(run_nnx, dataset, args.epochs)
        pr.disable()
        pr.dump_stats(str(prof_dir / f"rank{rank}.prof"))
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
        both = [None] * dist.get_world_size()
        dist.all_gather_object(both, text.getvalue())
        profile = both
    if rank == 0:
        Path(args.out).write_text(json.dumps({"runs": runs, "nnx": with_nnx, "profile": profile, "big": big,
                                              "world_size": dist.get_world_size()}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --- the driver --------------------------------------------------------------------------------------


def run_on_two_ranks(module: str, args: list[str], timeout_s: float = 900.0) -> Any:
    """``python -m module --worker --out FILE *args`` on 2 ranks under torchrun (gloo, loopback, a free
    port, one thread each); return the JSON the worker wrote to ``FILE``.

    Raises:
        RuntimeError: the launch failed or wrote nothing (its output's tail in the message).
    """
    import socket

    with tempfile.TemporaryDirectory(prefix="ddp_bench_") as tmp:
        out = Path(tmp) / "result.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "-m", module, "--worker",
               "--out", str(out), *args]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCH_CPP_LOG_LEVEL="ERROR")
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"the 2-rank launch failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}"
                               f"\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def launch(reps: int, epochs: int, profile: str | None = None, timeout_s: float = 900.0) -> dict[str, Any]:
    """Start the 2-rank launch and return rank 0's results."""
    args = ["--reps", str(reps), "--epochs", str(epochs)]
    if profile:
        args += ["--profile", str(Path(profile).resolve())]
    return run_on_two_ranks("bench.ddp", args, timeout_s)  # type: ignore[no-any-return]


def report(result: dict[str, Any], reps: int, epochs: int) -> str:
    runs = result["runs"]
    cpu = {k: statistics.median(r["cpu"] for r in v) for k, v in runs.items()}
    wall = {k: statistics.median(r["wall"] for r in v) for k, v in runs.items()}
    base = cpu[HAND_SAVE]
    # each rep's ratio to the baseline's CPU time in the same rep, then their median (as bench.run): it
    # cancels the shared machine's drift, which the ratio of two medians does not
    paired = {k: statistics.median(r["cpu"] / b["cpu"] for b, r in zip(runs[HAND_SAVE], v)) for k, v in runs.items()}
    lines = [f"4. Data parallelism: 2 ranks (gloo, CPU, 1 thread each), digits MLP 64-128-10, Adam, {BATCH} rows "
             f"per rank per batch, {epochs} epochs, {reps} interleaved reps (CPU s: both ranks summed; wall s: "
             "the slower rank; the paired ratio, the median of each rep's ratio to the baseline's time in the same "
             "rep, is the figure the text uses)", "",
             "| contender | median CPU s | spread CPU s | median wall s | paired CPU ratio to hand DDP + save | "
             "ratio of medians |",
             "|---|---|---|---|---|---|"]
    for name, v in runs.items():
        xs = [r["cpu"] for r in v]
        lines.append(f"| {name} | {cpu[name]:.3f} | {min(xs):.3f}-{max(xs):.3f} | {wall[name]:.3f} | "
                     f"{paired[name]:.3f}x | {cpu[name] / base:.3f}x |")
    lines.append("")
    if NNX_ROWS in runs:
        ratio = paired[NNX_ROWS]
        steps = runs[NNX_ROWS][0]["steps"]  # microbatches over both ranks
        per_mb = (ratio - 1.0) * base / steps * 1e6
        verdict = "met" if ratio <= TARGET else "missed"
        lines.append(f"Like for like (`{NNX_ROWS}` over `{HAND_SAVE}`, CPU): **{ratio:.3f}x** (target <= "
                     f"{TARGET:.2f}x: {verdict}); overhead {per_mb:.0f} us of CPU per microbatch per rank "
                     f"({steps} microbatches over both ranks).")
    else:
        lines.append("nnx_es rows left out: this tree's Trainer takes no `distributed=` yet.")
    if FLOOR in runs:
        floor = paired[FLOOR]
        where = (f"above it: reachable in principle, with {TARGET / floor - 1:.1%} left for everything a trainer "
                 "does beyond these records" if TARGET >= floor else
                 "below it: out of reach here for any implementation keeping these records")
        lines.append(f"The floor (`{FLOOR}` over `{HAND_SAVE}`, paired CPU ratio) is **{floor:.3f}x**; the "
                     f"{TARGET:.2f}x target lies {where}.")
    big = result.get("big")
    if big:
        ref = statistics.median(big[next(iter(BIG))])
        lines += ["", f"The window's agreement in a bucket of 9.9 MB (MLP 64-{BIG_HIDDEN}-{BIG_HIDDEN}-10, one bucket, "
                  f"{BIG_STEPS} SGD steps, the same launch, {reps} interleaved reps; CPU ms per step, both ranks summed):",
                  "", "| comm hook | median CPU ms / step | spread | over DDP's C++ hook |", "|---|---|---|---|"]
        for name, xs in big.items():
            med = statistics.median(xs)
            lines.append(f"| {name} | {med:.1f} | {min(xs):.1f}-{max(xs):.1f} | {med - ref:+.1f} ms |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="nnx_es 2-rank DDP benchmark")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--markdown", type=Path, help="write the table into its section of this Markdown file")
    ap.add_argument("--profile", help="directory for one cProfile'd nnx_es run per rank (rank<r>.prof)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    result = launch(args.reps, args.epochs, args.profile)
    text = report(result, args.reps, args.epochs)
    print(text)
    for rank, prof in enumerate(result.get("profile") or []):
        print(f"--- cProfile, rank {rank} (by own time) ---\n{prof}")
    if args.markdown:
        from bench.markdown import write_section

        write_section(args.markdown, "bench.ddp", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
