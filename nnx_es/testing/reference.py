"""The uninterrupted reference run, and the checks of an interrupted run against it.

Everything here reads run directories (the log, the blobs): the in-process harness and
``nnx-es crashtest`` (a script in subprocesses) check runs the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from events.log import LmdbLog
from events.schema import Event, LastCommitted
from nnx_es.audit import audit_run
from nnx_es.checkpoint import load_component, read_manifest, verify_checkpoint
from nnx_es.storage import BlobStore
from projections import Projections, project

__all__ = ["Finding", "Reference", "first_divergence", "temporaries"]

_TIME_FIELDS = frozenset({"wall_time_s", "duration_s"})
_FINAL = ("last", "best", "phases", "callbacks")


class Finding(Exception):
    """A promise that does not hold: ``check``, ``expected``, ``found``, ``divergence``."""

    def __init__(self, check: str, expected: str, found: str, divergence: str | None = None) -> None:
        super().__init__(f"{check}: expected {expected}, found {found}")
        self.check, self.expected, self.found, self.divergence = check, expected, found, divergence


def _untimed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: (0.0 if k in _TIME_FIELDS else _untimed(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def read_log(run_dir: Path) -> list[tuple[int, Event]]:
    with LmdbLog(Path(run_dir) / "events.lmdb", readonly=True) as log:
        return list(log.read())


def _at_last(p: Projections) -> dict[str, Any]:
    """The committed view as of its LAST: history, LAST pointer, counters, schedulers."""
    return {
        "history": [msgspec.structs.replace(r, wall_time_s=0.0) for r in p.history.records],
        "last": p.checkpoints.last,
        "counters": p.counters,
        "schedulers": p.schedulers,
    }


def temporaries(run_dir: Path) -> list[str]:
    """Owned temporaries (``.<name>.<pid>.<rand>.tmp``) left under ``run_dir``."""
    return sorted(str(p.relative_to(run_dir)) for p in Path(run_dir).rglob(".*.tmp"))


def _audit(run_dir: Path, when: str) -> None:
    report = audit_run(Path(run_dir))
    if not report.ok:
        raise Finding(f"the audit holds {when}", "no violation",
                      "; ".join(v.line() for v in report.violations[:5]))


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Reference:
    """The uninterrupted run: its log, the committed view after each LAST, its final state."""

    run_dir: Path
    events: list[tuple[int, Event]]
    status: str

    def __post_init__(self) -> None:
        self.untimed = [_untimed(msgspec.to_builtins(e)) for _, e in self.events]
        last_seqs = [s for s, e in self.events if isinstance(e, LastCommitted)]
        self.at_last = [_at_last(project(self.events[: s + 1])) for s in last_seqs]
        self.last_manifests = [e.manifest for _, e in self.events if isinstance(e, LastCommitted)]
        final = project(self.events)
        self.history = _at_last(final)["history"]
        self.final = {f: getattr(final.checkpoints, f) for f in _FINAL}
        self.receipts = {e.step: e for _, e in self.events if e.KIND == "update_committed"}

    @classmethod
    def of(cls, run_dir: Path) -> Reference:
        events = read_log(run_dir)
        _audit(run_dir, "on the reference run")
        return cls(Path(run_dir), events, project(events).status.status)

    def describe_event(self, n: int) -> str:
        if n >= len(self.events):
            return f"after the last event (seq {len(self.events) - 1})"
        e = self.events[n][1]
        where = f" (epoch {e.epoch}, step {e.step})" if e.KIND == "update_committed" else ""
        return f"before event seq {n} ({e.KIND}){where}"

    # --- checks --------------------------------------------------------------------------

    def check_prefix(self, run_dir: Path) -> list[tuple[int, Event]]:
        """The interrupted run's log is an exact prefix of the reference's (wall-clock fields aside)."""
        events = read_log(run_dir)
        for (seq, e), want in zip(events, self.untimed):
            got = _untimed(msgspec.to_builtins(e))
            if got != want:
                raise Finding("the interrupted run wrote a prefix of the reference log (the run is reproducible)",
                              f"seq {seq}: {_short(want)}", f"seq {seq}: {_short(got)}")
        if len(events) > len(self.events):
            raise Finding("the interrupted run wrote a prefix of the reference log",
                          f"{len(self.events)} events at most", f"{len(events)} events")
        return events

    def check_committed(self, run_dir: Path, events: list[tuple[int, Event]] | None = None) -> int:
        """The committed view is the reference's at the same LAST, LAST is the reference's
        complete, verified checkpoint, and the audit holds; return the number of LAST commits."""
        events = read_log(run_dir) if events is None else events
        _audit(run_dir, "after the interruption")
        p = project(events)
        k = p.checkpoints.commits
        if k == 0:
            return 0
        if k > len(self.at_last):
            raise Finding("no more LAST commits than the reference", str(len(self.at_last)), str(k))
        got, want = _at_last(p), self.at_last[k - 1]
        for name in want:
            if got[name] != want[name]:
                raise Finding(f"the committed {name} is the reference's at LAST #{k}",
                              _short(want[name]), _short(got[name]))
        manifest = p.checkpoints.last.manifest if p.checkpoints.last else None
        if manifest != self.last_manifests[k - 1]:
            raise Finding(f"LAST is the reference's checkpoint #{k}", str(self.last_manifests[k - 1]), str(manifest))
        try:
            verify_checkpoint(BlobStore(Path(run_dir) / "blobs"), manifest, run_id=p.status.run_id or None)
        except Exception as exc:  # noqa: BLE001 - named in the finding
            raise Finding("LAST is a complete checkpoint (every blob verifies)", "verified",
                          f"{type(exc).__name__}: {exc}") from None
        return k

    def check_no_temporaries(self, run_dir: Path, when: str) -> None:
        left = temporaries(run_dir)
        if left:
            raise Finding(f"no temporary file is left {when}", "none", ", ".join(left[:5]))

    def check_resumed(self, run_dir: Path, status: str) -> None:
        """The resumed run ends as the reference does: status, history, LAST/BEST/phases/callback
        checkpoints (so model, optimizers, schedulers, RNG streams, counters, callback state)."""
        events = read_log(run_dir)
        p = project(events)
        history = _at_last(p)["history"]
        divergence = None
        final = {f: getattr(p.checkpoints, f) for f in _FINAL}
        if history != self.history or final != self.final:
            divergence = first_divergence(self, run_dir, events)
        if history != self.history:
            i = next((i for i, (a, b) in enumerate(zip(self.history, history)) if a != b),
                     min(len(history), len(self.history)))
            want = self.history[i] if i < len(self.history) else "no record"
            got = history[i] if i < len(history) else "no record"
            raise Finding("the resumed run's history is the reference's", f"epoch {i}: {_short(want)}",
                          f"epoch {i}: {_short(got)}", divergence)
        for f in _FINAL:
            if final[f] != self.final[f]:
                raise Finding(f"the resumed run's final {f.upper() if f in ('last', 'best') else f} is the "
                              "reference's (bitwise the same state)", _short(self.final[f]), _short(final[f]),
                              divergence)
        if status != self.status:
            raise Finding("the resumed run ends as the reference did", self.status, status)
        self.check_no_temporaries(run_dir, "after the resume")
        _audit(run_dir, "after the resume")


# --- the first divergence ------------------------------------------------------------------


def first_divergence(ref: Reference, run_dir: Path, events: list[tuple[int, Event]]) -> str | None:
    """The first step receipt of the resumed part that differs from the reference's, then the first
    difference of each component of the final LAST checkpoint that differs (``final LAST
    checkpoint: <first>``, ``also differs: <next>`` -- up to four more): in a component, a plain
    value (``optimizer/adam['param_groups'][0]['lr']``, a callback's field) before any tensor."""
    lines = []
    resumed_at = max((s for s, e in events if e.KIND == "run_resumed"), default=-1)
    for seq, e in events:
        if seq <= resumed_at or e.KIND != "update_committed":
            continue
        want = ref.receipts.get(e.step)
        got_b, want_b = _untimed(msgspec.to_builtins(e)), _untimed(msgspec.to_builtins(want)) if want else None
        if got_b != want_b:
            fields = [k for k in got_b if want_b is None or got_b.get(k) != want_b.get(k)]
            detail = ", ".join(f"{k} {want_b.get(k) if want_b else None!r} -> {got_b[k]!r}" for k in fields[:4])
            lines.append(f"step {e.step} (epoch {e.epoch}), the first update after the resume that differs: {detail}")
            break
    last = project(events).checkpoints.last
    if last is not None and ref.final["last"] is not None and last.manifest != ref.final["last"].manifest:
        diffs = _component_diffs(ref.run_dir, ref.final["last"].manifest, Path(run_dir), last.manifest)
        if diffs:
            lines.append(f"final LAST checkpoint: {diffs[0]}")
            lines += [f"also differs: {d}" for d in diffs[1:5]]
    return "\n".join(lines) or None


def _component_diffs(ref_dir: Path, ref_digest: str, run_dir: Path, digest: str) -> list[str]:
    """The first difference of each checkpoint component that differs, in the manifest's order
    (a manifest field first, when one differs)."""
    a_store, b_store = BlobStore(ref_dir / "blobs"), BlobStore(run_dir / "blobs")
    a, b = read_manifest(a_store, ref_digest), read_manifest(b_store, digest)
    for field in ("epoch", "step", "counters"):
        if getattr(a, field) != getattr(b, field):
            return [f"manifest {field}: expected {getattr(a, field)!r}, found {getattr(b, field)!r}"]
    out = []
    for name in list(a.components) + [n for n in b.components if n not in a.components]:
        if name not in a.components or name not in b.components:
            out.append(f"component {name!r} is {'missing' if name in a.components else 'not in the reference'}")
            continue
        if a.components[name].blob == b.components[name].blob:
            continue
        state_a, state_b = load_component(a_store, a, name), load_component(b_store, b, name)
        # a plain value (a learning rate, a counter, a callback's field) before any tensor: it is
        # nearer the cause than the tensors trained from it
        diff = _diff(state_a, state_b, name, tensors=False) or _diff(state_a, state_b, name, tensors=True)
        out.append(diff or f"component {name!r}: different bytes (blob {a.components[name].blob[:12]} -> "
                           f"{b.components[name].blob[:12]})")
    return out


def _diff(a: Any, b: Any, path: str, tensors: bool = True) -> str | None:
    """Where nested state ``a`` and ``b`` first differ (``path``: how the value was reached);
    ``tensors=False`` compares everything but two tensors."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not tensors:
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: expected {_short(a, 80)}, found {_short(b, 80)}"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{path}: expected {tuple(a.shape)} {a.dtype}, found {tuple(b.shape)} {b.dtype}"
        if torch.equal(a, b):
            return None
        if a.dtype.is_floating_point or a.dtype.is_complex:
            delta = (a.double() - b.double()).abs()
            where = tuple(int(i) for i in torch.nonzero(delta.nan_to_num(nan=1.0))[0]) if a.dim() else ()
            return f"{path} (tensor {tuple(a.shape)} {a.dtype}): max |difference| {float(delta.max()):.3g}, first at index {where}"
        return f"{path} (tensor {tuple(a.shape)} {a.dtype}) differs"
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}[{k!r}] is {'missing' if k in a else 'not in the reference'}"
            d = _diff(a[k], b[k], f"{path}[{k!r}]", tensors)
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: expected {len(a)} items, found {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _diff(x, y, f"{path}[{i}]", tensors)
            if d:
                return d
        return None
    if a != b:
        return f"{path}: expected {_short(a, 120)}, found {_short(b, 120)}"
    return None
