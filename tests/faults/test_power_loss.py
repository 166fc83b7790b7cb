"""Power cuts (not process kills): the states the disk may hold after a cut at each sync of a
traced run, each checked (nothing committed is lost, the audit holds, the run resumes bitwise);
planted durability bugs are caught. See nnx_es/testing/powerloss.py.

A script or ``nnx-es crashtest`` runs in a child of the suite's warm process (tests/warmkit.py); the traced
run it starts is a new interpreter (the tracing shim is loaded at exec), as ever."""

from __future__ import annotations

import pytest

import powerkit
import warmkit
from nnx_es.errors import ConfigError
from nnx_es.testing import power_loss_test
from nnx_es.testing.tracer import NoCompilerError, build_shim

EPOCHS = 3


@pytest.fixture(scope="module", autouse=True)
def shim():
    try:
        return build_shim()
    except NoCompilerError as exc:
        pytest.skip(f"power-loss tests trace with an LD_PRELOAD shim built by a C compiler: {exc}")


@pytest.mark.parametrize(("build", "states"), [(powerkit.lag_0, 180), (powerkit.lag_epoch, 120)])
def test_power_cuts_after_every_sync_lose_nothing_committed_with_pruning_and_a_journal(build, states):
    report = power_loss_test(build, epochs=EPOCHS, states=states, seed=0)
    assert report.ok, report
    assert len(report.tried) >= states * 0.6, report  # identical draws are checked once
    assert report.points_with_states >= report.available - 2, report


def checks_broken(report) -> set[str]:
    return {f.check for f in report.failures}


def test_a_blob_renamed_without_its_directory_fsync_is_caught_and_the_state_kept(tmp_path):
    report = power_loss_test(powerkit.blob_renamed_without_directory_fsync, epochs=EPOCHS, states=40, seed=0,
                             keep_failed=tmp_path)
    assert not report.ok
    assert any("audit" in c or "complete checkpoint" in c for c in checks_broken(report)), report
    first = tmp_path / report.failures[0].point.replace(" ", "_") / "crashtest"
    from nnx_es.audit import audit_run

    assert not audit_run(first).ok  # the kept state shows the violation again


def test_last_synced_before_its_blobs_is_caught():
    report = power_loss_test(powerkit.last_synced_before_its_blobs, epochs=EPOCHS, states=40, seed=0)
    assert not report.ok
    assert any("audit" in c or "complete checkpoint" in c for c in checks_broken(report)), report


def test_the_old_lmdb_flags_lose_committed_events_and_are_caught():
    report = power_loss_test(powerkit.old_lmdb_flags, epochs=EPOCHS, states=60, seed=0)
    assert not report.ok
    broken = checks_broken(report)
    assert any("nothing committed is lost" in c or "reads back" in c or "resumes" in c for c in broken), report


def test_a_build_the_traced_interpreter_cannot_import_is_refused_by_name():
    def nested(runs_root, run_id):
        return powerkit.lag_0(runs_root, run_id)

    for bad in (nested, lambda r, i: None):
        with pytest.raises(ConfigError, match="module-level function"):
            power_loss_test(bad, epochs=1)


GUARDED_SCRIPT = '''
from nnx_es.testing import power_loss_test
import powerkit

if __name__ == "__main__":
    def build(runs_root, run_id):
        return powerkit.lag_0(runs_root, run_id)

    power_loss_test(build, epochs=1, states=2)
'''

UNGUARDED_SCRIPT = '''
from nnx_es.testing import power_loss_test
import powerkit


def build(runs_root, run_id):
    return powerkit.lag_0(runs_root, run_id)


power_loss_test(build, epochs=1, states=2)
'''


@pytest.mark.parametrize(("script", "message"), [
    (GUARDED_SCRIPT, r"build 'build' is not defined when the traced interpreter imports the script .*define it at "
                     r"the top level, not under `if __name__ == \"__main__\":`"),
    (UNGUARDED_SCRIPT, r"power_loss_test was called inside its own traced interpreter.*call it under "
                       r"`if __name__ == \"__main__\":`"),
], ids=["build_defined_under_the_main_guard", "script_without_the_main_guard"])
def test_a_script_whose_build_the_traced_interpreter_cannot_rebuild_is_refused_with_a_config_error(
        tmp_path, script, message):
    import os
    import re
    from pathlib import Path

    (tmp_path / "check.py").write_text(script)
    here = Path(__file__).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[2]), str(here.parent)])}
    proc = warmkit.python("check.py", cwd=tmp_path, env=env)
    assert proc.returncode != 0
    last = proc.stderr.strip().rpartition("\n")[2]
    assert last.startswith("nnx_es.errors.ConfigError: ") and re.search(message, last), proc.stderr[-3000:]
    assert "the traced reference run failed" not in proc.stderr, proc.stderr[-3000:]


def build_whose_data_is_missing(runs_root, run_id):
    raise FileNotFoundError("train.csv: my data is missing")


def test_a_traced_run_that_fails_names_the_users_error_and_nothing_of_the_harness_import():
    with pytest.raises(RuntimeError) as caught:
        power_loss_test(build_whose_data_is_missing, epochs=1, states=2)
    message = str(caught.value)
    assert message.startswith("the traced reference run failed (exit 1): ") and message.endswith(
        "FileNotFoundError: train.csv: my data is missing"), message
    assert "RuntimeWarning" not in message and "found in sys.modules" not in message, message


SCRIPT = '''
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from nnx_es import Trainer

x = torch.randn(32, 4); y = (x[:, 0] > 0).long()  # torch's global RNG, unseeded: as a fresh interpreter has it
train = DataLoader(TensorDataset(x[:24], y[:24]), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root="runs", run_id="r",
                  seed=0, progress=False)
trainer.fit(train, epochs=int(sys.argv[1]))
'''


def test_nnx_es_crashtest_power_loss_checks_a_script_that_calls_fit_itself_drawing_from_unseeded_global_rngs(
        tmp_path):
    import os
    from pathlib import Path

    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = warmkit.command("nnx-es", "crashtest", "--power-loss", "train.py", "--states", "20", "--", "2",
                           cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("power-loss test: ok") and "crash states" in proc.stdout, proc.stdout
