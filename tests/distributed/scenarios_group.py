"""Scenario cases, part 1: the group, agreement primitives, partitions, the fused agreement hook."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nnx_es.distributed import DDP, partition_indices, shard_indices  # noqa: E402
from nnx_es.runtime.run_state import World  # noqa: E402
from scenario_base import case, train  # noqa: E402


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
    for dtype, host in ((torch.float32, False), (torch.float64, False), (torch.float32, True), (torch.float64, True)):
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
            declared = all(float32_sum(v) for v in values)  # declared on the host
            if host:  # the parts cut on the host, beside the bucket (stage_host: a CPU run's way)
                agreement.stage_host(values, float32_sums=declared)
            else:
                agreement.stage(torch.tensor(values, dtype=torch.float64), float32_sums=declared)
            fused_ddp(x).square().sum().backward()
            exact = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(exact)
            runs.append({"sum": agreement.result(), "float64": exact.tolist(), "fallbacks": agreement.fallbacks,
                         "same_grads": all(torch.equal(a.grad, b.grad) for a, b in
                                           zip(base.parameters(), fused_net.parameters()))})
        got[f"{dtype}{' host' if host else ''}"] = runs
    return got


@case
def staging_ways(world: World, out: Path) -> dict[str, Any]:
    """The ignored-targets fit (ignore_index, unequal per rank) and the weighted equivalence fit with the
    window's agreement staged from the host (nnx_es.runtime.parallel.HOST_PARTS_ON_CPU, the CPU default) and
    on the device, the ignored rows counted on the host and on the device: parameters and receipts."""
    import ddpkit
    import nnx_es.runtime.parallel
    import nnx_es.objective
    from nnx_es import Trainer
    from nnx_es.distributed import DDP, train_loader

    x, y = ddpkit.ignored_data()
    got: dict[str, Any] = {}
    saved = nnx_es.runtime.parallel.HOST_PARTS_ON_CPU, nnx_es.objective.HOST_COUNT_ON_CPU
    try:
        for parts in (True, False):
            nnx_es.runtime.parallel.HOST_PARTS_ON_CPU = parts
            for count in (True, False):
                nnx_es.objective.HOST_COUNT_ON_CPU = count
                run_id = f"ways_{int(parts)}{int(count)}"
                model = ddpkit.net()
                t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), torch.nn.CrossEntropyLoss(),
                            runs_root=out / "runs", run_id=run_id, distributed=DDP(timeout_seconds=30),
                            progress=False, accumulation=2)
                t.fit(train_loader(torch.utils.data.TensorDataset(x, y), 2, shuffle=False), epochs=1)
                got[run_id] = {"digest": ddpkit.digest(model),
                               "receipts": ddpkit.receipts(out / "runs" / run_id) if world.is_writer else None}
            model, t, _ = train(world, out, f"ways_equiv_{int(parts)}")
            got[f"equiv_{int(parts)}"] = {"digest": ddpkit.digest(model),
                                          "receipts": ddpkit.receipts(out / "runs" / f"ways_equiv_{int(parts)}")
                                          if world.is_writer else None}
    finally:
        nnx_es.runtime.parallel.HOST_PARTS_ON_CPU, nnx_es.objective.HOST_COUNT_ON_CPU = saved
    return {"runs": got}


@case
def rank_streams(world: World, out: Path) -> dict[str, Any]:
    """Dropout under DDP (spec 000 §3: each rank draws its own stream): the same fit run twice with
    seed 0, once with seed 1; per run, a SHA-256 of every training mask of the dropout layer
    (True = kept, over the rows of this rank's microbatches), the seed torch's stream started from,
    and the parameters' digest."""
    import hashlib

    import ddpkit
    from nnx_es.distributed import DDP, train_loader

    runs: dict[str, Any] = {}
    for run_id, seed in (("streams_a", 0), ("streams_b", 0), ("streams_c", 1)):
        model = ddpkit.dropout_net()
        masks: list[torch.Tensor] = []
        model[2].register_forward_hook(
            lambda m, i, o: masks.append(((o != 0) | (i[0] == 0)).flatten()) if m.training else None)
        t = ddpkit.trainer(model, runs_root=out / "runs", run_id=run_id, distributed=DDP(timeout_seconds=30),
                           seed=seed)
        t.fit(train_loader(ddpkit.dataset(), ddpkit.BATCH, seed=ddpkit.SEED), epochs=2)
        runs[run_id] = {"masks": hashlib.sha256(torch.cat(masks).numpy().tobytes()).hexdigest(),
                        "kept": float(torch.cat(masks).float().mean()), "initial_seed": torch.initial_seed(),
                        "digest": ddpkit.digest(model)}
    return {"rank": world.rank, "runs": runs}
