"""Several models: a frozen teacher declared by hash and verified on resume, the student checkpointed
under its name, keyed loss terms and a target assembler; distillation resumes bitwise after SIGKILL."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from nnx_es import Trainer
from nnx_es.audit import audit_run
from nnx_es.checkpoint import load_component, verify_checkpoint
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.evaluation import state_fingerprint
from nnx_es.models import Keyed, ModelSet
from nnx_es.objective import Objective
from nnx_es.storage import BlobStore
from nnx_es.testing import Fit, crash_test
from trainkit import loaders, read_events, small_net

torch.set_num_threads(1)

T = 2.0


def soft_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-row KL(teacher || student) of temperature-softened distributions, times T^2 (Hinton et al.)."""
    log_p = torch.log_softmax(student / T, dim=1)
    log_q = torch.log_softmax(teacher / T, dim=1)
    return (log_q.exp() * (log_q - log_p)).sum(dim=1) * T * T


def training_fn(models, batch):
    x = batch[0]
    with torch.no_grad():
        teacher = models["teacher"](x)
    return {"student": models["student"](x), "teacher": teacher}


def teacher_targets(loss, predictions, batch, *, workflow=None, target_keys=None):
    return {"teacher": predictions["teacher"], "y": batch[1]}


def _teacher() -> nn.Module:
    torch.manual_seed(21)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _trainer(runs_root, run_id, teacher=None, **kw) -> Trainer:
    student = small_net(4)
    teacher = teacher if teacher is not None else _teacher()
    objective = Objective({"kd": Keyed(soft_kl, prediction="student", target="teacher", weight=0.7),
                           "ce": Keyed(nn.CrossEntropyLoss(), prediction="student", target="y", weight=0.3)})
    return Trainer({"student": student, "teacher": teacher}, {"student": torch.optim.Adam(student.parameters(), 1e-2)},
                   objective, training_fn=training_fn, loss_target_assembler=teacher_targets, monitor="val_loss",
                   runs_root=runs_root, run_id=run_id, progress=False, **kw)


def test_the_teacher_is_frozen_declared_by_hash_and_kept_out_of_the_checkpoints(tmp_path):
    teacher = _teacher()
    before = state_fingerprint(teacher.state_dict())
    trainer = _trainer(tmp_path / "runs", "kd", teacher=teacher)
    assert all(not p.requires_grad for p in teacher.parameters()) and not teacher.training
    run = trainer.fit(*loaders(batch_size=8, n_train=48), epochs=2)
    assert not teacher.training  # the loop's net.train() leaves it in eval mode
    started = read_events(run.run_dir)[0][1]
    assert started.models["teacher"].frozen and started.models["teacher"].sha256 == before
    assert not started.models["student"].frozen and started.models["student"].sha256 == ""
    assert state_fingerprint(teacher.state_dict()) == before  # never trained
    store = BlobStore(Path(run.run_dir) / "blobs")
    manifest = verify_checkpoint(store, run.last.manifest)
    keys = list(load_component(store, manifest, "model"))
    assert keys and all(k.startswith("student.") for k in keys)
    assert set(run.history[-1].train) == {"loss", "kd", "ce"}
    report = audit_run(run.run_dir)
    assert report.ok, report.violations


def test_a_resume_with_another_teacher_is_refused_before_anything_is_restored(tmp_path):
    run = _trainer(tmp_path / "runs", "kd").fit(*loaders(batch_size=8, n_train=48), epochs=1)
    other = _teacher()
    with torch.no_grad():
        other[0].weight.add_(0.01)
    with pytest.raises(ResumeError, match="frozen model"):
        _trainer(tmp_path / "runs", "kd", teacher=other).fit(*loaders(batch_size=8, n_train=48), epochs=2,
                                                           resume_from=run.run_dir)


def test_the_built_in_accuracy_in_a_several_model_run_is_refused_before_anything_is_written(tmp_path):
    # was refused at the first batch ("cannot score outputs of shape dict"), the run begun and failed
    with pytest.raises(ConfigError, match=r"metric 'accuracy' .* several models \['student', 'teacher'\].* "
                                          r"nothing was trained"):
        _trainer(tmp_path / "runs", "kd", metrics=["accuracy"])
    assert not (tmp_path / "runs").exists()


def test_several_models_need_a_training_fn_and_keyed_terms_name_missing_keys(tmp_path):
    s, t = small_net(0), _teacher()
    with pytest.raises(ConfigError, match="training_fn"):
        Trainer({"student": s, "teacher": t}, torch.optim.SGD(s.parameters(), 0.1), nn.CrossEntropyLoss(),
                runs_root=tmp_path)
    with pytest.raises(ConfigError, match="nothing would train"):
        ModelSet({"teacher": t}, {})
    bad = Trainer({"student": s, "teacher": t}, torch.optim.SGD(s.parameters(), 0.1),
                  Objective({"kd": Keyed(soft_kl, prediction="pupil", target="teacher")}), training_fn=training_fn,
                  loss_target_assembler=teacher_targets, runs_root=tmp_path / "runs", run_id="bad", progress=False)
    with pytest.raises(ConfigError, match="prediction 'pupil'; training_fn returned \\['student', 'teacher'\\]"):
        bad.fit(loaders()[0], epochs=1)


def test_distillation_resumes_bitwise_after_sigkill(tmp_path):
    def build(runs_root, run_id):
        return Fit(_trainer(runs_root, run_id, seed=0), *loaders(batch_size=8, n_train=48))

    report = crash_test(build, epochs=3, points=5)
    assert report.ok, report


def test_the_digits_distillation_example_audits_both_runs_clean(tmp_path, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "digits_distill.py"
    spec = importlib.util.spec_from_file_location("digits_distill", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--epochs", "2", "--runs", str(tmp_path / "runs"), "--run-id", "ex"]) == 0
    out = capsys.readouterr().out
    assert "audit ex-teacher: clean" in out and "audit ex-student: clean" in out


def test_each_trainable_model_has_its_optimizer_and_its_state_under_its_name(tmp_path):
    torch.manual_seed(0)
    encoder, head = nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 3)

    def fn(models, batch):
        return {"logits": models["head"](models["encoder"](batch[0]))}

    trainer = Trainer({"encoder": encoder, "head": head},
                      {"enc": torch.optim.SGD(encoder.parameters(), lr=0.1), "head": torch.optim.Adam(head.parameters())},
                      Objective({"ce": Keyed(nn.CrossEntropyLoss(), prediction="logits", target="y")}),
                      training_fn=fn, runs_root=tmp_path / "runs", run_id="two", progress=False)
    before = {k: v.clone() for k, v in {**encoder.state_dict(), **head.state_dict()}.items()}
    run = trainer.fit(loaders()[0], epochs=1)
    started = read_events(run.run_dir)[0][1]
    assert not started.models["encoder"].frozen and not started.models["head"].frozen
    store = BlobStore(Path(run.run_dir) / "blobs")
    state = load_component(store, verify_checkpoint(store, run.last.manifest), "model")
    assert sorted(state) == ["encoder.0.bias", "encoder.0.weight", "head.bias", "head.weight"]
    assert torch.equal(state["head.weight"], head.weight) and not torch.equal(head.weight, before["weight"])
    receipts = [e for _, e in read_events(run.run_dir) if e.KIND == "update_committed"]
    assert {r.optimizer for r in receipts} == {"enc", "head"}


def test_one_model_of_a_several_model_run_loads_by_name_into_its_own_module(tmp_path):
    from nnx_es import NNModel
    from nnx_es.decisions import FixedHeadProvider
    from nnx_es.finetune import WeightsFrom, load_weights

    run = _trainer(tmp_path / "runs", "kd").fit(*loaders(batch_size=8, n_train=48), epochs=2)
    store = BlobStore(Path(run.run_dir) / "blobs")
    stored = load_component(store, verify_checkpoint(store, run.best.manifest), "model")

    student = NNModel(small_net(9))  # another initialization: every weight must come from the run
    with pytest.raises(ConfigError, match=r"stores several models|model=<name>") if len({k.split(".")[0] for k in stored}) > 1 \
            else pytest.raises(ConfigError, match="does not fit this net"):
        student.load(run.run_dir, "best")
    assert student.load(run.run_dir, "best", model="student") == run.best.epoch
    for key, value in student.net.state_dict().items():
        assert torch.equal(value, stored["student." + key]), key
    assert student.source.model == "student"

    with pytest.raises(ConfigError, match=r"stores no model 'teacher'.*\['student'\].*frozen"):
        NNModel(small_net(9)).load(run.run_dir, "best", model="teacher")
    with pytest.raises(ConfigError, match="model must be"):
        NNModel(small_net(9)).load(run.run_dir, "best", model="student.0")

    net = small_net(5)
    lineage = load_weights(net, WeightsFrom(run.run_dir, "best", model="student"))
    assert lineage.model == "student" and lineage.run_id == "kd" and lineage.skipped == [] and lineage.new == []
    assert all(torch.equal(v, stored["student." + k]) for k, v in net.state_dict().items())
    with pytest.raises(ConfigError, match="model must be"):
        WeightsFrom({"w": torch.zeros(1)}, model="student")

    provider = FixedHeadProvider.from_run(small_net(7), run.run_dir, "best", n_features=4, weights_of="student")
    assert provider.source.run_id == "kd" and provider.source.manifest == run.best.manifest


def test_loading_a_distilled_student_without_model_names_the_stored_model_that_fits(tmp_path):
    """A distillation run stores the student alone (the teacher is frozen): a load into the student's
    own module without ``model=`` says which stored model fits it, not a bare list of mismatched keys."""
    from nnx_es import NNModel
    from nnx_es.finetune import WeightsFrom, load_weights

    run = _trainer(tmp_path / "runs", "kd").fit(*loaders(batch_size=8, n_train=48), epochs=1)
    with pytest.raises(ConfigError, match=r"keys under 'student\.' are this net's \(a several-model run's 'student'\): load them with model='student'"):
        NNModel(small_net(9)).load(run.run_dir, "best")
    with pytest.raises(ConfigError, match=r"keys under 'student\.' are this net's .*: pass WeightsFrom\(\.\.\., model='student'\)"):
        load_weights(small_net(5), WeightsFrom(run.run_dir, "best"))
    with pytest.raises(ConfigError, match="does not fit this net") as info:  # another architecture: no model fits
        NNModel(nn.Linear(4, 3)).load(run.run_dir, "best")
    assert "are this net's" not in str(info.value)


def test_the_docs_say_how_to_load_one_model_of_a_distillation_run():
    """The distillation guide's paragraph (once the README's) names the keyword each loader takes (model=, weights_of=)."""
    readme = " ".join((Path(__file__).resolve().parents[2] / "docs" / "guides" / "finetune-distill.md").read_text().split())
    assert ('loads into its own module by that name: `NNModel(student).load(run_dir, "best", model="student")` '
            '(likewise `WeightsFrom(..., model="student")`, `FixedHeadProvider.from_run(..., weights_of="student")`') \
        in readme
