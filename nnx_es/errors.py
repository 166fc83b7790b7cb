"""Errors of the runtime. All derive from :class:`events.NnxError` and a matching built-in."""

from __future__ import annotations

from events.errors import CorruptEventError, EventLogError, NnxError, UnsafePathError

__all__ = [
    "CheckpointUnavailableError",
    "CheckpointWriteError",
    "ConfigError",
    "CorruptCheckpointError",
    "CorruptEventError",
    "DivergenceError",
    "EventLogError",
    "ExportMismatchError",
    "InvalidRunIdError",
    "LeaseHeldError",
    "MissingDirectoryError",
    "NnxError",
    "NoUpdateError",
    "NonFiniteError",
    "NonFiniteWarning",
    "RecipeError",
    "ResumeError",
    "RunExistsError",
    "UnsafePathError",
    "UnsafePayloadError",
    "UnsafeRecipeError",
]


class ConfigError(NnxError, ValueError):
    """A trainer, monitor, scheduler or callback was configured with a bad value."""


class RunExistsError(ConfigError):
    """A new run (not a resume) was asked for a run id whose directory already holds an event log.

    run_dir: that run's directory (a front end says how to continue it in its own terms).
    """

    def __init__(self, message: str, run_dir: str = "") -> None:
        super().__init__(message)
        self.run_dir = run_dir


class InvalidRunIdError(NnxError, ValueError):
    """A run id is empty, too long, or has characters outside ``[A-Za-z0-9._-]``."""


class LeaseHeldError(NnxError, BlockingIOError):
    """Another process holds the writer lease of this run."""


class CorruptCheckpointError(NnxError, ValueError):
    """A manifest or blob is missing, torn, or does not match its SHA-256 name."""


class UnsafePayloadError(CorruptCheckpointError):
    """A checkpoint blob holds a payload the safe loader refuses (e.g. a code-running pickle)."""


class CheckpointWriteError(NnxError, OSError):
    """A checkpoint or view file could not be made durable."""


class MissingDirectoryError(NnxError, FileNotFoundError):
    """The directory a file was to be written into does not exist (it is never created implicitly)."""


class ResumeError(NnxError, RuntimeError):
    """A run cannot be resumed from its LAST commit (the reason is named)."""


class CheckpointUnavailableError(NnxError, LookupError):
    """The checkpoint whose weights were asked for (``NNModel.load``, ``WeightsFrom``) cannot be
    loaded: the run committed none of that kind, retention pruned it, or it holds no averaged
    weights (the reason and what to do are named)."""


class NonFiniteError(NnxError, FloatingPointError):
    """A loss, gradient or validation metric was not finite and the trainer's ``nonfinite="raise"``."""


class NonFiniteWarning(RuntimeWarning):
    """Updates were skipped, or a validation metric was not finite, under ``nonfinite="skip"``."""


class DivergenceError(NnxError, RuntimeError):
    """The ranks of a data-parallel run hold different parameters (their digests differ)."""


class NoUpdateError(NnxError, RuntimeError):
    """A run trained microbatches but committed no optimizer update: it does not end "completed"."""


class RecipeError(ConfigError):
    """A recipe cannot be made or rebuilt: an argument that cannot be recovered, a misspelt
    keyword, a target that is not importable (the argument or path is named)."""


class UnsafeRecipeError(RecipeError):
    """A recipe names something outside the allowed module prefixes, a private name, or an
    alias that resolves elsewhere; nothing it names was imported."""


class ExportMismatchError(NnxError, ValueError):
    """An exported artifact, run on the sample batch, does not compute what the PyTorch model computes
    within the stated tolerances (the numbers are named); nothing was written or recorded."""
