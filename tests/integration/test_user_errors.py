"""What a user gets wrong is refused with a clear error, before or instead of a broken run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from crashkit import run_killed
from nnx_es import Callback, EarlyStopping, Scheduler, Trainer
from nnx_es.audit import audit_run
from nnx_es.errors import ConfigError, ResumeError
from trainkit import loaders, read_events, small_net

torch.set_num_threads(1)


def _net_opt():
    net = small_net()
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss": 42}, "loss must be"),
        ({"optimizer": "adam"}, "optimizer must be"),
        ({"seed": "a"}, "seed must be an int"),
        ({"callbacks": EarlyStopping()}, "callbacks must be a list"),
        ({"keep_phases": 2}, "keep_phases needs phase_every"),
        ({"monitor": "val_accuracy"}, "monitor 'val_accuracy' names no reported metric"),
        ({"monitor": 3}, "monitor must be"),
        ({"track_grad_norm": "yes"}, "track_grad_norm must be True or False, got 'yes'"),
        ({"seed": 2**70}, r"seed must be an int in \[-2\*\*63, 2\*\*64\) .*, got 1180591620717411303424"),
        ({"seed": -(2**63) - 1}, r"seed must be an int in \[-2\*\*63, 2\*\*64\)"),
        ({"recipe": {"lr": 0.1, "f": object()}}, r"recipe\['f'\] cannot be recorded"),
        ({"recipe": {1: "x"}}, "recipe key 1 is not a str"),
        ({"recipe": {"b": 2**70}}, r"recipe\['b'\] cannot be recorded"),
        ({"loss": {"ce": (nn.CrossEntropyLoss(), torch.ones(2))}}, "finite number"),
        ({"loss": {"ce": (nn.CrossEntropyLoss(), "a")}}, "a loss term's weight must be a finite number, got 'a'"),
        ({"loss": {"ce": (nn.CrossEntropyLoss(), float("nan"))}}, "finite number, got nan"),
        ({"metrics": "accuracy"}, r"metrics must be a list of names, got the string 'accuracy' \(write \['accuracy'\]\)"),
        ({"progress": "yes"}, "progress must be True, False or None"),
        ({"monitor": ""}, "monitor name must be a metric's name"),
        ({"runs_root": __file__}, "runs_root must be a directory, got the file"),
        ({"validate_every": "2"}, "validate_every must be an int >= 1 epoch, got '2'"),
        ({"validate_every": True}, "validate_every must be an int >= 1 epoch, got True"),
        ({"validate_every_steps": 1.5}, "validate_every_steps must be an int >= 1 update or None, got 1.5"),
        ({"phase_every": 0}, "phase_every must be an int >= 1 epoch or None, got 0"),
        ({"recipe": "abc"}, "recipe must be a dict of str keys"),
        ({"recipe": [("a", 1)]}, "recipe must be a dict of str keys"),
        ({"clip_grad_norm": "1"}, "clip_grad_norm \\(GradientClipping max_norm\\) must be a number > 0, got .1."),
    ],
)
def test_bad_trainer_arguments_are_refused_naming_the_value(kwargs, message):
    net, opt = _net_opt()
    args = {"optimizer": opt, "loss": nn.CrossEntropyLoss(), **kwargs}
    with pytest.raises(ConfigError, match=message):
        Trainer(net, args.pop("optimizer"), args.pop("loss"), **args)


def test_a_run_id_naming_the_lease_directory_is_refused(tmp_path):
    from nnx_es.errors import InvalidRunIdError

    net, opt = _net_opt()
    with pytest.raises(InvalidRunIdError, match=r"not '\.', '\.\.' or '\.leases' .*got '\.leases'"):
        Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=tmp_path, run_id=".leases")


def test_numpy_and_tensor_loss_weights_and_negative_seeds_are_accepted():
    import numpy as np

    net, opt = _net_opt()
    for weight in (np.float32(0.1), np.int64(1), torch.tensor(0.5), 2):
        t = Trainer(net, opt, {"ce": (nn.CrossEntropyLoss(), weight)}, seed=-1)
        assert t.objective.terms["ce"].weight == float(weight) and t.seed == -1
    t = Trainer(net, opt, nn.CrossEntropyLoss(), seed=np.int64(3), validate_every=np.int64(2), clip_grad_norm=np.float32(1))
    assert t.seed == 3 and type(t.seed) is int


def test_an_optimizer_over_another_nets_parameters_is_refused():
    with pytest.raises(ConfigError, match="not the net's"):
        Trainer(small_net(), torch.optim.Adam(small_net().parameters()), nn.CrossEntropyLoss())


@pytest.mark.parametrize("bad", [lambda o, y: nn.functional.cross_entropy(o, y, reduction="none")[:3],
                                 lambda o, y: torch.cat([nn.functional.cross_entropy(o, y, reduction="none")] * 2),
                                 lambda o, y: 42])
def test_a_loss_without_one_value_per_row_is_refused(tmp_path, bad):
    net, opt = _net_opt()
    with pytest.raises(ConfigError, match="per row|per-row"):
        Trainer(net, opt, bad, runs_root=tmp_path, run_id="r", progress=False).fit(*loaders(), epochs=1)


def test_a_validation_monitor_without_a_validation_loader_is_refused_before_training(tmp_path):
    net, opt = _net_opt()
    with pytest.raises(ConfigError, match="needs a validation loader"):
        Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", runs_root=tmp_path, run_id="r").fit(
            loaders()[0], epochs=1)
    assert not (tmp_path / "r").exists()


def test_duplicate_explicit_scheduler_names_are_refused():
    net, opt = _net_opt()
    a = Scheduler(torch.optim.lr_scheduler.StepLR(opt, 1), name="s")
    b = Scheduler(torch.optim.lr_scheduler.StepLR(opt, 1), name="s")
    with pytest.raises(ConfigError, match="'s' is given twice"):
        Trainer(net, opt, nn.CrossEntropyLoss(), schedulers=[a, b])


def test_two_schedulers_on_one_optimizer_each_record_their_own_rates_and_audit_clean(tmp_path):
    net, opt = _net_opt()
    a = Scheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), name="a")
    b = Scheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1), name="b")
    run = Trainer(net, opt, nn.CrossEntropyLoss(), schedulers=[a, b], runs_root=tmp_path, run_id="r",
                  progress=False).fit(*loaders(), epochs=2)
    report = audit_run(run.run_dir)
    assert report.ok, report.violations
    steps = [(e.name, e.lrs) for _, e in read_events(run.run_dir) if e.KIND == "scheduler_stepped"]
    assert steps == [("a", [pytest.approx(0.05)]), ("b", [pytest.approx(0.005)]),
                     ("a", [pytest.approx(0.0025)]), ("b", [pytest.approx(0.00025)])]


def _recipe_trainer(tmp_path, *, plateau=True, monitor="val_loss", callbacks=()):
    net, opt = _net_opt()
    mode = "max" if "acc" in monitor else "min"  # a plateau scheduler agrees with the monitor (refused otherwise)
    scheds = [Scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode=mode), name="plateau")] if plateau else []
    return Trainer(net, opt, nn.CrossEntropyLoss(), monitor=monitor, schedulers=scheds, metrics=["accuracy"],
                   callbacks=list(callbacks), runs_root=tmp_path, run_id=None, progress=False)


@pytest.mark.parametrize("change, what", [({"plateau": False}, "schedulers"), ({"monitor": "val_accuracy"}, "monitor")])
def test_a_stateful_resume_with_a_changed_recipe_is_refused_naming_what_changed(tmp_path, change, what):
    first = _recipe_trainer(tmp_path)
    first.run_id = "r"
    first.fit(*loaders(), epochs=1)
    before = read_events(tmp_path / "r")
    with pytest.raises(ResumeError, match=f"different {what}"):
        _recipe_trainer(tmp_path, **change).fit(*loaders(), epochs=2, resume_from=tmp_path / "r")
    assert read_events(tmp_path / "r") == before


class _KillAfterStop(Callback):
    """SIGKILL in finalization: the early-stop epoch's LAST is durable, the run never finalized."""

    def on_train_end(self, ctx):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def test_resuming_a_run_that_had_decided_to_stop_trains_no_further_epoch(tmp_path):
    def trainer(run_id, extra=()):
        net = small_net()
        opt = torch.optim.SGD(net.parameters(), lr=0.0)  # nothing improves after epoch 0
        return Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", callbacks=[EarlyStopping(patience=2), *extra],
                       runs_root=tmp_path, run_id=run_id, progress=False)

    reference = trainer("ref").fit(*loaders(), epochs=10)
    assert reference.status == "stopped" and len(reference.history) == 3
    assert run_killed(lambda: trainer("r", [_KillAfterStop()]).fit(*loaders(), epochs=10)) == "killed"
    resumed = trainer(None, [_KillAfterStop.__base__()]).fit(*loaders(), epochs=10, resume_from=tmp_path / "r")
    assert resumed.status == "stopped"
    assert len(resumed.history) == len(reference.history)
    assert resumed.counters == reference.counters
    assert audit_run(tmp_path / "r").ok
