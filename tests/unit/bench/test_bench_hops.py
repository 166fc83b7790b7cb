"""``bench.hops`` counts a microbatch's calls between the project's files and finds calls back up
into a module already on the stack; the default run makes none (issue 29: no step back into a
module a microbatch or an epoch's validation and commit already left)."""

from __future__ import annotations

import pytest

pytest.importorskip("sklearn")

from bench import hops as bench_hops  # noqa: E402


def test_a_default_run_calls_nothing_back_up_and_each_microbatch_enters_the_step_recorder_once() -> None:
    calls, back = bench_hops.hops(short=1, long=2)
    assert back == {}  # validation and the commit included: nothing calls into a module on the stack
    assert calls[("nnx_es/runtime/loop.py", "nnx_es/runtime/steps.py:train")] == 1.0
    assert calls[("nnx_es/runtime/engine.py", "nnx_es/runtime/window.py:read")] == 1.0  # one host read an update


def test_a_call_back_up_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # before it moved into nnx_es/runtime/validation.py the loop's validation pass was Trainer.validate:
    # a call back into trainer.py, on the stack below the loop (Trainer.fit). A pass compiled as
    # validation.py's own code that asks the Trainer again must be reported.
    from nnx_es.runtime import validation

    real = validation.Validation.run
    scope: dict[str, object] = {"real": real}
    source = "def run(self, loader, **kw):\n    kw['ctx'].trainer.recorder\n    return real(self, loader, **kw)\n"
    exec(compile(source, validation.__file__, "exec"), scope)  # noqa: S102 - the test's own code
    monkeypatch.setattr(validation.Validation, "run", scope["run"])
    _, back = bench_hops.hops(short=1, long=2)
    assert list(back) == [("nnx_es/runtime/validation.py", "nnx_es/trainer.py:recorder")]  # that call, nothing else
