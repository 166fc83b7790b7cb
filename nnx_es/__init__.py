"""nnx_es: an event-sourced training runtime for PyTorch.

Every lifecycle transition of a training run is an immutable event in an LMDB
log (``runs/<id>/events.lmdb``); history, LAST/BEST, scheduler state and
counters are projections of that log.
"""

from nnx_es.callbacks import Callback, EarlyStopping, LambdaCallback
from nnx_es.context import TrainContext
from nnx_es.engine import default_forward, default_train_step, finalize_step
from nnx_es.errors import (
    CheckpointWriteError,
    ConfigError,
    CorruptCheckpointError,
    InvalidRunIdError,
    LeaseHeldError,
    NnxError,
    ResumeError,
    UnsafePayloadError,
)
from nnx_es.model import NNModel
from nnx_es.monitor import Monitor
from nnx_es.objective import Objective, Term
from nnx_es.result import RunResult, load_result
from nnx_es.schedulers import Scheduler
from nnx_es.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "CheckpointWriteError",
    "ConfigError",
    "CorruptCheckpointError",
    "EarlyStopping",
    "InvalidRunIdError",
    "LambdaCallback",
    "LeaseHeldError",
    "Monitor",
    "NNModel",
    "NnxError",
    "Objective",
    "ResumeError",
    "RunResult",
    "Scheduler",
    "Term",
    "TrainContext",
    "Trainer",
    "UnsafePayloadError",
    "default_forward",
    "default_train_step",
    "finalize_step",
    "load_result",
]
