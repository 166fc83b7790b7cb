"""Distributed training contracts (spec 003): ParallelPlan, BackendCapabilities, the backend registry."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nnx_es.distributed import contracts
from nnx_es.distributed.contracts import (
    AXES,
    BackendCapabilities,
    BackendRegistrationError,
    ParallelPlan,
    PlanRefusedError,
    UnknownBackendError,
    check_plan,
    get_training_backend,
    register_training_backend,
    registered_backends,
)
from nnx_es.errors import ConfigError, NnxError

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture
def registry():
    """The registry as it was, restored after the test (tests register throwaway names)."""
    saved = dict(contracts._registry)
    yield
    contracts._registry.clear()
    contracts._registry.update(saved)


class _Backend:
    def __init__(self, name: str = "fake", axes: frozenset[str] = frozenset({"dp_replicate"})) -> None:
        self.capabilities = BackendCapabilities(name=name, axes=axes)


# --- ParallelPlan ---------------------------------------------------------------------------------


def test_plan_defaults_to_one_process_with_a_one_rank_dp_dimension() -> None:
    plan = ParallelPlan()
    assert plan.world_size == 1
    assert plan.mesh == (("dp_replicate",), (1,))
    assert plan.active_axes == ()


@pytest.mark.parametrize(
    "kwargs, names, shape",
    [
        ({"dp_replicate": 4}, ("dp_replicate",), (4,)),
        ({"dp_shard": 4}, ("dp_shard",), (4,)),
        ({"dp_replicate": 2, "dp_shard": 4}, ("dp_replicate", "dp_shard"), (2, 4)),
        ({"tp": 2}, ("dp_replicate", "tp"), (1, 2)),
        ({"pp": 2, "dp_shard": 2, "cp": 3, "tp": 2}, ("pp", "dp_shard", "cp", "tp"), (2, 2, 3, 2)),
    ],
)
def test_mesh_names_are_stable_and_its_product_is_the_world_size(kwargs, names, shape) -> None:
    plan = ParallelPlan(**kwargs)
    assert plan.mesh == (names, shape)
    size = 1
    for n in shape:
        size *= n
    assert plan.world_size == size


def test_expert_axes_overlap_the_mesh_and_do_not_grow_the_world() -> None:
    plain = ParallelPlan(dp_shard=4, tp=2)
    moe = ParallelPlan(dp_shard=4, tp=2, ep=8)  # etp=1: experts cut from dp_shard x cp x tp
    assert moe.world_size == plain.world_size == 8
    assert moe.mesh == plain.mesh
    assert ParallelPlan(dp_shard=4, tp=2, ep=4, etp=2).world_size == 8  # etp=tp: from dp_shard x cp
    assert moe.active_axes == ("dp_shard", "tp", "ep")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"dp_shard": 2, "tp": 2, "ep": 8}, "ep=8 must divide dp_shard x cp x tp = 4"),
        ({"dp_shard": 2, "tp": 2, "ep": 4, "etp": 2}, "ep=4 must divide dp_shard x cp = 2"),
        ({"tp": 4, "etp": 2}, "etp must be 1 or equal to tp=4, got 2"),
    ],
)
def test_expert_degrees_the_mesh_cannot_hold_are_refused(kwargs, needle) -> None:
    with pytest.raises(ConfigError) as err:
        ParallelPlan(**kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ParallelPlan)])
@pytest.mark.parametrize("bad", [0, -1, 1.0, "2", True, None])
def test_each_field_must_be_a_positive_int_and_the_error_names_it(field, bad) -> None:
    with pytest.raises(ConfigError) as err:
        ParallelPlan(**{field: bad})
    assert isinstance(err.value, (NnxError, ValueError))
    assert f"ParallelPlan.{field} must be a positive int, got {bad!r}" in str(err.value)


def test_plan_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelPlan().tp = 2  # type: ignore[misc]


# --- BackendCapabilities and check_plan -------------------------------------------------------------


def test_capabilities_refuse_unknown_axes_and_precisions() -> None:
    with pytest.raises(ConfigError, match=r"unknown axes \['fsdp'\]"):
        BackendCapabilities(name="x", axes=frozenset({"fsdp"}))
    with pytest.raises(ConfigError, match=r"unknown precisions \['fp8'\]"):
        BackendCapabilities(name="x", axes=frozenset(), precisions=frozenset({"fp8"}))
    with pytest.raises(ConfigError, match="non-empty str"):
        BackendCapabilities(name="", axes=frozenset())


@pytest.mark.parametrize("axis", [a for a in AXES if a != "dp_replicate"])
def test_check_plan_names_the_axis_the_backend_does_not_execute(axis) -> None:
    caps = BackendCapabilities(name="dp-only", axes=frozenset({"dp_replicate"}))
    kwargs = {"dp_shard": 2, "ep": 2} if axis == "ep" else {"tp": 2, "etp": 2} if axis == "etp" else {axis: 2}
    plan = ParallelPlan(dp_replicate=2, **kwargs)
    with pytest.raises(PlanRefusedError) as err:
        check_plan(plan, caps)
    first = next(a for a in AXES if a != "dp_replicate" and getattr(plan, a) > 1)  # first in AXES order
    assert first == ("dp_shard" if axis == "ep" else "tp" if axis == "etp" else axis)
    assert f"does not execute axis {first!r}" in str(err.value)
    assert "it executes: dp_replicate" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_check_plan_accepts_what_the_backend_executes() -> None:
    caps = BackendCapabilities(name="hsdp", axes=frozenset({"dp_replicate", "dp_shard"}))
    check_plan(ParallelPlan(dp_replicate=2, dp_shard=4, gradient_accumulation_steps=3), caps)
    check_plan(ParallelPlan(), BackendCapabilities(name="none", axes=frozenset()))  # every axis 1


def test_check_plan_refuses_an_incompatible_combination_and_a_precision() -> None:
    caps = BackendCapabilities(
        name="x", axes=frozenset({"pp", "cp", "tp"}), incompatible_axis_sets=(frozenset({"pp", "cp"}),)
    )
    check_plan(ParallelPlan(pp=2, tp=2), caps)
    with pytest.raises(PlanRefusedError, match=r"does not execute axes \['cp', 'pp'\] together"):
        check_plan(ParallelPlan(pp=2, cp=2), caps)
    with pytest.raises(PlanRefusedError, match="does not run precision 'fp16'"):
        check_plan(ParallelPlan(), caps, precision="fp16")


# --- the registry -----------------------------------------------------------------------------------


def test_a_lazy_factory_is_called_once_on_first_lookup(registry) -> None:
    calls = []

    def factory():
        calls.append(1)
        return _Backend("lazy")

    register_training_backend("lazy", factory)
    assert calls == []
    first = get_training_backend("lazy")
    assert get_training_backend("lazy") is first
    assert calls == [1]


def test_concurrent_first_lookups_call_the_factory_once(registry) -> None:
    calls = []
    gate = threading.Barrier(8)

    def factory():
        calls.append(1)
        return _Backend("race")

    register_training_backend("race", factory)
    got = []

    def look():
        gate.wait()
        got.append(get_training_backend("race"))

    threads = [threading.Thread(target=look) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and len(got) == 8 and all(b is got[0] for b in got)


def test_re_registering_is_refused_without_override(registry) -> None:
    a, b = _Backend("a"), _Backend("b")
    register_training_backend("dup", a)
    with pytest.raises(BackendRegistrationError, match="'dup' is already registered; pass override=True"):
        register_training_backend("dup", b)
    assert get_training_backend("dup") is a
    register_training_backend("dup", b, override=True)
    assert get_training_backend("dup") is b


def test_an_unknown_name_lists_the_registered_ones(registry) -> None:
    register_training_backend("zeta", _Backend("zeta"))
    with pytest.raises(UnknownBackendError) as err:
        get_training_backend("megatron")
    msg = str(err.value)
    assert msg.startswith("no training backend named 'megatron'; registered: [")
    assert "'torch-ddp'" in msg and "'zeta'" in msg
    assert isinstance(err.value, KeyError) and isinstance(err.value, NnxError)


def test_what_is_neither_backend_nor_factory_is_refused(registry) -> None:
    with pytest.raises(BackendRegistrationError, match="takes a backend"):
        register_training_backend("bad", 42)
    with pytest.raises(BackendRegistrationError, match="non-empty str"):
        register_training_backend("", _Backend())
    register_training_backend("liar", lambda: object())
    with pytest.raises(BackendRegistrationError, match="returned <object"):
        get_training_backend("liar")
    assert "liar" in registered_backends()


def test_a_factory_that_fails_is_retried_on_the_next_lookup(registry) -> None:
    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) == 1:
            raise ImportError("optional dependency missing")
        return _Backend("flaky")

    register_training_backend("flaky", flaky)
    with pytest.raises(ImportError):
        get_training_backend("flaky")
    assert get_training_backend("flaky").capabilities.name == "flaky"
    assert len(attempts) == 2


# --- the torch DDP backend ------------------------------------------------------------------------


def test_torch_ddp_declares_exactly_what_it_executes() -> None:
    backend = get_training_backend("torch-ddp")
    caps = backend.capabilities
    assert caps.name == "torch-ddp" == backend.name
    assert caps.axes == frozenset({"dp_replicate"})
    assert caps.precisions == frozenset({"fp32", "bf16"})  # fp16 is refused under DDP (wrap.check_distributed)
    assert (caps.distributed_optimizer, caps.reshardable_checkpoint, caps.elastic_restart) == (False, False, True)
    backend.check(backend.plan(2, gradient_accumulation_steps=4))
    with pytest.raises(PlanRefusedError, match="does not execute axis 'dp_shard'"):
        backend.check(ParallelPlan(dp_shard=2))
    with pytest.raises(PlanRefusedError, match="does not execute axis 'tp'"):
        backend.strategy(ParallelPlan(dp_replicate=2, tp=2))
    with pytest.raises(PlanRefusedError, match="does not run precision 'fp16'"):
        backend.check(backend.plan(2), precision="fp16")
    from nnx_es.distributed import DDP

    assert backend.strategy(backend.plan(2), writer_rank=1) == DDP(writer_rank=1)


def test_what_torch_ddp_declares_matches_what_the_trainer_refuses() -> None:
    """The declaration and the trainer path agree: a precision not declared is refused by the trainer."""
    import torch
    from torch import nn

    from nnx_es import Trainer
    from nnx_es.distributed import DDP

    caps = get_training_backend("torch-ddp").capabilities
    for precision in ("fp32", "bf16", "fp16"):
        net = nn.Linear(2, 2)
        make = lambda: Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.MSELoss(), precision=precision,
                               distributed=DDP(), progress=False)  # noqa: E731
        if precision in caps.precisions:
            make()
        else:
            with pytest.raises(ConfigError, match="does not run precision"):
                make()


def test_the_registry_module_imports_no_torch_itself() -> None:
    tree = ast.parse((REPO / "nnx_es" / "distributed" / "contracts.py").read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) == {"nnx_es"}
    assert "torch" not in roots


def test_importing_the_registry_imports_no_optional_dependency_nor_the_backend() -> None:
    code = (
        "import sys\n"
        "from nnx_es.distributed.contracts import get_training_backend, registered_backends\n"
        "optional = {'sklearn', 'matplotlib', 'tensorboard', 'mlflow', 'jsonschema', 'hypothesis',\n"
        "            'torch.distributed.fsdp', 'deepspeed', 'megatron', 'ray'}\n"
        "loaded = sorted(optional & set(sys.modules))\n"
        "assert not loaded, loaded\n"
        "assert 'nnx_es.distributed.torch_backend' not in sys.modules\n"
        "assert 'torch-ddp' in registered_backends()\n"
        "b = get_training_backend('torch-ddp')\n"
        "assert 'nnx_es.distributed.torch_backend' in sys.modules\n"
        "assert b.capabilities.name == 'torch-ddp'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
