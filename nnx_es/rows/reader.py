"""Reading a run's committed per-row records: :func:`read_rows`."""

from __future__ import annotations

from pathlib import Path

from events.schema import JournalPublished, LastCommitted, RowsRecorded
from nnx_es.rows.columns import EpochRows, Part, RowView
from nnx_es.rows.journal import manifest_parts
from nnx_es.storage import BlobStore

__all__ = ["read_rows"]


def read_rows(run_dir: str | Path) -> RowView:
    """A run's committed per-row records (see :class:`~nnx_es.rows.columns.RowView` for rows and columns).

    Only what the run's LASTs commit is shown (the committed view,
    :func:`projections.view.committed`): records up to LAST's epoch; an uncommitted tail -- a
    crash after the records or the journal's manifest but before LAST, or a failed LAST -- is
    ignored, and so is a range a resume discarded. A journal's chunks are read when a view's
    ``columns``/``rows``/``row`` asks for them, each verified against its SHA-256.

    Args:
        run_dir: ``runs/<id>``.

    Raises:
        NotARunError: ``run_dir`` holds no event log.
        CorruptCheckpointError: a committed journal manifest is missing or does not verify.
    """
    from nnx_es.audit.reading import decoded, open_run_log
    from projections import committed

    run_dir = Path(run_dir)
    log = open_run_log(run_dir)
    recorded: list[RowsRecorded] = []
    published: list[JournalPublished] = []
    last_epoch = -1
    try:
        for _, event in committed(decoded(log)):
            t = type(event)
            if t is RowsRecorded:
                recorded.append(event)  # type: ignore[arg-type]
            elif t is JournalPublished:
                published.append(event)  # type: ignore[arg-type]
            elif t is LastCommitted:
                last_epoch = max(last_epoch, event.epoch)  # type: ignore[attr-defined]
    finally:
        log.close()
    parts: list[EpochRows | Part] = [EpochRows.decode(e.epoch, e.split, e.rows, e.columns)
                                     for e in recorded if e.epoch <= last_epoch]
    store = BlobStore(run_dir / "blobs")
    for e in published:
        if e.epoch <= last_epoch:
            parts.extend(manifest_parts(store, e.manifest))
    return RowView(parts)
