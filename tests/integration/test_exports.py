"""Verified exports (``nnx_es.export``, ``nnx-es export``) and ``nnx-es predict``: the digits MLP (a spec run, its
validation rows rebuilt from its recipe) and a small CNN (a sample batch given) exported as ONNX, ``torch.export`` and
safetensors; each artifact verified before it is written, recorded as ``model_exported`` and checked by replay; a
planted difference refused with the numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from nnx_es import NNModel, Trainer
from nnx_es.audit import INVARIANTS, audit_run
from nnx_es.cli.main import main as nnx_es
from nnx_es.errors import ConfigError, ExportMismatchError, UnsafePathError
from nnx_es.export import FORMATS, WRITERS
from nnx_es.recipes import to_spec
from nnx_es.recipes.data import tabular
from nnx_es.recipes.runspec import build_run, scaffold
from nnx_es.transforms import Prune, TransformAt
from trainkit import of_kind

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("safetensors")

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """The digits MLP trained from the scaffolded spec (1 epoch), pruned by a callback at its end."""
    runs = tmp_path_factory.mktemp("runs")
    spec = scaffold(epochs=1, hidden=(32,))
    spec.callbacks.append(to_spec(TransformAt(0, Prune(["layers.0"], amount=0.5))))  # the callback by its recipe
    built = build_run(spec, runs_root=runs, run_id="mlp", progress=False)
    return built.trainer.fit(built.train_loader, built.val_loader, epochs=1)


class _CNN(nn.Module):
    """A small CNN over the 8x8 digits: (N, 64) float32 -> (N, 10) logits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(-1, 1, 8, 8)).flatten(1))


@pytest.fixture(scope="module")
def cnn_model(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    torch.manual_seed(0)
    train, val = tabular("digits", batch_size=64, seed=0)
    model = NNModel(_CNN())
    model.train(train, val, epochs=1, runs_root=runs, run_id="cnn", progress=False)
    model.load(runs / "cnn", "best")
    return model, next(iter(val))[0][:32]


def _mlp_net():
    from nnx_es.recipes.models import MLP

    return MLP(in_features=64, out_features=10, hidden=[32])


def test_the_digits_mlp_exports_in_every_format_verified_on_its_validation_rows_and_replay_checks_the_digests(
        mlp_run, tmp_path, capsys):
    run_dir = mlp_run.run_dir
    for fmt in FORMATS:
        out = tmp_path / f"mlp.{fmt}"
        assert nnx_es(["export", str(run_dir), "--format", fmt, "--out", str(out), "--rows", "48"]) == 0
        assert out.is_file()
    said = capsys.readouterr().out
    assert said.count("verified on 48 validation rows") == 3
    events = of_kind(run_dir, "model_exported")
    assert [e.format for e in events] == list(FORMATS)
    for e in events:
        assert e.sample == "validation" and e.rows == 48 and e.checkpoint == "best"
        assert e.max_abs_diff <= e.atol + e.rtol * 100  # within the stated tolerance (outputs are small logits)
        assert [t["transform"]["target"] for t in e.transforms] == ["nnx_es.transforms.kinds:Prune"]
    assert audit_run(run_dir).ok
    # an artifact changed after it was recorded: replay names it (invariant 4)
    onnx = tmp_path / "mlp.onnx"
    onnx.write_bytes(onnx.read_bytes() + b"\0")
    report = audit_run(run_dir)
    assert not report.ok and any(v.invariant == 4 and "onnx artifact" in v.message for v in report.violations)
    onnx.unlink()  # gone: not checked, not a violation
    assert audit_run(run_dir).ok


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_small_cnn_exports_verified_on_a_given_batch_and_the_artifact_computes_the_model(cnn_model, fmt, tmp_path):
    model, sample = cnn_model
    out = tmp_path / f"cnn.{fmt}"
    report = model.export(out, fmt, sample=sample)
    assert report.rows == 32 and report.sample == "given" and out.stat().st_size == report.size_bytes
    (event,) = [e for e in of_kind(model.source.run_dir, "model_exported") if e.path == str(out)]
    assert event.sha256 == report.sha256 and event.manifest == model.source.manifest
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    want = model.outputs(x)
    if fmt == "onnx":
        import onnxruntime as ort

        got = torch.from_numpy(ort.InferenceSession(str(out)).run(None, {"input": x.numpy()})[0])
    elif fmt == "torch-export":
        got = torch.export.load(str(out)).module()(x)
    else:
        from safetensors.torch import load_file

        net = _CNN()
        net.load_state_dict(load_file(str(out)))
        got = net.eval()(x)
        again = [model.export(tmp_path / f"again{i}.{fmt}", fmt, sample=sample) for i in range(7)]
        assert {r.sha256 for r in again} == {report.sha256}  # byte for byte (two metadata keys: 1 in 128 would pass)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # another batch size: the batch is dynamic
    assert audit_run(model.source.run_dir).ok


class _ExportsOtherwise(nn.Module):
    """Computes ``x @ W`` eagerly, but ``x @ W + 0.01`` while torch traces it for an export: a planted difference."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + (0.01 if torch.compiler.is_exporting() else 0.0)


@pytest.mark.parametrize("fmt", ["torch-export", "safetensors"])  # ONNX runs the same comparison (and costs seconds)
def test_an_export_that_computes_something_else_is_refused_with_the_numbers_and_nothing_is_written(
        fmt, tmp_path, monkeypatch):
    model = NNModel(_ExportsOtherwise())
    sample = torch.rand(16, 64)
    if fmt == "safetensors":  # the file loses a digit of one weight
        write, run = WRITERS[fmt]

        def corrupt(form, batch, path):
            write(form, batch, path)
            from safetensors.torch import load_file, save_file

            state = load_file(str(path))
            state["lin.bias"][3] += 1e-3
            save_file(state, str(path))
        monkeypatch.setitem(WRITERS, fmt, (corrupt, run))
    out = tmp_path / "planted"
    with pytest.raises(ExportMismatchError, match=r"max abs diff 0\.01|max abs diff 0\.001") as err:
        model.export(out, fmt, sample=sample, record=False)
    assert "atol=" in str(err.value) and "rtol=" in str(err.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_output_path_inside_another_run_or_through_a_link_inside_its_own_is_refused(mlp_run, tmp_path):
    run_dir = Path(mlp_run.run_dir)
    model = NNModel(_mlp_net())
    model.load(mlp_run.run_dir, "last")
    sample = torch.rand(4, 64)
    other = tmp_path / "other"
    (other / "events.lmdb").mkdir(parents=True)
    with pytest.raises(ConfigError, match="inside a run"):
        model.export(other / "m.safetensors", "safetensors", sample=sample)
    with pytest.raises(ConfigError, match="run's own 'events.lmdb'"):
        model.export(run_dir / "events.lmdb" / "m.safetensors", "safetensors", sample=sample)
    (run_dir / "exports").symlink_to(tmp_path)
    try:
        with pytest.raises(UnsafePathError, match="symbolic link"):
            model.export(run_dir / "exports" / "m.safetensors", "safetensors", sample=sample)
    finally:
        (run_dir / "exports").unlink()
    assert not (tmp_path / "m.safetensors").exists()
    report = model.export(run_dir / "exported" / "m.safetensors", "safetensors", sample=sample, record=False)
    assert report.path.endswith("exported/m.safetensors") and (run_dir / "exported" / "m.safetensors").is_file()


def test_predict_writes_the_pruned_models_predictions_as_nnmodel_gives_them(mlp_run, tmp_path):
    x = tabular("digits", seed=5)[1].dataset.tensors[0][:50]
    np.savetxt(tmp_path / "x.csv", x.numpy(), delimiter=",", header=",".join(f"p{i}" for i in range(64)))
    np.save(tmp_path / "x.npy", x.numpy())
    assert nnx_es(["predict", str(mlp_run.run_dir), str(tmp_path / "x.csv"), "--out", str(tmp_path / "c.csv"),
                   "--batch-size", "7"]) == 0
    assert nnx_es(["predict", str(mlp_run.run_dir), str(tmp_path / "x.npy"), "--out", str(tmp_path / "p.npy"),
                   "--output", "proba", "--checkpoint", "last"]) == 0
    best, last = NNModel(_mlp_net()), NNModel(_mlp_net())
    best.load(mlp_run.run_dir, "best")
    last.load(mlp_run.run_dir, "last")
    assert (best.net.layers[0].weight == 0).float().mean().item() == pytest.approx(0.5, abs=0.02)  # pruned as trained
    assert np.loadtxt(tmp_path / "c.csv", dtype=np.int64).tolist() == best.predict(x).tolist()
    assert np.array_equal(np.load(tmp_path / "p.npy"), last.predict_proba(x).numpy())
    assert nnx_es(["predict", str(mlp_run.run_dir), str(tmp_path / "x.txt"), "--out", str(tmp_path / "c.csv")]) == 2


def test_predict_never_writes_into_a_run_nor_through_a_link_and_names_rows_that_do_not_fit(mlp_run, tmp_path, capsys):
    """A fresh user's findings: ``--out`` inside another run was written, ``--out`` a link overwrote its target,
    and rows of the wrong width ended in a traceback."""
    x = tabular("digits", seed=5)[1].dataset.tensors[0][:8]
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "narrow.npy", x[:, :63].numpy())
    other = tmp_path / "other"
    (other / "events.lmdb").mkdir(parents=True)
    run = str(mlp_run.run_dir)
    assert nnx_es(["predict", run, str(tmp_path / "x.npy"), "--out", str(other / "p.npy")]) == 2
    assert "inside a run" in capsys.readouterr().err and not (other / "p.npy").exists()
    victim = tmp_path / "victim.csv"
    victim.write_text("keep me\n")
    (tmp_path / "link.csv").symlink_to(victim)
    assert nnx_es(["predict", run, str(tmp_path / "x.npy"), "--out", str(tmp_path / "link.csv")]) == 0
    assert victim.read_text() == "keep me\n" and not (tmp_path / "link.csv").is_symlink()
    assert len(np.loadtxt(tmp_path / "link.csv", dtype=np.int64)) == 8
    capsys.readouterr()
    assert nnx_es(["predict", run, str(tmp_path / "narrow.npy"), "--out", str(tmp_path / "n.npy")]) == 2
    err = capsys.readouterr().err
    assert "rows of shape (63,) do not fit" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_later_export_to_the_same_path_supersedes_the_earlier_one_and_replay_checks_only_the_latest(
        mlp_run, tmp_path):
    run_dir = mlp_run.run_dir
    out = tmp_path / "m.onnx"
    assert nnx_es(["export", str(run_dir), "--format", "safetensors", "--out", str(out)]) == 0
    assert nnx_es(["export", str(run_dir), "--format", "onnx", "--out", str(out)]) == 0
    first, latest = [e for e in of_kind(run_dir, "model_exported") if e.path == str(out)]
    assert first.sha256 != latest.sha256
    report = audit_run(run_dir)
    assert report.ok, [v.line() for v in report.violations]
    assert f"model_exported of {str(out)!r} was superseded by a later export to the same file: not checked" in "".join(
        report.notes)
    # the latest export is still checked, under the invariant that names exported artifacts
    out.write_bytes(out.read_bytes() + b"\0")
    report = audit_run(run_dir)
    assert [(v.invariant, v.message) for v in report.violations] == [
        (4, f"the onnx artifact {str(out)!r} is not the file its latest export recorded (changed since)")]
    assert "exported artifact" in INVARIANTS[4]
    out.unlink()


def test_an_export_through_a_linked_directory_supersedes_one_to_the_same_file(mlp_run, tmp_path):
    # found by a fresh user: the log records the path as given (links not resolved), so the second export,
    # through a link to the first one's directory, was not seen to replace the file and replay failed
    run_dir = mlp_run.run_dir
    (tmp_path / "e").mkdir()
    (tmp_path / "elink").symlink_to(tmp_path / "e")
    out = tmp_path / "e" / "m2.safetensors"
    assert nnx_es(["export", str(run_dir), "--format", "safetensors", "--out", str(out)]) == 0
    assert nnx_es(["export", str(run_dir), "--format", "onnx", "--out", str(tmp_path / "elink" / "m2.safetensors")]) == 0
    report = audit_run(run_dir)
    assert report.ok, [v.line() for v in report.violations]
    assert f"model_exported of {str(out)!r} was superseded by a later export to the same file" in "".join(report.notes)
    out.unlink()


def test_predict_and_export_of_a_run_without_a_recorded_spec_say_the_command_line_way(cnn_model, tmp_path, capsys):
    model, sample = cnn_model
    run_dir = model.source.run_dir
    rows = tmp_path / "x.npy"
    np.save(rows, sample.numpy())
    assert nnx_es(["predict", str(run_dir), str(rows), "--out", str(tmp_path / "p.npy")]) == 2
    assert capsys.readouterr().err == (
        f"nnx-es predict: run 'cnn' recorded no spec (it was not started by nnx-es run, nor with "
        f"recipe_required=True): pass --spec FILE, the spec its model was built from (nnx-es predict {run_dir} "
        "--spec FILE ...)\n")
    assert nnx_es(["export", str(run_dir), "--format", "onnx", "--out", str(tmp_path / "m.onnx")]) == 2
    assert "(nnx-es export " in capsys.readouterr().err
