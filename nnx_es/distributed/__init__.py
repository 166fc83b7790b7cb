"""Data parallelism under ``torchrun`` (spec 000 §3, DESIGN.md "Distributed").

``Trainer(..., distributed=DDP())`` trains inside the process group the launcher started;
:func:`train_loader` / :func:`validation_loader` give each rank its rows; :func:`elastic_loader`
declares a global batch, so that the run may resume on another world size (elastic mode,
:mod:`nnx_es.distributed.resize`); :func:`shutdown` ends the group with a bounded barrier.
nnx_es starts no runtime of its own.
"""

from nnx_es.distributed.contracts import (
    AXES,
    MESH_AXES,
    BackendCapabilities,
    BackendRegistrationError,
    DistributedTrainingBackend,
    ParallelPlan,
    PlanRefusedError,
    UnknownBackendError,
    check_plan,
    get_training_backend,
    register_training_backend,
    registered_backends,
)
from nnx_es.distributed.roles import ROLES, WriterOnly, writer_only
from nnx_es.distributed.group import DDP, env_world_size, refuse_group, shutdown
from nnx_es.distributed.global_batch import GlobalBatchPlan, GlobalBatchSampler, elastic_loader, plan_global_batch
from nnx_es.distributed.partitions import (
    POLICIES,
    PartitionSampler,
    ShardSampler,
    partition_indices,
    shard_indices,
    train_loader,
    validation_loader,
)

__all__ = [
    "AXES",
    "BackendCapabilities",
    "BackendRegistrationError",
    "DDP",
    "DistributedTrainingBackend",
    "GlobalBatchPlan",
    "GlobalBatchSampler",
    "MESH_AXES",
    "ParallelPlan",
    "PlanRefusedError",
    "ROLES",
    "UnknownBackendError",
    "WriterOnly",
    "check_plan",
    "elastic_loader",
    "get_training_backend",
    "register_training_backend",
    "registered_backends",
    "POLICIES",
    "PartitionSampler",
    "ShardSampler",
    "env_world_size",
    "partition_indices",
    "plan_global_batch",
    "refuse_group",
    "shard_indices",
    "shutdown",
    "train_loader",
    "validation_loader",
    "writer_only",
]
