"""A spec or a run handed over by someone else: each attack recipe is refused with exit 2, and another process
(tests/spec_drive.py) shows that nothing ran (a marker file), nothing was imported past the registry check, and
nothing was written."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

from events.codec import encode
from events.log import LmdbLog
from events.schema import RunStarted
from events.specs import spec_hash
from nnx_es.recipes.runspec import scaffold
import warmkit
from spec_drive import drive


def recipe(target: str, **kwargs) -> dict:
    return {"@type": "recipe", "target": target, "kwargs": kwargs}


def shared_library(tmp: Path, marker: Path) -> Path | None:
    """A shared library whose constructor creates ``marker`` when it is loaded (None: no C compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src = tmp / "evil.c"
    src.write_text('#include <fcntl.h>\n#include <unistd.h>\n__attribute__((constructor)) static void ran(void) '
                   f'{{ close(open("{marker}", O_CREAT | O_WRONLY, 0600)); }}\n'
                   "void *alloc(long n, int d, void *s) { return 0; }\nvoid release(void *p, long n, void *s) {}\n")
    lib = tmp / "libevil.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    return lib


def attacks(tmp: Path, marker: Path) -> dict[str, tuple[str, dict, list[str]]]:
    """name -> (the spec field it takes, the recipe, modules it would import); each would run on an unguarded build."""
    lib = shared_library(tmp, marker)
    return {
        "shell command in a callback": ("callbacks", recipe("torch.utils.collect_env:run_and_read_all", run_lambda={
            "@ref": "torch.utils.collect_env:run"}, command=f"touch {marker}"), []),
        "code string": ("model", recipe(
            "torch.fx.experimental.symbolic_shapes:ShapeEnv.evaluate_guards_expression",
            self=recipe("torch.fx.experimental.symbolic_shapes:ShapeEnv"), args=[],
            code=f"__import__('pathlib').Path({str(marker)!r}).touch()"), ["torch.fx.experimental.symbolic_shapes"]),
        "shared library": ("loss", recipe("torch.cuda.memory:CUDAPluggableAllocator", path_to_so_file=str(lib),
                                          alloc_fn_name="alloc", free_fn_name="release"), []),
        "file write": ("data", recipe("torch.utils.file_baton:FileBaton.try_acquire",
                                      self=recipe("torch.utils.file_baton:FileBaton", lock_file_path=str(marker))),
                       ["torch.utils.file_baton"]),
        "the guard re-entered": ("model", recipe(
            "nnx_es.recipes.core:from_spec", recipe={"target": "torch.utils.collect_env:run",
                                                      "kwargs": {"command": f"touch {marker}"}},
            allowed=recipe("nnx_es.recipes.imports:Allowed", extra=["os"])), []),
        "a shell hook nested in a callback": ("callbacks", recipe(
            "nnx_es.callbacks:LambdaCallback", on_train_begin={"@ref": "torch.utils.collect_env:run"}), []),
        "a shell command in a nested keyword": ("schedulers", recipe(
            "nnx_es.schedulers:Scheduler", scheduler=recipe("torch.utils.collect_env:run", command=f"touch {marker}")),
            []),
    }


@pytest.mark.parametrize("name", ["shell command in a callback", "code string", "shared library", "file write",
                                  "the guard re-entered", "a shell hook nested in a callback",
                                  "a shell command in a nested keyword"])
def test_an_attack_spec_is_refused_by_report_and_run_before_anything_runs_or_is_written(tmp_path, name) -> None:
    marker = tmp_path / "ran"
    field, attack, watch = attacks(tmp_path, marker)[name]
    if name == "shared library" and not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("no C compiler to build the shared library")
    spec = msgspec.to_builtins(scaffold(epochs=1))
    if isinstance(spec[field], list):
        spec[field].append(attack)
    else:
        spec[field] = attack
    (tmp_path / "evil.json").write_text(json.dumps(spec))
    found, stderr = drive(tmp_path, [["report", "evil.json"], ["run", "evil.json", "--run-id", "evil"]], watch)
    assert found["codes"] == [2, 2], stderr
    assert len(stderr.strip().splitlines()) == 2 and "refused" in stderr, stderr  # one line a command
    assert not marker.exists()
    assert found["imported"] == []
    assert not (tmp_path / "runs").exists() and not (tmp_path / "evil.lr.png").exists()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A completed 1-epoch digits run made by nnx-es run (copied by each test before it forges it)."""
    tmp = tmp_path_factory.mktemp("attacked")
    spec = msgspec.to_builtins(scaffold(epochs=1))
    spec["trainer"]["keep_last"] = None
    (tmp / "spec.json").write_text(json.dumps(spec))
    found, stderr = drive(tmp, [["run", "spec.json", "--run-id", "r"]], [])
    assert found["codes"] == [0], stderr
    return tmp / "runs" / "r"


def forge(run_dir: Path, change, *, fix_hash: bool) -> None:
    """Rewrite ``run_started.spec`` in place, the log's checksum recomputed (``put_raw``); ``fix_hash``: its
    ``spec_hash`` too (a log forged whole)."""
    with LmdbLog(run_dir / "events.lmdb") as log:
        seq, started = next((s, e) for s, e in log.read() if isinstance(e, RunStarted))
        spec = change(copy.deepcopy(started.spec))
        forged = msgspec.structs.replace(started, spec=spec, spec_hash=spec_hash(spec) if fix_hash else
                                         started.spec_hash)
        log.put_raw(seq, encode(forged))


def digest(run_dir: Path) -> str:
    return hashlib.sha256((run_dir / "events.lmdb" / "data.mdb").read_bytes()).hexdigest()


def replay(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return warmkit.command("nnx-replay", str(run_dir), cwd=run_dir.parent)


def with_callback(marker: Path):
    def change(spec: dict) -> dict:
        spec["callbacks"].append(recipe("torch.utils.collect_env:run", command=f"touch {marker}"))
        return spec
    return change


def test_a_stored_spec_rewritten_with_its_checksum_fixed_is_refused_by_resume_and_reported_by_replay(
        finished_run, tmp_path) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(finished_run.parent, runs)
    run_dir, marker = runs / "r", tmp_path / "ran"
    forge(run_dir, with_callback(marker), fix_hash=False)
    before = digest(run_dir)
    (tmp_path / "spec.json").write_text(json.dumps(msgspec.to_builtins(scaffold(epochs=2))))
    found, stderr = drive(tmp_path, [["resume", "runs/r", "--epochs", "2"],
                                     ["resume", "runs/r", "--from", "best", "--run-id", "fork"],
                                     ["resume", "runs/r", "--spec", "spec.json"]], [])  # a spec of one's own too
    assert found["codes"] == [2, 2, 2], stderr
    assert all("not to the spec_hash it records" in line for line in stderr.splitlines()), stderr
    assert digest(run_dir) == before and not marker.exists() and not (runs / "fork").exists()
    audit = replay(run_dir)
    assert audit.returncode == 1 and "spec_hash" in audit.stdout, audit.stdout + audit.stderr


def test_a_stored_spec_forged_whole_is_still_built_by_type_and_refused(finished_run, tmp_path) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(finished_run.parent, runs)
    run_dir, marker = runs / "r", tmp_path / "ran"
    forge(run_dir, with_callback(marker), fix_hash=True)  # spec and hash together: another run, as far as replay sees
    assert replay(run_dir).returncode == 0
    before = digest(run_dir)
    found, stderr = drive(tmp_path, [["resume", "runs/r", "--epochs", "2"],
                                     ["resume", "runs/r", "--from", "best", "--run-id", "fork"]], [])
    assert found["codes"] == [2, 2], stderr
    assert all("torch.utils.collect_env:run" in line and "refused" in line for line in stderr.splitlines()), stderr
    assert digest(run_dir) == before and not marker.exists() and not (runs / "fork").exists()


@pytest.mark.parametrize("argv", [["--epochs", "99999999999999999999999"], ["--epochs", "-1"],
                                  ["--epochs", "2147483648"], ["--from", "99999999999999999999999", "--run-id", "f"]])
def test_resume_with_an_argument_out_of_range_exits_2_and_leaves_the_log_byte_identical(finished_run, tmp_path,
                                                                                         argv) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(finished_run.parent, runs)
    before, entries = digest(runs / "r"), sorted(runs.iterdir())
    found, stderr = drive(tmp_path, [["resume", "runs/r", *argv]], [])
    assert found["codes"] == [2], stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert digest(runs / "r") == before and sorted(runs.iterdir()) == entries


def test_hostile_specs_are_one_line_and_exit_2_through_the_cli_never_a_traceback(tmp_path) -> None:
    good = msgspec.to_builtins(scaffold(epochs=1))
    bad = {
        "not_a_module.json": {**good, "model": recipe("nnx_es.monitor:Monitor", name="val_loss")},
        "tensor.json": {**good, "loss": recipe("torch.nn.modules.loss:CrossEntropyLoss",
                                               weight={"@tensor": [1.0] * 10, "dtype": "onnx"})},
        "epochs.json": {**good, "epochs": 2**40},
    }
    for name, spec in bad.items():
        (tmp_path / name).write_text(json.dumps(spec))
    (tmp_path / "deep.json").write_text('{"model": {"@type": "recipe", "target": "nnx_es.recipes.models:MLP", '
                                        '"kwargs": {"hidden": ' + "[" * 100_000 + "]" * 100_000 + "}}}")
    commands = [[command, name] for name in [*bad, "deep.json"] for command in ("report", "run")]
    commands += [["run", "tensor.json", "--allow", "os"], ["run", "tensor.json", "--allow", "torch.utils"]]
    found, stderr = drive(tmp_path, commands, ["torch._dynamo"])
    assert found["codes"] == [2] * len(commands), stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == len(commands) and not any("Traceback" in line for line in lines), stderr
    assert "nnx_es.monitor:Monitor" in lines[0] and "model" in lines[0]
    assert "dtype 'onnx'" in lines[2] and "spec epochs must be an int" in lines[4] and "nested too deep" in lines[6]
    assert "standard library" in lines[8] and "your own package" in lines[9]
    assert found["imported"] == [] and not (tmp_path / "runs").exists()


def test_init_checks_its_counts_and_sizes_before_writing_the_spec(tmp_path) -> None:
    bad = [["--hidden", "a"], ["--hidden", "0"], ["--epochs", "-1"], ["--epochs", "99999999999999999999"],
           ["--batch-size", "0"], ["--lr", "nan"], ["--val-fraction", "1.5"]]
    found, stderr = drive(tmp_path, [["init", "--out", "s.json", *argv] for argv in bad], [])
    assert found["codes"] == [2] * len(bad), stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == len(bad) and all(argv[0] in line for argv, line in zip(bad, lines)), stderr
    assert not (tmp_path / "s.json").exists()
