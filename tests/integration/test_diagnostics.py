"""Diagnostics(every=N), diagnose(RUN) / ``nnx-es diagnose`` and the learning-rate range test on digits.

The planted problems: a learning rate far too high for plain SGD (5: the digits MLP trains well at 0.1-1),
and a dead-ReLU net (the hidden layer's biases at -5, so no unit is ever positive). The healthy run is the
digits MLP with Adam at 3e-3.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from events.codec import KINDS
from nnx_es import Diagnostics, Trainer, diagnose, lr_find
from nnx_es.audit import audit_run
from nnx_es.cli.main import main as nnx_es_main
from nnx_es.diagnostics.checks import CHECKS
from nnx_es.diagnostics.lr_range import suggest
from nnx_es.errors import ConfigError, UnsafePathError
from trainkit import of_kind

EPOCHS = 8


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val, test = perm[:1200], perm[1200:1500], perm[1500:]
    return {"train": (x[train], y[train]), "val": (x[val], y[val]), "test": (x[test], y[test])}


def _loader(part, shuffle=False):
    return DataLoader(TensorDataset(*part), batch_size=32, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(0) if shuffle else None)


def _net(seed=0, dead=False):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    if dead:
        with torch.no_grad():
            net[0].bias.fill_(-5.0)  # inputs are in [0, 1]: every hidden unit starts (and stays) negative
    return net


def _fit(root, digits, run_id, *, optimizer, lr, dead=False, every=5, epochs=EPOCHS):
    net = _net(dead=dead)
    opt = torch.optim.Adam(net.parameters(), lr=lr) if optimizer == "adam" else torch.optim.SGD(net.parameters(), lr=lr)
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=root, run_id=run_id, progress=False,
                      metrics=["accuracy"], callbacks=[Diagnostics(every=every)])
    return trainer.fit(_loader(digits["train"], shuffle=True), _loader(digits["val"]), epochs=epochs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, digits):
    root = tmp_path_factory.mktemp("diag-runs")
    return {
        "healthy": _fit(root, digits, "healthy", optimizer="adam", lr=3e-3),
        "too_high_lr": _fit(root, digits, "too-high-lr", optimizer="sgd", lr=5.0),
        "dead_relu": _fit(root, digits, "dead-relu", optimizer="adam", lr=3e-3, dead=True),
    }


def test_diagnose_is_quiet_on_the_healthy_digits_run_with_every_check_made(runs):
    healthy = runs["healthy"]
    assert healthy.history[-1].val["val_accuracy"] >= 0.95  # it is healthy
    diagnosis = diagnose(healthy.run_dir)
    assert diagnosis.findings == ()
    assert diagnosis.not_checked == {}
    assert set(diagnosis.checked) == {name for name, _ in CHECKS}
    assert "no findings" in str(diagnosis)


def test_diagnose_flags_a_too_high_learning_rate(runs):
    diagnosis = diagnose(runs["too_high_lr"].run_dir)
    codes = set(diagnosis.codes)
    assert {"update_ratio_high", "dead_units", "plateau"} <= codes, str(diagnosis)
    ratio = next(f for f in diagnosis.findings if f.code == "update_ratio_high")
    assert "lower the learning rate" in ratio.advice
    spike = next(line for line in ratio.evidence if "largest: layer" in line)
    assert float(spike.rsplit(", ", 1)[1].rstrip("x")) >= 1.0  # an update as large as the layer's weights


def test_diagnose_flags_a_dead_relu_network_as_dead_and_not_as_too_fast(runs):
    diagnosis = diagnose(runs["dead_relu"].run_dir)
    codes = set(diagnosis.codes)
    assert {"dead_units", "vanishing_gradients", "plateau"} <= codes, str(diagnosis)
    assert "update_ratio_high" not in codes and "exploding_gradients" not in codes
    dead = next(f for f in diagnosis.findings if f.code == "dead_units")
    assert "100%" in dead.title and "1:" in dead.title  # module "1" of the Sequential is the ReLU


def test_a_diverged_run_is_said_to_diverge_and_is_never_told_to_raise_the_learning_rate(tmp_path, digits):
    run = _fit(tmp_path, digits, "diverged", optimizer="sgd", lr=1e6, epochs=2)  # weights blown up by update 2
    diagnosis = diagnose(run.run_dir)
    codes = set(diagnosis.codes)
    assert "loss_diverged" in codes and "update_ratio_low" not in codes, str(diagnosis)
    assert not any("raise the learning rate" in f.advice for f in diagnosis.findings)  # was said: huge weights
    diverged = next(f for f in diagnosis.findings if f.code == "loss_diverged")  # make every update look small
    assert "lower the learning rate" in diverged.advice
    first = diagnosis.run.losses[0]
    assert f"the first update's {first:.3g}" in diverged.title and math.isfinite(first)


def test_records_are_on_the_cadence_before_history_and_the_run_audits_clean(runs):
    run = runs["healthy"]
    records = of_kind(run.run_dir, "diagnostics_recorded")
    assert [r.step for r in records] == list(range(5, run.counters.step + 1, 5))
    assert all(set(r.grad_norm) == set(r.weight_norm) == set(r.update_ratio) == {"0", "2"} for r in records)
    assert all(set(r.dead_fraction) == set(r.activation_mean) == {"1"} for r in records)
    assert audit_run(run.run_dir).ok
    assert "diagnostics_recorded" in KINDS


def test_recorded_values_are_the_layers_norms_of_a_plain_sgd_update(tmp_path):
    """SGD without momentum moves a layer by lr * its gradient: ||dW|| = lr * ||g||; and the first record's
    weights, activations and dead units are the initial net's on the first microbatch, computed here."""
    x = torch.rand(24, 6)
    y = torch.arange(24) % 3
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        net[0].bias[:5] = -10.0  # five units that are never positive on inputs in [0, 1)
    initial = [m for m in (net[0], net[2])]
    weight0 = {str(i): math.sqrt(sum(p.detach().pow(2).sum().item() for p in m.parameters()))
               for i, m in ((0, initial[0]), (2, initial[1]))}
    hidden = net[1](net[0](x[:8])).detach()
    lr = 0.05
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=lr), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="r", progress=False, callbacks=[Diagnostics(every=1)])
    run = trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8), epochs=2)
    records = of_kind(run.run_dir, "diagnostics_recorded")
    assert [r.step for r in records] == list(range(1, 7))
    for r in records:
        for layer in ("0", "2"):
            moved = r.update_ratio[layer] * r.weight_norm[layer]
            assert moved == pytest.approx(lr * r.grad_norm[layer], rel=1e-4)
    first = records[0]
    assert first.weight_norm == pytest.approx(weight0, rel=1e-6)
    assert first.activation_mean["1"] == pytest.approx(hidden.mean().item(), rel=1e-5)
    assert first.activation_std["1"] == pytest.approx(hidden.std(correction=0).item(), rel=1e-5)
    assert first.dead_fraction["1"] == pytest.approx(((hidden > 0).sum(0) == 0).float().mean().item())
    assert first.dead_fraction["1"] >= 5 / 16


def test_a_run_without_diagnostics_writes_none_and_diagnose_says_what_it_could_not_check(tmp_path, digits):
    net = _net()
    trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=3e-3), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="plain", progress=False)
    run = trainer.fit(_loader(digits["train"]), epochs=2)
    assert of_kind(run.run_dir, "diagnostics_recorded") == []
    diagnosis = diagnose(run.run_dir)
    assert {"vanishing gradients", "dead units", "update ratio"} <= set(diagnosis.not_checked)
    assert "Diagnostics(every=N)" in diagnosis.not_checked["update ratio"]


def test_diagnostics_is_a_spec_callback():
    from nnx_es.recipes import from_spec, to_spec

    recipe = to_spec(Diagnostics(every=7, activations=False))
    assert recipe.target == "nnx_es.diagnostics.recorder:Diagnostics"
    built = from_spec(recipe, slot="callback")
    assert isinstance(built, Diagnostics) and (built.every, built.activations) == (7, False)


def test_diagnostics_refuses_a_bad_cadence():
    for bad in (0, -1, 2.5, True, "5"):
        with pytest.raises(ConfigError, match="every"):
            Diagnostics(every=bad)


def test_the_diagnose_command_exits_by_findings_writes_its_plot_outside_the_run_only(runs, tmp_path, capsys):
    healthy, hot = Path(runs["healthy"].run_dir), Path(runs["too_high_lr"].run_dir)
    assert nnx_es_main(["diagnose", str(healthy)]) == 0
    assert "no findings" in capsys.readouterr().out
    png = tmp_path / "hot.png"
    assert nnx_es_main(["diagnose", str(hot), "--plot", str(png), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert "update_ratio_high" in [f["code"] for f in report["findings"]] and report["records"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = sorted(p.name for p in hot.rglob("*"))
    assert nnx_es_main(["diagnose", str(hot), "--plot", str(hot / "inside.png")]) == 2
    assert "inside the run" in capsys.readouterr().err
    assert sorted(p.name for p in hot.rglob("*")) == before
    with pytest.raises(UnsafePathError):
        from nnx_es.diagnostics.plot import check_plot_path

        check_plot_path(hot / "views" / "x.png", hot)


# --- the learning-rate range test --------------------------------------------------------------


def test_suggest_is_the_steepest_descent_against_log_lr_past_the_skipped_points():
    lrs = [10 ** (-6 + 0.1 * i) for i in range(50)]
    losses = [2.0] * 20 + [2.0 - 0.1 * i for i in range(1, 11)] + [1.0] * 20
    losses[25] -= 0.3  # the steepest drop: into point 25 and out of it
    index = suggest(lrs, losses)
    assert index in (24, 25)
    assert suggest(lrs, [5.0 - i for i in range(50)], skip_begin=10, skip_end=1) in range(10, 49)
    assert suggest(lrs[:11], [1.0] * 11) is None  # one point left after the skipped ones


def test_lr_find_suggestion_trains_digits_to_95_percent_held_out(tmp_path, digits, monkeypatch):
    """Plain SGD (measured here: its suggestion, 0.83, trains four seeds to 0.956-0.976 in 10 epochs; Adam's,
    0.074, to 0.943-0.966: the steepest descent sits near the edge of the rates that train, see the guide)."""
    import tempfile

    made = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)  # the sweep's throwaway runs root, seen
    net = _net(seed=1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=123.0)
    result = lr_find(net, opt, nn.CrossEntropyLoss(), _loader(digits["train"], shuffle=True),
                     plot=tmp_path / "curve.png")
    roots = [Path(m) for m in made if Path(m).name.startswith("nnx-es-lr-find-")]
    assert len(roots) == 1 and not roots[0].exists()  # the throwaway run is gone
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items()) and opt.param_groups[0]["lr"] == 123.0
    assert result.suggestion is not None and 1e-4 < result.suggestion < 1.0, str(result)
    assert len(result.lrs) == len(result.losses) <= 100 and result.lrs == tuple(sorted(result.lrs))
    lr = result.suggestion
    trained = _net(seed=2)
    Trainer(trained, torch.optim.SGD(trained.parameters(), lr=lr), nn.CrossEntropyLoss(), runs_root=tmp_path / "r",
            progress=False).fit(_loader(digits["train"], shuffle=True), epochs=10)
    x, y = digits["test"]
    with torch.no_grad():
        accuracy = (trained(x).argmax(1) == y).float().mean().item()
    assert accuracy >= 0.95, f"lr {lr:.3g}: held-out accuracy {accuracy:.3f}"


def test_lr_find_stops_when_the_loss_diverges(tmp_path, digits):
    net = _net()
    result = lr_find(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                     _loader(digits["train"]), min_lr=1e-3, max_lr=1e4, steps=80)
    assert result.stopped in ("diverged", "nonfinite")
    assert len(result.lrs) < 80


def test_lr_find_refuses_bad_arguments_before_training(digits):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = _loader(digits["train"])
    for kwargs, match in [({"min_lr": 1.0, "max_lr": 0.1}, "min_lr"), ({"steps": 1}, "steps"),
                          ({"beta": 1.0}, "beta"), ({"runs_root": "x"}, "runs_root")]:
        with pytest.raises(ConfigError, match=match):
            lr_find(net, opt, nn.CrossEntropyLoss(), loader, **kwargs)


def test_report_lr_find_on_a_spec_suggests_and_plots(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert nnx_es_main(["init", "--out", "spec.json", "--epochs", "2"]) == 0
    assert nnx_es_main(["report", "spec.json", "--lr-find", "--lr-find-steps", "40",
                        "--lr-find-png", "curve.png"]) == 0
    out = capsys.readouterr().out
    assert "suggested learning rate" in out and "40 updates" in out
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "runs").exists()
