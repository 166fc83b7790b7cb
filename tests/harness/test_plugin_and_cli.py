"""The pytest plugin (loaded with -p, as the pytest11 entry point loads it), NNX_ES_KILL_AT,
and ``nnx-es crashtest`` on a script that calls fit itself.

``pytest`` and ``nnx-es`` run in children of the suite's warm process (tests/warmkit.py: torch imported
once); a script under NNX_ES_KILL_AT runs as a new interpreter (the variable is read when nnx_es is imported)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import warmkit
from nnx_es.injection import Point, parse_point

REPO = Path(__file__).resolve().parents[2]

SCRIPT = '''
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from nnx_es import Trainer

torch.manual_seed(0)
x = torch.randn(48, 4); y = (x[:, 0] > 0).long()
train = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
val = DataLoader(TensorDataset(x[32:], y[32:]), batch_size=16)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
opt = torch.optim.Adam(net.parameters(), lr=0.05)
trainer = Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", runs_root="runs", run_id="r", seed=0, progress=False)
trainer.fit(train, val, epochs=int(sys.argv[1]) if len(sys.argv) > 1 else 1)
'''


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NNX_ES_KILL_AT"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def test_a_point_reads_back_from_its_text_and_anything_else_is_refused():
    for text in ("event:0", "io:12:before", "sync:3:after"):
        assert str(parse_point(text)) == text
    assert parse_point("event:7") == Point("event", 7)
    for bad in ("", "event", "event:-1", "io:3", "sync:1:during", "disk:1:before"):
        with pytest.raises(ValueError, match="NNX_ES_KILL_AT"):
            parse_point(bad)


def test_nnx_es_kill_at_ends_the_process_at_that_event_and_nothing_else(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    killed = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=_env(NNX_ES_KILL_AT="event:5"),
                            capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    from trainkit import read_events

    assert len(read_events(tmp_path / "runs" / "r")) <= 5  # never past the point; a prefix of the run
    bad = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=_env(NNX_ES_KILL_AT="soon"),
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "NNX_ES_KILL_AT must be" in bad.stderr


def test_the_plugin_gives_a_suite_the_fixtures_and_the_points_option(tmp_path):
    (tmp_path / "test_mine.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from nnx_es import Trainer
        from nnx_es.testing import Fit

        def build(runs_root, run_id):
            x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0)); y = (x[:, 0] > 0).long()
            net = nn.Sequential(nn.Linear(4, 2))
            trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                              runs_root=runs_root, run_id=run_id, seed=0, progress=False)
            return Fit(trainer, DataLoader(TensorDataset(x, y), batch_size=8))

        def test_my_model_survives_crashes(crash_test, tmp_path):
            report = crash_test(build, epochs=1)
            assert report.ok, report
            assert len(report.tried) == 3 and str(tmp_path) in str(tmp_path)

        def test_my_model_survives_full_disks(fault_test):
            report = fault_test(build, epochs=1, faults=("EIO",), points=2)
            assert len(report.tried) == 2
    '''))
    from importlib.metadata import entry_points

    # the installed package registers the plugin (pyproject's pytest11 entry point): no -p needed
    assert "nnx_es.testing.pytest_plugin" in {ep.value for ep in entry_points(group="pytest11")}
    out = warmkit.command("pytest", "-q", "-p", "no:cacheprovider", "--nnx-crash-points=3", "test_mine.py",
                          cwd=tmp_path, env=_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "2 passed" in out.stdout


def test_assert_report_ok_fails_with_the_summary_and_the_first_divergence_whole_at_pytests_default_verbosity(
        tmp_path):
    (tmp_path / "test_bug.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from nnx_es import Callback, Trainer
        from nnx_es.testing import Fit

        class Warmup(Callback):  # planted bug: its epoch count is not checkpointed
            def __init__(self):
                self.seen = 0

            def on_epoch_begin(self, ctx):
                for opt in ctx.trainer.optimizers.values():
                    for g in opt.param_groups:
                        g["lr"] = 0.05 * min(1.0, (self.seen + 1) / 3)
                self.seen += 1

        def build(runs_root, run_id):
            x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0)); y = (x[:, 0] > 0).long()
            net = nn.Sequential(nn.Linear(4, 2))
            trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=0.05), nn.CrossEntropyLoss(),
                              callbacks=[Warmup()], runs_root=runs_root, run_id=run_id, seed=0, progress=False)
            return Fit(trainer, DataLoader(TensorDataset(x, y), batch_size=8))

        def test_my_model_survives_crashes(crash_test):
            report = crash_test(build, epochs=3, points=10)
            assert report.ok, report
    '''))
    out = warmkit.command("pytest", "-q", "-p", "no:cacheprovider", "test_bug.py", cwd=tmp_path, env=_env())
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    shown = next(line for line in out.stdout.splitlines() if line.startswith("E   ") and "AssertionError" in line)
    # the summary whole (no '...' elided from its middle), then the state the divergence shows in
    assert "AssertionError: crash test: FAILED -- 10 of " in shown and " failed (diverged) | " in shown, shown
    assert "first divergence at " in shown and "optimizer/adam['param_groups'][0]['lr']" in shown, shown


def test_nnx_es_crashtest_runs_a_script_under_injection_and_exits_0_when_every_point_holds(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    out = warmkit.command("nnx-es", "crashtest", "train.py", "--points", "2", "--", "1", cwd=tmp_path, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert out.stdout.startswith("crash test: ok -- 2 of ")
    assert not (tmp_path / "runs").exists()  # every run went to the harness's own directory


def test_nnx_es_crashtest_samples_20_points_by_default_and_says_how_many_all_would_run(tmp_path, monkeypatch, capsys):
    from nnx_es.cli.main import main

    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    assert main(["crashtest", "train.py", "--", "1"]) == 0  # before: every point, each in two fresh interpreters
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("crash test: ok -- 20 of "), first
    available = int(first.split(" of ")[1].split()[0])
    assert available > 20
    assert f"(a sample of 20 points, seed 0; --points all runs all {available})" in out, out


BUGGY_SCRIPT = '''
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from nnx_es import Callback, Trainer


class Warmup(Callback):  # planted bug: its epoch count is not checkpointed
    def __init__(self):
        self.seen = 0

    def on_epoch_begin(self, ctx):
        for opt in ctx.trainer.optimizers.values():
            for g in opt.param_groups:
                g["lr"] = 0.05 * min(1.0, (self.seen + 1) / 3)
        self.seen += 1


def build(runs_root="runs", run_id="r"):
    torch.manual_seed(0)
    x = torch.randn(48, 4); y = (x[:, 0] > 0).long()
    train = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=0.05), nn.CrossEntropyLoss(), callbacks=[Warmup()],
                      runs_root=runs_root, run_id=run_id, seed=0, progress=False)
    return trainer, train


if __name__ == "__main__":
    trainer, train = build()
    trainer.fit(train, epochs=int(sys.argv[1]))
'''


def test_the_forked_crashtest_of_a_script_gives_the_apis_verdicts_on_a_planted_bug(tmp_path, monkeypatch):
    import runpy

    from nnx_es.testing import crash_test
    from nnx_es.testing.script import crashtest_script

    (tmp_path / "train.py").write_text(BUGGY_SCRIPT)
    monkeypatch.chdir(tmp_path)
    api = crash_test(runpy.run_path("train.py", run_name="buggy")["build"], epochs=2, points=8,
                     runs_root=tmp_path / "api")
    cli = crashtest_script(["train.py", "2"], points=8)  # its argv, its __main__ guard, this cwd
    assert not api.ok and api.failures
    assert (cli.available, cli.tried, cli.outcomes) == (api.available, api.tried, api.outcomes)
    assert [(f.point, f.check, f.component) for f in cli.failures] == [(f.point, f.check, f.component)
                                                                        for f in api.failures]
    assert not (tmp_path / "runs").exists()  # every run went to the harness's own directory
