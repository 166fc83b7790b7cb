"""nnx_es: an event-sourced training runtime for PyTorch.

Every lifecycle transition of a training run is an immutable event in an LMDB
log (``runs/<id>/events.lmdb``); history, LAST/BEST, scheduler state and
counters are projections of that log.
"""

from typing import TYPE_CHECKING, Any

from nnx_es.errors import (
    CheckpointUnavailableError,
    CheckpointWriteError,
    ConfigError,
    CorruptCheckpointError,
    CorruptEventError,
    EventLogError,
    InvalidRunIdError,
    LeaseHeldError,
    NnxError,
    NoUpdateError,
    NonFiniteError,
    NonFiniteWarning,
    RecipeError,
    ResumeError,
    UnsafePathError,
    UnsafePayloadError,
    UnsafeRecipeError,
)

if TYPE_CHECKING:
    from nnx_es.callbacks import Callback, EarlyStopping, LambdaCallback
    from nnx_es.diagnostics.findings import diagnose
    from nnx_es.diagnostics.lr_range import lr_find
    from nnx_es.diagnostics.recorder import Diagnostics
    from nnx_es.runtime.context import TrainContext
    from nnx_es.runtime.engine import default_forward
    from nnx_es.runtime.steps import default_train_step, finalize_step
    from nnx_es.finetune import Freeze, WeightsFrom, param_groups
    from nnx_es.loss_weights import Constant, Cosine, LinearWarmup, StepWeight
    from nnx_es.nnmodel import NNModel
    from nnx_es.models import Keyed
    from nnx_es.monitor import Monitor
    from nnx_es.objective import Objective, Term
    from nnx_es.plan import ExperimentPlan
    from nnx_es.result import RunResult, load_result
    from nnx_es.rows import HistoryJournal, read_rows, with_row_ids
    from nnx_es.schedulers import Scheduler
    from nnx_es.sinks import CsvSink, MlflowSink, TensorBoardSink
    from nnx_es.stages import TrainingStage
    from nnx_es.trainer import Trainer
    from nnx_es.update_hooks import EMA, GradientAccumulation, GradientClipping, MixedPrecision, UpdateHook

# The runtime's public names load on first use (PEP 562), so the tools that only
# read a run (tools/replay, tools/inspect) start without importing torch.
_LAZY = {
    "Callback": "nnx_es.callbacks", "EarlyStopping": "nnx_es.callbacks", "LambdaCallback": "nnx_es.callbacks",
    "TrainContext": "nnx_es.runtime.context",
    "default_forward": "nnx_es.runtime.engine", "default_train_step": "nnx_es.runtime.steps",
    "finalize_step": "nnx_es.runtime.steps",
    "NNModel": "nnx_es.nnmodel", "ExperimentPlan": "nnx_es.plan", "Monitor": "nnx_es.monitor",
    "Objective": "nnx_es.objective",
    "Term": "nnx_es.objective", "RunResult": "nnx_es.result", "load_result": "nnx_es.result",
    "Scheduler": "nnx_es.schedulers", "TrainingStage": "nnx_es.stages", "Trainer": "nnx_es.trainer",
    "EMA": "nnx_es.update_hooks", "GradientAccumulation": "nnx_es.update_hooks",
    "GradientClipping": "nnx_es.update_hooks", "MixedPrecision": "nnx_es.update_hooks",
    "UpdateHook": "nnx_es.update_hooks",
    "HistoryJournal": "nnx_es.rows", "read_rows": "nnx_es.rows", "with_row_ids": "nnx_es.rows",
    "CsvSink": "nnx_es.sinks", "MlflowSink": "nnx_es.sinks", "TensorBoardSink": "nnx_es.sinks",
    "Freeze": "nnx_es.finetune", "WeightsFrom": "nnx_es.finetune", "param_groups": "nnx_es.finetune",
    "Constant": "nnx_es.loss_weights", "Cosine": "nnx_es.loss_weights", "LinearWarmup": "nnx_es.loss_weights",
    "StepWeight": "nnx_es.loss_weights", "Keyed": "nnx_es.models",
    "Diagnostics": "nnx_es.diagnostics.recorder", "diagnose": "nnx_es.diagnostics.findings",
    "lr_find": "nnx_es.diagnostics.lr_range",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nnx_es' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.1.0"

__all__ = [
    "Callback",
    "CheckpointUnavailableError",
    "CheckpointWriteError",
    "ConfigError",
    "Constant",
    "CorruptCheckpointError",
    "CorruptEventError",
    "Cosine",
    "CsvSink",
    "Diagnostics",
    "EMA",
    "EarlyStopping",
    "EventLogError",
    "ExperimentPlan",
    "Freeze",
    "GradientAccumulation",
    "GradientClipping",
    "HistoryJournal",
    "InvalidRunIdError",
    "Keyed",
    "LambdaCallback",
    "LeaseHeldError",
    "LinearWarmup",
    "MixedPrecision",
    "MlflowSink",
    "Monitor",
    "NNModel",
    "NnxError",
    "NoUpdateError",
    "NonFiniteError",
    "NonFiniteWarning",
    "Objective",
    "RecipeError",
    "ResumeError",
    "RunResult",
    "Scheduler",
    "StepWeight",
    "TensorBoardSink",
    "Term",
    "TrainContext",
    "Trainer",
    "TrainingStage",
    "UnsafePathError",
    "UnsafePayloadError",
    "UnsafeRecipeError",
    "UpdateHook",
    "WeightsFrom",
    "default_forward",
    "default_train_step",
    "diagnose",
    "finalize_step",
    "load_result",
    "lr_find",
    "param_groups",
    "read_rows",
    "with_row_ids",
]
