"""``inspect RUN rows`` and ``inspect RUN plot cartography``: a run's per-row records for people.

``rows`` lists every training row's dynamics across the committed epochs (mean confidence in the
true label, its variability, the fraction of epochs correct: :mod:`nnx_es.rows.dynamics`), the
hardest first (lowest confidence); ``--hardest N`` keeps N of them, ``--json`` prints one object
per row. ``plot cartography --out FILE`` draws the data map: variability (x) against confidence
(y), coloured by correctness, as in Swayamdipta et al. (2020), Figure 1.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

__all__ = ["plot_cartography", "rows_command"]


def _map(run_dir: Path):  # noqa: ANN202 - a Cartography (imports numpy lazily)
    from nnx_es.rows.dynamics import cartography
    from nnx_es.rows.reader import read_rows

    return cartography(read_rows(run_dir))


def rows_command(run_dir: Path, hardest: int | None, as_json: bool) -> int:
    """Print the rows' training dynamics, hardest first; return the exit status (0; 2 without records)."""
    state = _map(run_dir)
    if not state.row_id.size:
        print(f"inspect: {run_dir} has no committed per-row training records (its batches carried no row ids: "
              "see nnx_es.rows.with_row_ids)", file=sys.stderr)
        return 2
    order = state.hardest(state.row_id.size if hardest is None else hardest)
    c = state.columns()
    out = sys.stdout
    if as_json:
        for i in order:
            out.write(json.dumps({"row_id": int(c["row_id"][i]), "epochs": int(c["epochs"][i]),
                                  "confidence": float(c["confidence"][i]), "variability": float(c["variability"][i]),
                                  "correctness": float(c["correctness"][i])}) + "\n")
        return 0
    out.write(f"{'row_id':>10} {'epochs':>6} {'confidence':>10} {'variability':>11} {'correct':>7}\n")
    for i in order:
        out.write(f"{int(c['row_id'][i]):>10} {int(c['epochs'][i]):>6} {c['confidence'][i]:>10.4f} "
                  f"{c['variability'][i]:>11.4f} {c['correctness'][i]:>7.2f}\n")
    return 0


def plot_cartography(run_dir: str | Path, out: str | Path) -> Path:
    """Write the data map of a run's committed training records to ``out`` (matplotlib, headless).

    Raises:
        MissingDirectoryError: ``out``'s directory does not exist.
        ValueError: the run has no per-row training records, or no classifier's.
        ImportError: matplotlib is not installed (``pip install nnx_es[plots]``).
    """
    from nnx_es.errors import MissingDirectoryError
    from nnx_es.plotting import missing_parent

    out = Path(out)
    if why := missing_parent(out):
        raise MissingDirectoryError(why)
    state = _map(Path(run_dir))
    if not state.row_id.size:
        raise ValueError(f"{run_dir} has no committed per-row training records (its batches carried no row ids)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6), constrained_layout=True)
    points = ax.scatter(state.variability, state.confidence, c=state.correctness, cmap="coolwarm_r", vmin=0, vmax=1,
                        s=max(2.0, 30 / math.sqrt(max(1.0, state.row_id.size / 100))), alpha=0.7)
    fig.colorbar(points, ax=ax, label="correctness (fraction of epochs correct)")
    ax.set(xlabel="variability (std of the true label's probability)", ylabel="confidence (mean probability of the "
           "true label)", title=f"data map of {Path(run_dir).name}: {state.row_id.size} rows, "
           f"{int(state.epochs.max())} epochs", ylim=(-0.02, 1.02))
    fig.savefig(out)
    plt.close(fig)
    return out
