"""tests/warmkit.py's children start and end as new interpreters would: what they read from the environment,
their random states and hash seeds, their exit status, and a hang cut at the bound with nothing left running."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

import warmkit

PROBE = """
import json, os, random, sys
import numpy, torch
print(json.dumps({"hash": hash("nnx-es"), "numpy": float(numpy.random.random()), "random": random.random(),
                  "threads": torch.get_num_threads(), "main": sys.modules["__main__"].__name__}))
"""


def test_two_jobs_in_a_row_differ_in_hash_seed_and_random_states_and_each_reads_its_thread_count(tmp_path) -> None:
    env = warmkit.environment({"OMP_NUM_THREADS": "1"})
    first, second = (warmkit.python_c(PROBE, cwd=tmp_path, env=env) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["numpy"] != b["numpy"] and a["random"] != b["random"]
    if "PYTHONHASHSEED" not in os.environ:  # set: every process has it, as every new interpreter would
        assert a["hash"] != b["hash"]
    assert a["threads"] == b["threads"] == 1 and a["main"] == "__main__"
    env["OMP_NUM_THREADS"] = "2"
    assert json.loads(warmkit.python_c(PROBE, cwd=tmp_path, env=env).stdout)["threads"] == 2


def test_a_failing_or_killed_child_ends_with_its_status_and_a_hanging_one_is_cut_at_the_bound(tmp_path) -> None:
    failed = warmkit.python_c("raise SystemExit('no such thing')", cwd=tmp_path)
    assert failed.returncode == 1 and "no such thing" in failed.stderr
    raised = warmkit.python_c("1 / 0", cwd=tmp_path)
    assert raised.returncode == 1 and "ZeroDivisionError" in raised.stderr
    killed = warmkit.python_c("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", cwd=tmp_path)
    assert killed.returncode == -9
    # a child and a process it started, both hanging: cut at the bound, both gone
    hang = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "open('pid', 'w').write(str(p.pid)); print('started', flush=True); time.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        warmkit.python_c(hang, cwd=tmp_path, timeout=5)
    assert time.monotonic() - start < 30 and "started" in (info.value.output or "")
    grandchild = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(grandchild):
        time.sleep(0.1)
    assert not _alive(grandchild)
    assert warmkit.python_c("print('after')", cwd=tmp_path).stdout == "after\n"  # the warm process serves on


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_shims_command_still_running_when_its_warm_process_ends_is_killed_and_the_shim_ends(tmp_path) -> None:
    """A torchrun rank left hanging by a launch killed at its timeout (its shim in a session of its own) does not
    outlive the session's warm process."""
    warm = warmkit.Warm()
    try:
        (tmp_path / "hang.py").write_text("import os, time\nopen('pid', 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
        shim = subprocess.Popen([str(warm.python_shim()), "hang.py"], cwd=tmp_path, start_new_session=True,
                                env={**warmkit.environment(), warmkit.SOCKET_VAR: warm.socket})
        deadline = time.monotonic() + 60
        while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        command = int((tmp_path / "pid").read_text())
        assert _alive(command) and command != shim.pid  # the script runs in a child of the warm process
    finally:
        warm.close()
    assert shim.wait(timeout=30) == -9
    assert not _alive(command)
