"""Killing a training process at a chosen point, from a warm parent (fork, no new interpreter).

``run_killed(target, kill)`` forks; the child installs ``kill`` (a function
that monkeypatches a seam to SIGKILL the process at the chosen moment), runs
``target`` and exits. The parent waits and reports how the child ended.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from nnx_es.recorder import Recorder


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run_killed(target: Callable[[], Any], kill: Callable[[], None] | None = None) -> str:
    """Run ``target`` in a forked child; return ``"killed"``, ``"completed"`` or ``"error: ..."``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            if kill is not None:
                kill()
            target()
        except BaseException as exc:  # noqa: BLE001
            os.write(w, f"{type(exc).__name__}: {exc}".encode()[:2000])
            code = 3
        finally:
            os.close(w)
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        message = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "completed"
    return f"error: {message or status}"


def kill_at_event(n: int) -> Callable[[], None]:
    """A ``kill`` that SIGKILLs the process just before its n-th (0-based) event of this session is checked."""

    def install() -> None:
        original = Recorder.emit
        count = [0]

        def emit(self: Recorder, event: Any) -> int:
            if count[0] == n:
                sigkill()
            count[0] += 1
            return original(self, event)

        Recorder.emit = emit  # type: ignore[method-assign]

    return install


def kill_at_call(module: Any, name: str, n: int, *, after: bool = False) -> Callable[[], None]:
    """A ``kill`` that SIGKILLs at the n-th (0-based) call of ``module.name`` (before it, or after it returns)."""

    def install() -> None:
        original = getattr(module, name)
        count = [0]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            hit = count[0] == n
            count[0] += 1
            if hit and not after:
                sigkill()
            result = original(*args, **kwargs)
            if hit and after:
                sigkill()
            return result

        setattr(module, name, wrapper)

    return install
