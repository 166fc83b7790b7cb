"""Hostile spec JSON through the CLI's loading path (``nnx-es report``, in-process): every case exits 0 or 2 with
one line, raises nothing past the CLI, and ends within a bound -- never a traceback or a hang."""

from __future__ import annotations

import contextlib
import io
import json
import signal
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnx_es.cli.main import main
from nnx_es.recipes.runspec import scaffold

#: seconds a case may take (building an MLP, drawing the preview included)
BOUND_S = 30

#: import paths a fuzzed recipe names: the spec's own, others of each slot, and ones no slot takes
TARGETS = [
    "nnx_es.recipes.models:MLP", "torch.optim.adam:Adam", "torch.optim.sgd:SGD", "nnx_es.schedulers:Scheduler",
    "torch.optim.lr_scheduler:ReduceLROnPlateau", "torch.optim.lr_scheduler:StepLR",
    "torch.optim.lr_scheduler:LambdaLR",
    "torch.nn.modules.loss:CrossEntropyLoss", "nnx_es.objective:Objective", "nnx_es.objective:Term",
    "nnx_es.callbacks:EarlyStopping", "nnx_es.callbacks:LambdaCallback", "nnx_es.monitor:Monitor",
    "nnx_es.update_hooks:GradientAccumulation", "nnx_es.recipes.data:tabular", "torch.nn.modules.linear:Linear",
    "torch.utils.collect_env:run", "nnx_es.recipes.core:from_spec", "os:system", "torch:save", "torch.nn:Module",
    "nnx_es.testing:anything", "torch._C:_nn", "torch.onnx:export", "a:b:c", "", "torch.nn:", ":x", "nnx_es.cli.train",
]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.sampled_from([2**31, 2**63, 2**70, -2**63]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(TARGETS))
markers = st.one_of(
    st.builds(lambda t, k: {"@type": "recipe", "target": t, "kwargs": k}, st.sampled_from(TARGETS),
              st.dictionaries(st.sampled_from(["lr", "in_features", "hidden", "optimizer", "scheduler", "weight",
                                               "terms", "name", "patience", "fn", "on_epoch_end", "x"]),
                              scalars, max_size=3)),
    st.builds(lambda t: {"@ref": t}, st.sampled_from(TARGETS)),
    st.builds(lambda o: {"@optimizer": o}, st.one_of(st.just("main"), scalars)),
    st.builds(lambda v, d: {"@tensor": v, "dtype": d}, st.lists(st.one_of(st.floats(-2, 2), st.text(max_size=2)),
                                                                 max_size=4),
              st.sampled_from(["float32", "int64", "onnx", "_dynamo", "distributed", 3, None])),
    st.builds(lambda g: {"@params": g}, st.one_of(st.none(), scalars, st.lists(st.dictionaries(
        st.sampled_from(["names", "lr"]), st.one_of(scalars, st.lists(st.text(max_size=12), max_size=2)),
        max_size=2), max_size=2))),
)
values = st.recursive(st.one_of(scalars, markers), lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=12)


def _paths(value, prefix=()):
    """Every (path, value) inside ``value``, mappings and lists walked."""
    yield prefix, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


@st.composite
def hostile_specs(draw) -> bytes:
    """The scaffolded spec with a few of its values replaced, or JSON that is no spec at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.one_of(st.binary(max_size=40), st.builds(lambda v: json.dumps(v).encode(), values),
                              st.builds(lambda n: b"[" * n + b"]" * n, st.integers(1, 100_000))))
    spec = msgspec.to_builtins(scaffold(epochs=draw(st.integers(0, 3))))
    for _ in range(draw(st.integers(1, 3))):
        places = [p for p, _ in _paths(spec) if p]
        path = draw(st.sampled_from(places))
        parent = spec
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = draw(values)
    return json.dumps(spec).encode()


class CaseTooSlow(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTooSlow(f"a case took more than {BOUND_S} s")


@pytest.fixture
def bounded():
    previous = signal.signal(signal.SIGALRM, _alarm)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(document=hostile_specs())
def test_hostile_spec_json_exits_0_or_2_with_one_line_within_a_bound(tmp_path: Path, bounded, document) -> None:
    spec, png = tmp_path / "fuzz.json", tmp_path / "fuzz.png"
    spec.write_bytes(document)
    out, err = io.StringIO(), io.StringIO()
    signal.setitimer(signal.ITIMER_REAL, BOUND_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["report", str(spec), "--png", str(png)])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    assert code in (0, 2), err.getvalue()
    if code == 2:
        assert len(err.getvalue().strip().splitlines()) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
