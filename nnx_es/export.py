"""Verified exports: ONNX, ``torch.export`` and safetensors artifacts of a net, each run on a sample batch
and compared with the PyTorch model before it is reported.

:func:`export_net` writes the artifact to a private temporary, runs it -- onnxruntime for ONNX, the
reloaded ``ExportedProgram`` for ``torch-export``, a copy of the net with every tensor set to NaN and
then loaded from the file for safetensors -- on ``sample`` and compares its outputs with the net's
(eval mode, no gradients). It agrees when every output satisfies ``|a - b| <= atol + rtol * |b|``
(``numpy.isclose``'s rule); otherwise :class:`~nnx_es.errors.ExportMismatchError` names the largest
absolute and relative differences and nothing is written. Only then is the file copied to ``out``
(:mod:`nnx_es.artifacts`: never into another run, never through a link inside its own) and, for a run's
checkpoint (:func:`export_checkpoint`), a ``model_exported`` event appended after the run's
``run_finalized`` as ``evaluation_recorded`` is (:func:`nnx_es.evaluation.record_after_run`), with the
format, the artifact's SHA-256, the source checkpoint, the tolerances and the differences measured.
``tools/replay`` checks that digest while the file is there.

The exported net is the model in eval mode with masked pruning written into its weights
(``torch.nn.utils.prune.remove`` on a copy: the artifact holds plain ``weight`` tensors); adapters and
heads stay as they are. A dynamically quantized net is refused: neither exporter traces ``torch.ao``
quantized layers in torch 2.13, and safetensors holds no packed int8 weights.

The ONNX exporter is torch's ``dynamo=True`` one (it needs ``onnxscript``), its weights inside the one
file (``external_data=False``: ONNX's 2 GB limit applies); the batch dimension is dynamic in ONNX and ``torch-export`` artifacts (input named ``input``, output ``output``).
Optional dependencies: ``pip install 'nnx_es[export]'`` (onnx, onnxruntime, onnxscript, safetensors).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch
from torch import Tensor, nn

from events.schema import ModelExported
from nnx_es.artifacts import Destination, destination, write_artifact
from nnx_es.errors import ConfigError, ExportMismatchError
from nnx_es.transforms.core import clone, recorded

__all__ = ["FORMATS", "TOLERANCES", "WRITERS", "ExportReport", "export_checkpoint", "export_net", "inference_form",
           "validation_sample"]

#: the formats an export writes
FORMATS = ("onnx", "torch-export", "safetensors")
#: the default (atol, rtol) per format: float32 kernels of another runtime differ in the last bits
TOLERANCES = {"onnx": (1e-4, 1e-4), "torch-export": (1e-5, 1e-5), "safetensors": (0.0, 0.0)}
#: the package each format needs, and its extra
_NEEDS = {"onnx": ("onnx", "onnxruntime", "onnxscript"), "torch-export": (), "safetensors": ("safetensors",)}


class ExportReport(msgspec.Struct, frozen=True, kw_only=True):
    """A verified export: what was written where, and how closely it computes the net.

    format / path (absolute) / sha256 (hex) / size_bytes. rows: rows of the sample batch; sample: where
    they came from (``"validation"`` or ``"given"``). atol / rtol: the tolerances; max_abs_diff /
    max_rel_diff: the largest differences measured. export_s / verify_s: wall seconds to write and to
    run the artifact. recorded_seq: the ``model_exported`` event's seq in the run (None: not recorded).
    """

    format: str
    path: str
    sha256: str
    size_bytes: int
    rows: int
    sample: str
    atol: float
    rtol: float
    max_abs_diff: float
    max_rel_diff: float
    export_s: float
    verify_s: float
    recorded_seq: int | None = None


def _require(fmt: str) -> None:
    missing = [m for m in _NEEDS[fmt] if not _importable(m)]
    if missing:
        raise ConfigError(f"--format {fmt} needs {', '.join(missing)}: pip install 'nnx_es[export]'")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def inference_form(net: nn.Module) -> nn.Module:
    """A copy of ``net`` in eval mode with masked pruning written into its weights (what is exported).

    Raises:
        ConfigError: ``net`` holds dynamically quantized layers (named).
    """
    from torch.nn.utils import prune

    quantized = [p for p, m in net.named_modules() if type(m).__module__.startswith("torch.ao.nn.quantized")]
    if quantized:
        raise ConfigError(f"layers {quantized[:6]} are dynamically quantized (Quantize): torch.export and the ONNX "
                          "exporter cannot trace torch.ao quantized layers and safetensors holds no packed int8 "
                          "weights; export the float net (load it without the Quantize transform)")
    form = clone(net).eval()
    for module in form.modules():
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                prune.remove(module, hook._tensor_name)
    return form


@contextlib.contextmanager
def _quiet() -> Any:
    """Torch's exporters print progress and warnings (to stdout, the logs and ``warnings``): kept out of the way."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def _dynamic_batch() -> tuple[dict[int, Any]]:
    return ({0: torch.export.Dim("batch")},)


def _write_onnx(form: nn.Module, sample: Tensor, path: Path) -> None:
    with _quiet():
        torch.onnx.export(form, (sample,), str(path), dynamo=True, input_names=["input"], output_names=["output"],
                          dynamic_shapes=_dynamic_batch(), external_data=False, verbose=False)


def _run_onnx(path: Path, form: nn.Module, sample: Tensor) -> Tensor:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return torch.from_numpy(session.run(None, {name: sample.cpu().numpy()})[0])


def _write_torch_export(form: nn.Module, sample: Tensor, path: Path) -> None:
    with _quiet():
        program = torch.export.export(form, (sample,), dynamic_shapes=_dynamic_batch())
        torch.export.save(program, str(path))


def _run_torch_export(path: Path, form: nn.Module, sample: Tensor) -> Tensor:
    with _quiet():
        program = torch.export.load(str(path))
    with torch.no_grad():
        return program.module()(sample)  # type: ignore[no-any-return]


def _write_safetensors(form: nn.Module, sample: Tensor, path: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in form.state_dict().items()}
    # one metadata key: safetensors 0.8 writes several in a varying order (a Rust HashMap), so the same
    # weights gave files of different SHA-256s; with one, the file is a function of the weights
    save_file(state, str(path), metadata={"format": "pt"})


def _run_safetensors(path: Path, form: nn.Module, sample: Tensor) -> Tensor:
    from safetensors.torch import load_file

    fresh = clone(form)
    with torch.no_grad():
        for t in fresh.state_dict().values():
            if t.is_floating_point():
                t.fill_(float("nan"))  # every value the file does not restore shows in the outputs
    fresh.load_state_dict(load_file(str(path)), strict=True)
    with torch.no_grad():
        return fresh(sample)  # type: ignore[no-any-return]


#: format -> (write the artifact to a path, run the artifact at a path on a batch)
WRITERS: dict[str, tuple[Callable[[nn.Module, Tensor, Path], None], Callable[[Path, nn.Module, Tensor], Tensor]]] = {
    "onnx": (_write_onnx, _run_onnx),
    "torch-export": (_write_torch_export, _run_torch_export),
    "safetensors": (_write_safetensors, _run_safetensors),
}


def _differences(found: Tensor, want: Tensor, atol: float, rtol: float) -> tuple[float, float, bool]:
    a, b = found.detach().double().cpu(), want.detach().double().cpu()
    if a.shape != b.shape:
        return float("inf"), float("inf"), False
    diff = (a - b).abs()
    rel = diff / b.abs().clamp_min(torch.finfo(torch.float64).tiny)
    ok = bool(torch.all(diff <= atol + rtol * b.abs()).item()) and bool(torch.isfinite(a).all().item()) == bool(
        torch.isfinite(b).all().item())
    return float(diff.max().item()) if diff.numel() else 0.0, float(rel.max().item()) if rel.numel() else 0.0, ok


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def export_net(net: nn.Module, sample: Tensor, fmt: str, out: str | os.PathLike[str], *,
               atol: float | None = None, rtol: float | None = None, run_dir: str | os.PathLike[str] | None = None,
               sample_source: str = "given") -> tuple[ExportReport, Destination]:
    """Export ``net`` as ``fmt`` to ``out`` once the artifact, run on ``sample`` (``(N, *features)``, float),
    agrees with ``net`` within ``atol`` / ``rtol`` (default: :data:`TOLERANCES`). ``run_dir``: the run the
    net comes from (an ``out`` inside it is written there safely; inside another run, refused).

    Raises:
        ConfigError: an unknown format, a missing optional package, a bad ``out`` or tolerance, an empty
            sample, a quantized net, or the exporter refusing the net (its error named).
        ExportMismatchError: the artifact computes something else (the differences named); nothing written.
        UnsafePathError: ``out`` inside the run goes through a symbolic link.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    default_atol, default_rtol = TOLERANCES[fmt]
    atol = default_atol if atol is None else float(atol)
    rtol = default_rtol if rtol is None else float(rtol)
    if not (atol >= 0 and rtol >= 0):
        raise ConfigError(f"tolerances must be >= 0, got atol={atol!r}, rtol={rtol!r}")
    if not isinstance(sample, Tensor) or sample.dim() < 1 or len(sample) == 0:
        raise ConfigError(f"the sample batch must be a tensor (N, *features) with N >= 1, got {sample!r:.80}")
    dest = destination(out, run_dir)
    _require(fmt)
    form = inference_form(net)
    sample = sample.float().cpu()
    if len(sample) == 1:  # a batch of one would specialize the exported batch dimension to 1
        sample = sample.repeat(2, *([1] * (sample.dim() - 1)))
    was = net.training
    net.eval()
    try:
        with torch.no_grad():
            want = net(sample)
    finally:
        net.train(was)
    write, run = WRITERS[fmt]
    with tempfile.TemporaryDirectory(prefix="nnx-es-export-") as tmp:
        artifact = Path(tmp) / "artifact"
        t0 = time.perf_counter()
        try:
            write(form, sample, artifact)
        except (ConfigError, ExportMismatchError):
            raise
        except Exception as exc:
            raise ConfigError(f"the {fmt} exporter refused the net: {type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:600]}") from None
        t1 = time.perf_counter()
        beside = sorted(p.name for p in Path(tmp).iterdir() if p != artifact)
        if beside:  # the artifact is one file: one that needs another (external weights) would not run where copied
            raise ConfigError(f"the {fmt} exporter wrote {beside} beside the artifact; it must be one file")
        found = run(artifact, form, sample)
        verify_s = time.perf_counter() - t1
        max_abs, max_rel, ok = _differences(found, want, atol, rtol)
        if not ok:
            raise ExportMismatchError(
                f"the {fmt} artifact does not compute what the model computes on the {len(sample)}-row sample: max "
                f"abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}, against atol={atol:g}, rtol={rtol:g} (an "
                f"output agrees when |a - b| <= atol + rtol * |b|); nothing was written to {str(dest.path)!r}")
        digest, size = _sha256(artifact), artifact.stat().st_size
        write_artifact(artifact, dest)
    report = ExportReport(format=fmt, path=str(dest.path), sha256=digest, size_bytes=size, rows=len(sample),
                          sample=sample_source, atol=atol, rtol=rtol, max_abs_diff=max_abs, max_rel_diff=max_rel,
                          export_s=t1 - t0, verify_s=verify_s)
    return report, dest


def validation_sample(run_dir: str | os.PathLike[str], rows: int, allowed: Any = None) -> Tensor | None:
    """The inputs of the first ``rows`` rows of the run's validation data, rebuilt from the data recipe of the
    spec it recorded (verified against its hash and built by type: :mod:`nnx_es.recipes`); None when the run
    recorded no spec, no data recipe, or its data has no validation split.

    Raises:
        RecipeError: the recorded spec does not verify, or its data recipe is refused.
    """
    from nnx_es.cli.train import BadInput, stored_spec
    from nnx_es.evaluation import input_of
    from nnx_es.recipes import from_spec
    from nnx_es.recipes.runspec import validate_spec

    try:
        spec = stored_spec(Path(run_dir))
    except BadInput:
        return None
    if spec is None or spec.data is None:
        return None
    from nnx_es.recipes import Allowed

    allowed = allowed or Allowed()
    validate_spec(spec, allowed)
    loaders = from_spec(spec.data, allowed=allowed, slot="data")
    val = loaders[1] if isinstance(loaders, (tuple, list)) and len(loaders) == 2 else None
    if val is None:
        return None
    parts, got = [], 0
    for batch in val:
        x = input_of(batch)
        parts.append(x)
        got += len(x)
        if got >= rows:
            break
    return torch.cat(parts)[:rows] if parts else None


def export_checkpoint(net: nn.Module, *, run_dir: str | os.PathLike[str], checkpoint: str, manifest: str, epoch: int,
                      fmt: str, out: str | os.PathLike[str], sample: Tensor | None = None, rows: int = 64,
                      atol: float | None = None, rtol: float | None = None, record: bool = True,
                      allowed: Any = None) -> ExportReport:
    """Export ``net`` (holding the weights of ``run_dir``'s checkpoint ``checkpoint`` / ``manifest`` / ``epoch``)
    and, with ``record``, append ``model_exported`` to the run (:func:`export_net`, then
    :func:`nnx_es.evaluation.record_after_run`). ``sample``: the batch to verify on (default: the first
    ``rows`` rows of the run's validation data, rebuilt from its recipe).

    Raises:
        ConfigError: no sample given and none can be rebuilt (say ``sample=`` / ``--sample FILE``), or see
            :func:`export_net`.
        ExportMismatchError: see :func:`export_net`.
        ResumeError / LeaseHeldError: recording into a run that is not finalized / being written (checked
            before anything is exported; the run's lease is held until the record is appended).
    """
    source = "given"
    if sample is None:
        sample = validation_sample(run_dir, rows, allowed)
        source = "validation"
        if sample is None:
            raise ConfigError(f"run {Path(run_dir).name!r} recorded no data recipe with a validation split to "
                              "take a sample batch from: give one (sample= a tensor, --sample FILE.npy)")
    if not record:
        return export_net(net, sample, fmt, out, atol=atol, rtol=rtol, run_dir=run_dir, sample_source=source)[0]
    from nnx_es.evaluation import finalized_log

    with finalized_log(run_dir, f"an export to {str(out)!r}") as log:  # checked, and held, before anything is written
        report, _ = export_net(net, sample, fmt, out, atol=atol, rtol=rtol, run_dir=run_dir, sample_source=source)
        seq = log.append(ModelExported(
            format=report.format, path=report.path, sha256=report.sha256, size_bytes=report.size_bytes,
            checkpoint=str(checkpoint), manifest=manifest, epoch=epoch, transforms=recorded(net), rows=report.rows,
            sample=report.sample, atol=report.atol, rtol=report.rtol, max_abs_diff=report.max_abs_diff,
            max_rel_diff=report.max_rel_diff, wall_time_s=time.time()))
        log.flush(sync=True)
    return msgspec.structs.replace(report, recorded_seq=seq)

