"""The torch DDP training backend (registry name ``"torch-ddp"``): what it executes, declared.

:data:`TORCH_DDP_CAPABILITIES` says exactly what ``distributed=DDP()`` runs (spec 003,
"BackendCapabilities"; issue 13):

* one parallel axis, ``dp_replicate``: every rank holds the whole model and optimizer state
  (``torch.nn.parallel.DistributedDataParallel``), the data is partitioned; no sharding,
  tensor, pipeline, context or expert parallelism;
* the precisions ``distributed=DDP()`` runs: ``fp32`` and ``bf16`` (``fp16`` is refused before
  training: its GradScaler would skip backward per rank, see ``nnx_es.distributed.wrap``);
* no distributed optimizer (optimizer state is replicated), no resharding: a checkpoint resumes
  on the same world size and partition only -- but an elastic run's (an ``elastic_loader``), whose
  replicated state needs no resharding and whose global batches are dealt again on any world size
  dividing them (:mod:`nnx_es.distributed.resize`; ``reshardable_checkpoint`` stays False: it is
  the loader's property, not every checkpoint's);
* elastic restarts: a group ``torchrun --max-restarts`` restarts continues from LAST with
  ``resume="auto"``.

The backend is registered lazily by :mod:`nnx_es.distributed.contracts`; this module is
imported on the first ``get_training_backend("torch-ddp")``. It imports no torch itself:
:meth:`TorchDDPBackend.strategy` imports the trainer path when asked.
"""

from __future__ import annotations

from typing import Any

from nnx_es.distributed.contracts import BackendCapabilities, ParallelPlan, check_plan

__all__ = ["TORCH_DDP_CAPABILITIES", "TorchDDPBackend"]

TORCH_DDP_CAPABILITIES = BackendCapabilities(
    name="torch-ddp",
    axes=frozenset({"dp_replicate"}),
    precisions=frozenset({"fp32", "bf16"}),
    distributed_optimizer=False,
    reshardable_checkpoint=False,
    elastic_restart=True,
    requirements=(
        "torch.distributed with gloo (CPU) or nccl (one CUDA device per rank)",
        "a launcher that sets RANK, WORLD_SIZE and LOCAL_RANK (torchrun, TorchElastic)",
        "a deterministic forward for exact equality with one process (no BatchNorm)",
    ),
)


class TorchDDPBackend:
    """Plain data parallelism over ``torch.distributed`` (the ``distributed=DDP()`` trainer path)."""

    name = "torch-ddp"
    capabilities = TORCH_DDP_CAPABILITIES

    def plan(self, world_size: int, *, gradient_accumulation_steps: int = 1) -> ParallelPlan:
        """The only plan shape this backend runs: ``dp_replicate = world_size``.

        Raises:
            ConfigError: a ``world_size`` or accumulation that is not a positive int.
        """
        return ParallelPlan(dp_replicate=world_size, gradient_accumulation_steps=gradient_accumulation_steps)

    def check(self, plan: ParallelPlan, *, precision: str | None = None) -> None:
        """Refuse a plan (or precision) this backend does not execute.

        Raises:
            PlanRefusedError: see :func:`~nnx_es.distributed.contracts.check_plan`.
        """
        check_plan(plan, self.capabilities, precision=precision)

    def strategy(self, plan: ParallelPlan | None = None, **options: Any) -> Any:
        """``nnx_es.distributed.DDP(**options)`` for ``distributed=``, after checking ``plan`` when given.

        Raises:
            PlanRefusedError: ``plan`` asks for an axis other than ``dp_replicate``.
        """
        if plan is not None:
            self.check(plan)
        from nnx_es.distributed.group import DDP  # the trainer path: imported only when a run asks for it

        return DDP(**options)

    def __repr__(self) -> str:
        return "TorchDDPBackend(name='torch-ddp')"
