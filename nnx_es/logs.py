"""structlog set-up: a human console on a terminal, JSON lines otherwise.

Logs are diagnostics only; nothing is ever derived from them (the event log is the record).
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging", "ensure_logging"]


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog for nnx_es.

    Args:
        level: ``debug`` | ``info`` | ``warning`` | ``error``.
        json: JSON lines when true, a console renderer when false; default:
            JSON unless stderr is a terminal.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"level must be one of debug, info, warning, error; got {level!r}")
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )


def _stderr_logger(*_args: object) -> structlog.PrintLogger:
    """A logger on the *current* ``sys.stderr`` (resolved per call: loggers are not cached),
    so a stream swapped or closed since configuration is never written to."""
    return structlog.PrintLogger(sys.stderr)


def ensure_logging() -> None:
    """Configure defaults (warnings and errors only) unless the application configured structlog."""
    if not structlog.is_configured():
        configure_logging("warning")
