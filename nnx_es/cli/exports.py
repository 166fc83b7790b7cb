"""``nnx-es export`` and ``nnx-es predict``: a trained run's model as a verified artifact, or its predictions.

    nnx-es export RUN --format onnx|torch-export|safetensors --out PATH [--checkpoint best|last|SEQ]
                  [--sample FILE.npy|.csv] [--rows N] [--atol A] [--rtol R] [--no-record] [--spec S] [--allow PKG]
    nnx-es predict RUN INPUT.npy|.csv --out FILE.npy|.csv [--checkpoint best|last|SEQ] [--device D]
                   [--batch-size B] [--output class|proba|raw] [--spec S] [--allow PKG]

The net is rebuilt from the spec the run recorded (``recipe_required=True``, ``nnx-es run``; or ``--spec``)
by type through the recipe guard, and the checkpoint loaded into it with ``NNModel.load`` -- so the
transforms the checkpoint's net carried are rebuilt first and a pruned, adapted or re-headed model
predicts as it did in training. ``export`` verifies the artifact against the model before it writes it
(:mod:`nnx_es.export`) and records ``model_exported`` in the run. Exit status: 0 done, 1 the artifact
computes something else (refused, the differences printed), 2 bad input.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nnx_es.artifacts import destination, write_output
from nnx_es.cli._common import EXIT_OK, EXIT_VIOLATIONS
from nnx_es.cli._format import printable
from nnx_es.cli._specs import BadInput, allowed_packages, guarded, read_spec_file, stored_spec

__all__ = ["add_commands", "read_rows", "write_rows"]

#: the largest input file ``predict`` reads (bytes): a bound on what a hostile file costs
MAX_INPUT_BYTES = 4 * 2**30


def _checkpoint(text: str) -> str | int:
    if text in ("best", "last"):
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"--checkpoint takes 'best', 'last' or a LAST's seq, got {text!r}")


def read_rows(path: str | Path) -> torch.Tensor:
    """Inputs from a ``.npy`` file (any shape ``(N, ...)``; no pickles) or a ``.csv`` file (``(N, F)``, numbers
    separated by commas; a first line that is not numbers is a header and skipped), as float32.

    Raises:
        BadInput: another suffix, a missing, oversized or unreadable file, or values that are not numbers.
    """
    p = Path(path)
    if p.suffix not in (".npy", ".csv"):
        raise BadInput(f"INPUT {str(path)!r} must be a .npy or .csv file")
    if not p.is_file():
        raise BadInput(f"INPUT {str(path)!r} is not a file")
    if p.stat().st_size > MAX_INPUT_BYTES:
        raise BadInput(f"INPUT {str(path)!r} is larger than {MAX_INPUT_BYTES} bytes")
    try:
        if p.suffix == ".npy":
            array = np.load(p, allow_pickle=False)
        else:
            with open(p) as f:
                first = f.readline()
            try:
                [float(v) for v in first.split(",")]
                skip = 0
            except ValueError:
                skip = 1
            array = np.loadtxt(p, delimiter=",", ndmin=2, skiprows=skip, dtype=np.float64)
    except (ValueError, OSError) as exc:
        raise BadInput(f"INPUT {str(path)!r} cannot be read: {exc}") from None
    if array.dtype.kind not in "fiub" or array.ndim < 1 or len(array) == 0:
        raise BadInput(f"INPUT {str(path)!r} must hold numbers, shape (N, ...) with N >= 1; got {array.dtype} "
                       f"{array.shape}")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def write_rows(path: str | Path, values: torch.Tensor) -> None:
    """Write ``values`` ``(N, ...)`` to a ``.npy`` file, or a ``.csv`` (one line per row, flattened)."""
    p = Path(path)
    array = values.numpy()
    if p.suffix == ".npy":
        np.save(p, array, allow_pickle=False)
    else:
        flat = array.reshape(len(array), -1)
        np.savetxt(p, flat, delimiter=",", fmt="%d" if flat.dtype.kind in "iu" else "%.8g")


def _model(args: argparse.Namespace) -> Any:
    """The run's net rebuilt from its spec, the checkpoint loaded into it (:meth:`nnx_es.NNModel.load`)."""
    from nnx_es.nnmodel import NNModel
    from nnx_es.recipes import from_spec
    from nnx_es.recipes.runspec import validate_spec

    run_dir = Path(args.run_dir)
    spec = read_spec_file(args.spec) if args.spec else stored_spec(run_dir)
    if spec is None:
        raise BadInput(f"run {run_dir.name!r} recorded no spec (it was not started by nnx-es run, nor with "
                       f"recipe_required=True): pass --spec FILE, the spec its model was built from "
                       f"(nnx-es {args.command} {run_dir} --spec FILE ...)")
    allowed = allowed_packages(args)
    validate_spec(spec, allowed)
    net = from_spec(spec.model, allowed=allowed, slot="model")
    model = NNModel(net)
    model.load(run_dir, args.checkpoint, weights=args.weights)
    return model, allowed


def _export(args: argparse.Namespace) -> int:
    from nnx_es.errors import ExportMismatchError
    from nnx_es.export import export_checkpoint

    if args.rows < 1:
        raise BadInput(f"--rows must be >= 1, got {args.rows}")
    model, allowed = _model(args)
    sample = read_rows(args.sample)[:args.rows] if args.sample else None
    src = model.source
    try:
        report = export_checkpoint(model.net, run_dir=src.run_dir, checkpoint=src.checkpoint, manifest=src.manifest,
                                   epoch=src.epoch, fmt=args.format, out=args.out, sample=sample, rows=args.rows,
                                   atol=args.atol, rtol=args.rtol, record=not args.no_record, allowed=allowed)
    except ExportMismatchError as exc:
        print(printable(f"nnx-es export: refused: {exc}"))
        return EXIT_VIOLATIONS
    print(printable(f"exported {report.format} {report.path} ({report.size_bytes} bytes, sha256 {report.sha256})"))
    print(f"  verified on {report.rows} {report.sample} rows: max abs diff {report.max_abs_diff:.3g}, max rel diff "
          f"{report.max_rel_diff:.3g} (atol {report.atol:g}, rtol {report.rtol:g}); export {report.export_s:.2f} s, "
          f"check {report.verify_s:.2f} s")
    if report.recorded_seq is not None:
        print(printable(f"  recorded as model_exported (seq {report.recorded_seq}) in {src.run_dir}"))
    return EXIT_OK


def _predict(args: argparse.Namespace) -> int:
    from torch.utils.data import DataLoader, TensorDataset

    if args.batch_size < 1:
        raise BadInput(f"--batch-size must be >= 1, got {args.batch_size}")
    if Path(args.out).suffix not in (".npy", ".csv"):
        raise BadInput(f"--out {args.out!r} must end in .npy or .csv")
    destination(args.out, None)  # never inside a run: refused before anything is loaded
    x = read_rows(args.input)
    model, _ = _model(args)
    if args.device is not None:
        from nnx_es.device import resolve_device

        model.net.to(resolve_device(args.device, model.net))
    loader = DataLoader(TensorDataset(x), batch_size=args.batch_size)
    t0 = time.perf_counter()
    predict = {"raw": model.outputs, "proba": model.predict_proba}.get(args.output, model.predict)
    try:
        values = predict(loader)
    except RuntimeError as exc:  # rows the net cannot take (a shape mismatch): the user's input, not a crash
        raise BadInput(f"INPUT {str(args.input)!r}: rows of shape {tuple(x.shape[1:])} do not fit the run's model "
                       f"({' '.join(str(exc).split())[:200]})") from None
    seconds = time.perf_counter() - t0
    write_output(args.out, lambda path: write_rows(path, values))
    print(printable(f"wrote {args.out}: {args.output} of {len(x)} rows, shape {tuple(values.shape)} ({seconds:.3f} s; "
                    f"{model.source.checkpoint} checkpoint, epoch {model.source.epoch})"))
    return EXIT_OK


def add_commands(sub: Any) -> None:
    """Add ``export`` and ``predict`` to the ``nnx-es`` sub-parsers ``sub``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--checkpoint", type=_checkpoint, default="best", help="best (default), last or a LAST's seq")
    common.add_argument("--weights", default="evaluated", choices=("evaluated", "raw", "averaged"),
                        help="which of the checkpoint's weights (default: the ones validation scored)")
    common.add_argument("--spec", default=None, help="the spec the net is built from (default: the run's own)")
    common.add_argument("--allow", action="append", metavar="PKG", default=[],
                        help="also allow recipes to import from package PKG (repeatable)")
    p = sub.add_parser("export", parents=[common], help="export a run's model, verified against it, and record it",
                       description="Rebuild RUN's net from its spec, load the checkpoint (its transforms rebuilt), write "
                       "the artifact, run it on a sample batch (the run's validation rows, or --sample) and compare it "
                       "with the model; exit 1 with the differences when they exceed the tolerances. A verified export "
                       "is recorded in the run as model_exported (replay checks its digest).")
    p.add_argument("run_dir", help="the run directory, runs/<id>")
    p.add_argument("--format", required=True, choices=("onnx", "torch-export", "safetensors"))
    p.add_argument("--out", required=True, help="the artifact's path (not inside another run)")
    p.add_argument("--sample", default=None, help="a .npy or .csv batch to verify on (default: validation rows)")
    p.add_argument("--rows", type=int, default=64, help="rows of the sample batch (default 64)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default per format)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default per format)")
    p.add_argument("--no-record", action="store_true", help="do not append model_exported to the run")
    p.set_defaults(run=guarded("export", _export))
    p = sub.add_parser("predict", parents=[common], help="predict with a run's model on rows from a file",
                       description="Rebuild RUN's net, load the checkpoint (its transforms rebuilt) and write its "
                       "predictions for INPUT's rows: class ids (default), probabilities or raw outputs.")
    p.add_argument("run_dir", help="the run directory, runs/<id>")
    p.add_argument("input", help="rows to predict: .npy (N, ...) or .csv (N, F)")
    p.add_argument("--out", required=True, help="where the predictions go: .npy or .csv")
    p.add_argument("--output", default="class", choices=("class", "proba", "raw"), help="what to write")
    p.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N, mps")
    p.add_argument("--batch-size", type=int, default=256, help="rows per forward pass (default 256)")
    p.set_defaults(run=guarded("predict", _predict))
