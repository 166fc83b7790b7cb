"""The digits main job from a spec through the CLI: init -> report -> run -> replay clean -> resume (and a fork);
typed decisions on the trained model.

The commands run in children of the suite's warm process (tests/warmkit.py: torch imported once, not per
command); ``python -m nnx_es`` itself, a new interpreter, runs in
test_resume_help_says_what_epochs_counts_for_a_resume_and_for_a_fork."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import warmkit
from events.log import LmdbLog
from events.schema import RunStarted
from nnx_es import ConfigError, load_result
from nnx_es.decisions import ClassifyQuestion, FixedHeadProvider
from nnx_es.recipes.data import tabular
from nnx_es.recipes.models import MLP
from nnx_es.recipes.runspec import spec_hash

REPO = Path(__file__).resolve().parents[2]


def nnx_es(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``nnx-es ARGS`` in ``tmp_path``, in a child of the warm process."""
    return warmkit.command("nnx-es", *args, cwd=tmp_path)


def nnx_es_process(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m nnx_es ARGS`` in ``tmp_path``: a new interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "nnx_es", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def started(run_dir: Path) -> RunStarted:
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        return next(iter(log.read()))[1]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cli")
    init = nnx_es(tmp, "init", "--out", "spec.json", "--epochs", "2")
    assert init.returncode == 0, init.stderr
    spec = json.loads((tmp / "spec.json").read_text())
    spec.setdefault("trainer", {})["keep_last"] = None  # every LAST kept: the fork test starts from an older one
    (tmp / "spec.json").write_text(json.dumps(spec))
    report = nnx_es(tmp, "report", "spec.json")
    assert report.returncode == 0, report.stderr
    assert "scheduler   plateau: ReduceLROnPlateau on main, clock epoch" in report.stdout
    assert (tmp / "spec.lr.png").stat().st_size > 0
    run = nnx_es(tmp, "run", "spec.json", "--run-id", "digits")
    assert run.returncode == 0, run.stderr
    return tmp / "runs" / "digits"


def test_the_digits_job_runs_from_a_spec_audits_clean_and_resumes(digits_run: Path) -> None:
    tmp = digits_run.parents[1]
    first = started(digits_run)
    assert first.spec is not None and first.spec_hash == spec_hash(first.spec)
    assert first.spec["model"]["target"] == "nnx_es.recipes.models:MLP"
    replay = warmkit.command("nnx-replay", str(digits_run), cwd=tmp)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    resume = nnx_es(tmp, "resume", "runs/digits", "--epochs", "3")  # the spec the run recorded
    assert resume.returncode == 0, resume.stderr
    assert len(load_result(digits_run).history) == 3


def test_resume_from_an_older_last_forks_a_new_run_recording_its_source(digits_run: Path) -> None:
    tmp = digits_run.parents[1]
    with LmdbLog(digits_run / "events.lmdb", readonly=True) as log:
        lasts = [seq for seq, e in log.read() if e.KIND == "last_committed"]
    before = (digits_run / "events.lmdb" / "data.mdb").read_bytes()
    fork = nnx_es(tmp, "resume", "runs/digits", "--from", str(lasts[1]), "--run-id", "fork", "--epochs", "1")
    assert fork.returncode == 0, fork.stderr
    source = started(tmp / "runs" / "fork").source
    assert source is not None and source.run_id == "digits" and source.last_seq == lasts[1]
    assert len(load_result(tmp / "runs" / "fork").history) == 1  # a fork's --epochs: its own, from 0 (--help)
    assert (digits_run / "events.lmdb" / "data.mdb").read_bytes() == before  # the source is never written
    bad = nnx_es(tmp, "resume", "runs/digits", "--from", "3", "--run-id", "fork2")
    assert bad.returncode == 2 and "no committed LAST at seq 3" in bad.stderr


def test_resume_with_a_spec_whose_learning_rate_differs_is_refused_naming_it_before_training(digits_run: Path) -> None:
    """The LAST's optimizer state would put the run's learning rate back: every update after the resume
    would have run at 0.003 while the command said 0.1, and exited 0."""
    tmp = digits_run.parents[1]
    spec = started(digits_run).spec
    assert spec is not None
    changed = json.loads(json.dumps(spec))
    changed["optimizers"]["main"]["kwargs"]["lr"] = 0.1
    changed["epochs"] = 9  # the budget may differ
    (tmp / "spec_lr.json").write_text(json.dumps(changed))
    before = (digits_run / "events.lmdb" / "data.mdb").read_bytes()
    for extra in ((), ("--from", "best", "--run-id", "lr-fork")):
        bad = nnx_es(tmp, "resume", "runs/digits", "--spec", "spec_lr.json", *extra)
        assert bad.returncode == 2, bad.stdout + bad.stderr
        assert "optimizers.main.kwargs.lr: 0.003 in the run, 0.1 given" in bad.stderr
        assert "Traceback" not in bad.stderr and "nothing was restored or written" in bad.stderr
    assert (digits_run / "events.lmdb" / "data.mdb").read_bytes() == before
    assert not (tmp / "runs" / "lr-fork").exists()


def test_resume_help_says_what_epochs_counts_for_a_resume_and_for_a_fork(tmp_path: Path) -> None:
    out = nnx_es_process(tmp_path, "resume", "--help")  # python -m nnx_es: the module's own entry, a new interpreter
    text = " ".join(out.stdout.split())
    assert out.returncode == 0 and "counted from the run's start" in text and "A fork (--from best|SEQ): the new " \
        "run's own epochs, counted from 0" in text, out.stdout


def test_resume_help_says_a_fork_starts_from_the_checkpoints_whole_state_not_its_weights(tmp_path: Path) -> None:
    """As the README says (resume_mode="fork": weights, optimizers, schedulers, RNG streams, callback state)."""
    text = " ".join(nnx_es(tmp_path, "resume", "--help").stdout.split())
    assert "forks a new run from that checkpoint's whole state (weights, optimizers, schedulers, RNG streams, " \
        "callback state; its epochs and counters from 0)" in text, text
    assert "from that checkpoint's weights" not in text, text


def test_bad_input_exits_2_with_one_line_naming_it(tmp_path: Path) -> None:
    assert nnx_es(tmp_path, "init", "--out", "s.json", "--epochs", "1").returncode == 0
    spec = json.loads((tmp_path / "s.json").read_text())
    spec["callbacks"][0]["kwargs"]["patiense"] = 3
    (tmp_path / "typo.json").write_text(json.dumps(spec))
    out = nnx_es(tmp_path, "run", "typo.json")
    assert out.returncode == 2 and "patiense" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    spec["callbacks"][0] = {"@type": "recipe", "target": "os:system", "kwargs": {"command": "true"}}
    (tmp_path / "evil.json").write_text(json.dumps(spec))
    out = nnx_es(tmp_path, "report", "evil.json")
    assert out.returncode == 2 and "os:system" in out.stderr
    for command in ("init", "report", "run", "resume"):
        assert nnx_es(tmp_path, command, "--help").returncode == 0


@pytest.mark.parametrize("case", ["lbfgs", "one_cycle_overstepped", "optimizer_base"])
def test_report_of_an_optimizer_or_scheduler_that_fails_its_preview_step_exits_2_in_one_line(
        tmp_path: Path, case: str) -> None:
    """``report`` steps the spec's optimizers and schedulers to draw the learning rate: an LBFGS (its step needs
    a closure), a OneCycleLR planned for fewer steps than the epochs, torch's Optimizer base (no step) ended in a
    traceback, exit 1."""
    assert nnx_es(tmp_path, "init", "--out", "s.json", "--epochs", "3").returncode == 0
    spec = json.loads((tmp_path / "s.json").read_text())

    def recipe(target: str, **kwargs: object) -> dict[str, object]:
        return {"@type": "recipe", "target": target, "kwargs": kwargs}

    if case == "lbfgs":
        spec["optimizers"]["main"] = recipe("torch.optim.lbfgs:LBFGS", lr=0.1)
    elif case == "optimizer_base":
        spec["optimizers"]["main"] = recipe("torch.optim.optimizer:Optimizer", defaults={"lr": 0.1})
    else:
        spec["schedulers"] = [recipe("nnx_es.schedulers:Scheduler", clock="epoch", name="oc", scheduler=recipe(
            "torch.optim.lr_scheduler:OneCycleLR", optimizer={"@optimizer": "main"}, max_lr=0.1, total_steps=1))]
    (tmp_path / "s.json").write_text(json.dumps(spec))
    out = nnx_es(tmp_path, "report", "s.json")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "the learning-rate preview failed" in out.stderr


@pytest.mark.parametrize("field", [("trainer", "keep_last"), ("trainer", "validate_every"), ("data", "batch_size")])
def test_a_spec_int_past_64_bits_is_refused_before_the_run_directory_is_made(tmp_path: Path, field) -> None:
    """``trainer.keep_last = 2**70`` (or another count past 64 bits) passed the checks and failed to encode
    ``run_started``: exit 1 and a run directory whose log held ``run_failed`` alone (the audit failed it)."""
    assert nnx_es(tmp_path, "init", "--out", "s.json", "--epochs", "1").returncode == 0
    spec = json.loads((tmp_path / "s.json").read_text())
    section, key = field
    (spec[section] if section == "trainer" else spec[section]["kwargs"])[key] = 2**70
    (tmp_path / "s.json").write_text(json.dumps(spec))
    out = nnx_es(tmp_path, "run", "s.json", "--run-id", "r")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"{key} = {2**70} cannot be recorded" in out.stderr
    assert not (tmp_path / "runs" / "r").exists()


def test_nnx_es_escapes_terminal_controls_of_a_spec_in_what_it_prints(tmp_path: Path) -> None:
    """A spec's strings reach the terminal through ``report``'s plan (a scheduler's name) and through a
    constructor's error (TransformerEncoderLayer echoes its ``activation``): printed raw, they set the
    terminal's title and cleared its screen."""
    hostile = "\x1b]0;PWNED\x07\x1b[2J\u202eevil"
    assert nnx_es(tmp_path, "init", "--out", "s.json", "--epochs", "1").returncode == 0
    spec = json.loads((tmp_path / "s.json").read_text())
    spec["schedulers"][0]["kwargs"]["name"] = hostile
    (tmp_path / "plan.json").write_text(json.dumps(spec))
    spec["model"] = {"@type": "recipe", "target": "torch.nn.modules.transformer:TransformerEncoderLayer",
                     "kwargs": {"d_model": 4, "nhead": 1, "activation": hostile}}
    (tmp_path / "error.json").write_text(json.dumps(spec))
    plan, error = nnx_es(tmp_path, "report", "plan.json"), nnx_es(tmp_path, "report", "error.json")
    assert error.returncode == 2 and "not \\x1b]0;PWNED\\x07\\x1b[2J\\u202eevil" in error.stderr, error.stderr
    assert "\\x1b]0;PWNED" in plan.stdout, plan.stdout
    for out in (plan, error):
        assert not any(c in out.stdout + out.stderr for c in "\x1b\x07\u202e")


def test_report_warns_on_common_mistakes(tmp_path: Path) -> None:
    assert nnx_es(tmp_path, "init", "--out", "s.json", "--lr", "5", "--epochs", "1").returncode == 0
    spec = json.loads((tmp_path / "s.json").read_text())
    spec["schedulers"][0]["kwargs"]["scheduler"]["kwargs"]["mode"] = "max"
    spec["data"]["kwargs"]["val_fraction"] = 0.0
    spec["trainer"] = {"keep_last": None}  # every checkpoint kept: no retention
    (tmp_path / "s.json").write_text(json.dumps(spec))
    out = nnx_es(tmp_path, "report", "s.json")
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stdout.splitlines() if line.startswith("warning:")]
    assert any("no validation split" in w for w in warnings)
    assert any("mode 'max' disagrees" in w for w in warnings)
    assert any("far outside the usual range" in w for w in warnings)
    assert any("no checkpoint retention" in w for w in warnings)


def test_decisions_on_the_trained_model_are_typed_validated_and_traceable(digits_run: Path) -> None:
    provider = FixedHeadProvider.from_run(MLP(64, 10, hidden=[128]), digits_run, "best", n_features=64,
                                          threshold=0.0)
    result = load_result(digits_run)
    assert provider.source.run_id == "digits" and provider.source.manifest == result.best.manifest
    _, val = tabular("digits", val_fraction=0.2, seed=0)
    x, y = next(iter(val))
    answers = provider.decide([ClassifyQuestion(features=row.tolist()) for row in x[:64]])
    assert len(answers) == 64 and all(abs(sum(a.probabilities) - 1) < 1e-5 for a in answers)
    assert sum(a.label == int(t) for a, t in zip(answers, y[:64])) >= 48  # a trained model, two epochs
    assert all(a.source == provider.source for a in answers)
    cautious = FixedHeadProvider.from_run(MLP(64, 10, hidden=[128]), digits_run, "last", n_features=64,
                                          threshold=0.999)
    assert any(a.abstained and a.label is None for a in cautious.decide([{"features": r.tolist()} for r in x[:64]]))
    with pytest.raises(ConfigError, match=r"question 1: .*features"):
        provider.decide([{"features": x[0].tolist()}, {"features": ["a"] * 64}])
    with pytest.raises(ConfigError, match=r"question 0: field `\$.features` has 3 values, expected 64"):
        provider.decide([{"features": [0.0, 1.0, 2.0]}])


def test_one_spec_run_twice_is_one_run_twice(tmp_path: Path) -> None:
    """The model is built after the spec's seed, not from whatever the global RNG held: two runs of
    one spec (two processes) record the same losses and commit the same history."""
    assert nnx_es(tmp_path, "init", "--out", "spec.json", "--epochs", "1").returncode == 0
    for run_id in ("a", "b"):
        out = nnx_es(tmp_path, "run", "spec.json", "--run-id", run_id)
        assert out.returncode == 0, out.stderr

    def losses(run_dir: Path) -> list[float]:
        with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
            return [e.loss for _, e in log.read(kinds=["microbatch_done"])]

    first, second = losses(tmp_path / "runs" / "a"), losses(tmp_path / "runs" / "b")
    assert first and first == second
    a, b = load_result(tmp_path / "runs" / "a"), load_result(tmp_path / "runs" / "b")
    assert a.history and [r.val for r in a.history] == [r.val for r in b.history]
    digest = started(tmp_path / "runs" / "a").initial_weights
    assert len(digest) == 64 and digest == started(tmp_path / "runs" / "b").initial_weights
    def diff(x: str, y: str) -> subprocess.CompletedProcess[str]:
        return warmkit.command("nnx-inspect", "diff", x, y, cwd=tmp_path)

    same = diff("runs/a", "runs/b")
    assert same.returncode == 0, same.stdout + same.stderr

    spec = json.loads((tmp_path / "spec.json").read_text())
    spec["seed"] = spec["seed"] + 1  # another seed: other initial weights
    (tmp_path / "other.json").write_text(json.dumps(spec))
    assert nnx_es(tmp_path, "run", "other.json", "--run-id", "c").returncode == 0
    differ = diff("runs/a", "runs/c")
    assert differ.returncode == 1 and differ.stdout.startswith("initial weights differ: first difference at seq 0"), \
        differ.stdout + differ.stderr


def test_init_and_run_on_a_dataset_file_holding_an_object_array_exit_2_in_one_line_naming_it(
        tmp_path: Path, monkeypatch, capsys) -> None:
    import numpy as np

    from nnx_es.cli.main import main as cli

    monkeypatch.chdir(tmp_path)
    np.savez("obj.npz", x=np.array([[1, "a"]], dtype=object), y=np.array([0]))
    said = ("dataset file 'obj.npz' cannot be read: Object arrays cannot be loaded when allow_pickle=False (save x "
            "and y as numeric arrays, np.savez(path, x=x, y=y))")
    assert cli(["init", "--out", "s.json", "--dataset", "obj.npz"]) == 2
    assert capsys.readouterr().err == f"nnx-es init: {said}\n"
    assert not (tmp_path / "s.json").exists()
    assert cli(["init", "--out", "s.json"]) == 0
    spec = json.loads((tmp_path / "s.json").read_text())
    spec["data"]["kwargs"]["dataset"] = "obj.npz"
    (tmp_path / "s.json").write_text(json.dumps(spec))
    capsys.readouterr()
    assert cli(["run", "s.json"]) == 2
    assert capsys.readouterr().err == f"nnx-es run: {said}\n"
    np.savez("text.npz", x=np.array([["1", "a"]]), y=np.array([0]))
    assert cli(["init", "--out", "t.json", "--dataset", "text.npz"]) == 2
    assert capsys.readouterr().err == "nnx-es init: dataset file 'text.npz': x and y must hold numbers, got <U1 and int64\n"


def test_run_plan_and_search_refuse_a_runs_dir_inside_a_run_as_export_refuses_an_out_there(
        tmp_path: Path, monkeypatch, capsys) -> None:
    from nnx_es.cli.main import main as cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "bc-2" / "events.lmdb").mkdir(parents=True)  # a run, as the check knows one
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    run = tmp_path / "runs" / "bc-2"
    for runs_dir in ("runs/bc-2", "runs/bc-2/views"):
        said = (f"--runs-dir {runs_dir!r} lies inside a run ({run}): nothing is written into a run but its own (it "
                "may be someone else's); give a path outside it\n")
        for command in (["run", "spec.json", "--run-id", "nested"], ["plan", "plan.json"],
                        ["search", "spec.json", "--space", "space.json", "--trials", "1"]):
            assert cli([*command, "--runs-dir", runs_dir]) == 2
            assert capsys.readouterr().err == f"nnx-es {command[0]}: {said}"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_run_on_an_existing_run_id_says_the_command_line_way_to_continue_it(
        digits_run: Path, monkeypatch, capsys) -> None:
    from nnx_es.cli.main import main as cli

    monkeypatch.chdir(digits_run.parent.parent)
    events = (digits_run / "events.lmdb" / "data.mdb").read_bytes()
    assert cli(["run", "spec.json", "--run-id", "digits"]) == 2
    assert capsys.readouterr().err == (
        f"nnx-es run: run 'digits' already exists at {Path('runs') / 'digits'}: continue it with nnx-es resume "
        "runs/digits, fork it with nnx-es resume runs/digits --from best|SEQ --run-id NEW, or pass another --run-id\n")
    assert (digits_run / "events.lmdb" / "data.mdb").read_bytes() == events


@pytest.mark.parametrize("command", [["report", "spec.json"], ["plan", "plan.json", "--report"]])
def test_a_reader_that_left_ends_the_command_quietly(tmp_path: Path, command) -> None:
    """``nnx-es report spec.json | head -1``: stdout closed before the command writes -- no error, exit 0."""
    assert nnx_es(tmp_path, "init", "--out", "spec.json", "--epochs", "1").returncode == 0
    (tmp_path / "plan.json").write_text(json.dumps({"name": "p", "spec": "spec.json", "seeds": [0, 1]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "nnx_es", *command], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert (proc.wait(timeout=300), err) == (0, b"")


def test_resume_help_says_the_spec_must_be_the_runs_own_but_for_epochs(tmp_path: Path) -> None:
    text = " ".join(nnx_es(tmp_path, "resume", "--help").stdout.split())
    assert "it must be the run's own but for epochs: any other difference is refused" in text
