"""The user's own package in a spec (``--allow mypkg``): its model, data factory and lr_lambda build by type, a
resume needs the same --allow, and its classes are still checked against their slot."""

from __future__ import annotations

import json

from spec_drive import drive

PACKAGE = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.width = width
        self.lin = nn.Linear(width, 2)

    def forward(self, x):
        return self.lin(x)


def loaders(width: int = 4, rows: int = 32):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, width, generator=g), torch.randint(0, 2, (rows,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8), DataLoader(TensorDataset(x, y), batch_size=16)


def halve(epoch: int) -> float:
    return 0.5 ** epoch
'''


def recipe(target: str, **kwargs) -> dict:
    return {"@type": "recipe", "target": target, "kwargs": kwargs}


def test_a_users_package_runs_with_allow_and_its_resume_needs_the_same_allow(tmp_path) -> None:
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "models.py").write_text(PACKAGE)
    spec = {
        "model": recipe("mypkg.models:Net", width=4),
        "optimizers": {"main": recipe("torch.optim.sgd:SGD", lr=0.1)},
        "loss": recipe("torch.nn.modules.loss:CrossEntropyLoss"),
        "schedulers": [recipe("nnx_es.schedulers:Scheduler", name="halving", scheduler=recipe(
            "torch.optim.lr_scheduler:LambdaLR", optimizer={"@optimizer": "main"},
            lr_lambda={"@ref": "mypkg.models:halve"}))],
        "data": recipe("mypkg.models:loaders", width=4),
        "epochs": 1,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    wrong = {**spec, "callbacks": [recipe("mypkg.models:Net")]}  # a Module where a Callback goes
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    found, stderr = drive(tmp_path, [["run", "spec.json", "--allow", "mypkg", "--run-id", "u"],
                                     ["resume", "runs/u", "--epochs", "2"],
                                     ["resume", "runs/u", "--epochs", "2", "--allow", "mypkg"],
                                     ["run", "wrong.json", "--allow", "mypkg", "--run-id", "w"]], [])
    assert found["codes"] == [0, 2, 0, 2], stderr
    lines = stderr.strip().splitlines()
    assert "mypkg.models:Net" in lines[0] and "outside the allowed module prefixes" in lines[0], stderr
    assert "spec callbacks[0]" in lines[1] and "callback" in lines[1], stderr
    assert not (tmp_path / "runs" / "w").exists()


def test_the_console_script_finds_an_allowed_module_beside_the_spec_and_in_the_working_directory(tmp_path) -> None:
    """``nnx-es`` (the console script, whose sys.path starts at its bin/) finds ``--allow mymodels`` beside the
    spec and in the working directory, as ``python -m nnx_es`` does."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("nnx-es")
    if not script.exists():
        import pytest

        pytest.skip(f"no nnx-es console script beside {sys.executable} (the package is not installed)")
    project = tmp_path / "project"
    project.mkdir()
    (project / "mymodels.py").write_text(PACKAGE)
    spec = {"model": recipe("mymodels:Net", width=4), "optimizers": {"main": recipe("torch.optim.sgd:SGD", lr=0.1)},
            "loss": recipe("torch.nn.modules.loss:CrossEntropyLoss"), "data": recipe("mymodels:loaders", width=4),
            "epochs": 1}
    (project / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user's shell: nothing added
    for cwd, path in ((tmp_path, "project/spec.json"), (project, "spec.json")):
        out = subprocess.run([str(script), "report", path, "--allow", "mymodels"], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "valid" in out.stdout, (cwd, out.stdout, out.stderr)
    run = subprocess.run([str(script), "run", "spec.json", "--allow", "mymodels", "--run-id", "mine"], cwd=project,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (project / "runs" / "mine" / "events.lmdb" / "data.mdb").exists()


def test_an_allowed_module_found_neither_in_the_working_directory_nor_beside_the_spec_says_where_it_was_looked_for(
        tmp_path) -> None:
    """``--allow mymodels`` kept elsewhere (a resume run from another directory, a spec copied away from its
    module): the one line names the directories searched and what to do, not "No module named" alone."""
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "mymodels.py").write_text(PACKAGE)
    (tmp_path / "specs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    spec = {"model": recipe("mymodels:Net", width=4), "optimizers": {"main": recipe("torch.optim.sgd:SGD", lr=0.1)},
            "loss": recipe("torch.nn.modules.loss:CrossEntropyLoss"), "data": recipe("mymodels:loaders", width=4),
            "epochs": 1}
    (tmp_path / "specs" / "spec.json").write_text(json.dumps(spec))
    found, stderr = drive(tmp_path / "elsewhere", [["run", "../specs/spec.json", "--allow", "mymodels", "--run-id", "x"]],
                          [])
    assert found["codes"] == [2], stderr
    (line,) = stderr.strip().splitlines()
    assert "No module named 'mymodels'" in line, line
    assert (f"--allow 'mymodels' is looked for in the working directory and beside the spec file "
            f"({(tmp_path / 'elsewhere').resolve()}, {(tmp_path / 'specs').resolve()}): run from the directory holding "
            "it, or put it on PYTHONPATH or install it") in line, line
    assert not (tmp_path / "elsewhere" / "runs" / "x").exists()
