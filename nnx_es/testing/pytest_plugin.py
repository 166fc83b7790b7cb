"""pytest plugin: the fixtures ``crash_test``, ``fault_test`` and ``power_loss_test``, and ``--nnx-crash-points=N``.

Registered through the ``pytest11`` entry point (``nnx_es.testing.pytest_plugin``), so an
installed nnx_es gives every test suite the fixtures; ``-p nnx_es.testing.pytest_plugin``
loads it by hand. One test per model of yours::

    def test_my_model_survives_crashes(crash_test):
        report = crash_test(build, epochs=3)          # build(runs_root, run_id) -> Fit
        assert report.ok, report

The fixtures are :func:`nnx_es.testing.crash_test` / :func:`~nnx_es.testing.fault_test` with
``runs_root`` bound to the test's ``tmp_path``; a call without ``points`` takes the
``--nnx-crash-points`` option (default: every point), to bound the time in CI.
``power_loss_test`` is :func:`nnx_es.testing.power_loss_test` with ``runs_root`` bound the same
way (its ``build`` must be a module-level function of the test module).
"""

from __future__ import annotations

from typing import Any

import pytest

from nnx_es.testing import harness, powerloss  # the fixtures below take their functions' names

__all__ = ["crash_test", "fault_test", "power_loss_test", "pytest_addoption"]


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("nnx_es", "nnx_es crash tests")
    group.addoption("--nnx-crash-points", type=int, default=None, metavar="N",
                    help="crash/fault points each nnx_es crash_test / fault_test tries when the test does not "
                         "say (default: every point)")


def _bind(request: Any, tmp_path: Any, fn: Any) -> Any:
    default = request.config.getoption("--nnx-crash-points")

    def run(build: Any, **kwargs: Any) -> Any:
        if kwargs.get("points") is None and default is not None:
            kwargs["points"] = default
        kwargs.setdefault("runs_root", tmp_path)
        return fn(build, **kwargs)

    return run


@pytest.fixture
def crash_test(request: Any, tmp_path: Any) -> Any:
    """:func:`nnx_es.testing.crash_test`, runs under ``tmp_path``, points from ``--nnx-crash-points``."""
    return _bind(request, tmp_path, harness.crash_test)


@pytest.fixture
def fault_test(request: Any, tmp_path: Any) -> Any:
    """:func:`nnx_es.testing.fault_test`, runs under ``tmp_path``, points from ``--nnx-crash-points``."""
    return _bind(request, tmp_path, harness.fault_test)


@pytest.fixture
def power_loss_test(tmp_path: Any) -> Any:
    """:func:`nnx_es.testing.power_loss_test`, runs under ``tmp_path``."""

    def run(build: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("runs_root", tmp_path)
        return powerloss.power_loss_test(build, **kwargs)

    return run
