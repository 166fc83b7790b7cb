"""Fine-tuning: weights from a run or a state_dict with an explicit key policy (lineage), freeze
schedules, layer-wise learning rates; a new head with a freeze schedule resumes bitwise after SIGKILL."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import Callback, Trainer
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.finetune import Freeze, WeightsFrom, param_groups
from nnx_es.testing import Fit, crash_test
from trainkit import blobs_data, loaders, read_events, small_net

torch.set_num_threads(1)


def _pretrained(tmp_path):
    net = small_net(5)  # 4 -> 8 -> 3 classes
    train, val = loaders(batch_size=8, n_train=48)
    run = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.3), nn.CrossEntropyLoss(), monitor="val_loss",
                  runs_root=tmp_path / "runs", run_id="pre", progress=False).fit(train, val, epochs=2)
    return run, net


def _two_class_loaders():
    x, y = blobs_data(72, seed=4)
    y = (y == 0).long()  # a new task: 2 classes
    train = DataLoader(TensorDataset(x[:48], y[:48]), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(1))
    return train, DataLoader(TensorDataset(x[48:], y[48:]), batch_size=16)


def _new_head_net(seed=11) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _finetuner(runs_root, run_id, source, *, until_epoch=1, extra=(), **kw) -> Trainer:
    net = _new_head_net()
    init = WeightsFrom(source, "best", strict=False)
    trainer = Trainer(net, torch.optim.Adam(param_groups(net, 1e-2, rules=[("0.*", 0.1)])), nn.CrossEntropyLoss(),
                      init_from=init, callbacks=[Freeze(["0.*"], until_epoch=until_epoch), *extra], monitor="val_loss",
                      runs_root=runs_root, run_id=run_id, progress=False, **kw)
    return trainer


def test_a_new_head_loads_the_matching_keys_and_records_exactly_which_were_skipped_and_new(tmp_path):
    pre, pre_net = _pretrained(tmp_path)
    trainer = _finetuner(tmp_path / "runs", "ft", pre.run_dir)
    # the backbone came from the source's BEST; the new head kept its own initialization
    from nnx_es import NNModel

    best = NNModel(small_net(0))
    best.load(pre.run_dir, "best", weights="raw")
    assert torch.equal(trainer.net[0].weight, best.net[0].weight)
    assert torch.equal(trainer.net[2].weight, _new_head_net()[2].weight)
    train, val = _two_class_loaders()
    run = trainer.fit(train, val, epochs=3)
    started = read_events(run.run_dir)[0][1]
    lin = started.lineage
    assert (lin.kind, lin.run_id, lin.checkpoint, lin.manifest, lin.epoch, lin.strict) == (
        "run", "pre", "best", pre.best.manifest, pre.best.epoch, False)
    assert lin.skipped == ["2.bias", "2.weight"] and lin.new == ["2.bias", "2.weight"]
    assert started.param_groups == {"adam": ["0.*", "default"]}
    # layer-wise lrs in every receipt, group by group
    receipts = [e for _, e in read_events(run.run_dir) if e.KIND == "update_committed"]
    assert all(r.lrs == [pytest.approx(1e-3), 1e-2] for r in receipts)


def test_the_freeze_schedule_trains_the_backbone_only_from_its_epoch(tmp_path):
    pre, _ = _pretrained(tmp_path)
    snapshots = {}

    class Snap(Callback):
        def on_epoch_end(self, ctx):
            snapshots[ctx.epoch] = (ctx.net[0].weight.detach().clone(), ctx.net[0].weight.requires_grad)

    trainer = _finetuner(tmp_path / "runs", "ft", pre.run_dir, extra=[Snap()])
    start = trainer.net[0].weight.detach().clone()
    trainer.fit(*_two_class_loaders(), epochs=3)
    assert torch.equal(snapshots[0][0], start) and snapshots[0][1] is False
    assert not torch.equal(snapshots[1][0], start) and snapshots[1][1] is True


def _bn_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh()), nn.Linear(8, 2))


def _bn_stats_after(tmp_path, run_id, freeze, **kw):
    net = _bn_net()
    before = {k: v.clone() for k, v in net[0][1].state_dict().items()}
    train, val = _two_class_loaders()
    Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), callbacks=[freeze],
            runs_root=tmp_path / "runs", run_id=run_id, progress=False, **kw).fit(train, val, epochs=2)
    return before, net[0][1].state_dict()


def test_a_frozen_modules_batchnorm_keeps_its_running_statistics_unless_norm_stats_update(tmp_path):
    # found in a trial: Freeze left a frozen backbone's BatchNorm updating its running mean and variance
    before, after = _bn_stats_after(tmp_path, "frozen", Freeze(["0.*"]), validate_every_steps=2)
    for k in before:  # validation passes within the epoch (which restore train mode) included
        assert torch.equal(before[k], after[k]), k
    before, after = _bn_stats_after(tmp_path, "update", Freeze(["0.*"], norm_stats="update"))
    assert not torch.equal(before["running_mean"], after["running_mean"])
    assert after["num_batches_tracked"] > 0
    before, after = _bn_stats_after(tmp_path, "thawed", Freeze(["0.*"], until_epoch=1))
    assert not torch.equal(before["running_mean"], after["running_mean"])  # epoch 1 trains it all
    assert Freeze(["0.*"]).norm_layers(_bn_net()) == ["0.1"] and Freeze(["0.0.*"]).norm_layers(_bn_net()) == []
    with pytest.raises(ConfigError, match=r"norm_stats=\.\.\.\) must be one of \('freeze', 'update'\), got 'keep'"):
        Freeze(["0.*"], norm_stats="keep")


def test_strict_weights_refuse_a_new_head_naming_the_keys(tmp_path):
    pre, _ = _pretrained(tmp_path)
    net = _new_head_net()
    with pytest.raises(ConfigError, match=r"other shapes \['2.bias: \(3,\) in the source, \(2,\) in the net', '2.weight: \(3, 8\) in the source"):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                init_from=WeightsFrom(pre.run_dir, "last"), runs_root=tmp_path / "runs")
    with pytest.raises(ConfigError, match="match no parameter"):
        param_groups(net, 0.1, rules=[("backbone.*", 0.1)])


def test_a_state_dict_source_is_recorded_by_its_fingerprint(tmp_path):
    src = small_net(8).state_dict()
    net = small_net(0)
    run = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), init_from=src,
                  runs_root=tmp_path / "runs", run_id="sd", progress=False).fit(loaders()[0], epochs=1)
    lin = read_events(run.run_dir)[0][1].lineage
    assert lin.kind == "state_dict" and len(lin.state_sha256) == 64 and lin.skipped == [] and lin.new == []


def test_layer_decay_groups(tmp_path):
    net = small_net(0)
    groups = param_groups(net, 1.0, layer_decay=0.5)
    assert [(g["name"], g["lr"]) for g in groups] == [("0", 0.5), ("2", 1.0)]


def test_finetuning_a_new_head_with_a_freeze_schedule_resumes_bitwise_after_sigkill(tmp_path):
    pre, _ = _pretrained(tmp_path)

    def build(runs_root, run_id):
        return Fit(_finetuner(runs_root, run_id, pre.run_dir, seed=0), *_two_class_loaders())

    report = crash_test(build, epochs=3, points=5)
    assert report.ok, report


def test_a_resume_with_another_freeze_schedule_is_refused(tmp_path):
    pre, _ = _pretrained(tmp_path)
    run = _finetuner(tmp_path / "runs", "ft", pre.run_dir).fit(*_two_class_loaders(), epochs=1)
    other = _finetuner(tmp_path / "runs", "ft", pre.run_dir, until_epoch=2)
    with pytest.raises(ResumeError, match="froze"):
        other.fit(*_two_class_loaders(), epochs=2, resume_from=run.run_dir)


def test_report_shows_each_parameter_groups_learning_rate(tmp_path):
    import contextlib
    import io
    import json
    import os

    import msgspec

    from nnx_es.cli.main import main
    from nnx_es.recipes.runspec import scaffold

    spec = msgspec.to_builtins(scaffold(epochs=1))
    opt = next(iter(spec["optimizers"].values()))
    opt["kwargs"]["params"] = {"@params": [{"names": ["layers.0.weight", "layers.0.bias"], "lr": 0.0003},
                                           {"names": ["layers.2.weight", "layers.2.bias"]}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(out):
            main(["report", "spec.json"])
    finally:
        os.chdir(cwd)
    text = out.getvalue()
    assert "2 parameter group(s)" in text
    assert "group 0   lr=0.0003  2 parameter(s): layers.0.weight, layers.0.bias" in text
    assert f"group 1   lr={opt['kwargs']['lr']}  2 parameter(s): layers.2.weight, layers.2.bias" in text
