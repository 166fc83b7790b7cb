"""Draws the site's pictures at build time, from a real run trained here (mkdocs-gen-files).

One small run -- an MLP on 600 of scikit-learn's digits, with row ids, 6 epochs of 4 updates,
about 2 s on one thread -- gives all three:

* ``assets/generated/timeline.png``: the run's events, one lane per kind, against their seq;
* ``assets/generated/commit-group.png``: one epoch's close, its commit group and what its LAST covers;
* ``assets/generated/cartography.png``: the data map of the run's per-row records
  (``nnx_es.cli.rows.plot_cartography``, what ``nnx-inspect RUN plot cartography`` draws).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import mkdocs_gen_files  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from events import LmdbLog  # noqa: E402
from events.codec import KINDS  # noqa: E402
from nnx_es import Trainer, with_row_ids  # noqa: E402
from nnx_es.cli.rows import plot_cartography  # noqa: E402
from projections.commits import GroupTracker, commits  # noqa: E402

OUT = "assets/generated"
EPOCH_SHOWN = 2  # the epoch whose close the commit-group picture shows


def train(runs: Path) -> Path:
    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x[:800] / 16, dtype=torch.float32)
    y = torch.tensor(y[:800])
    train = DataLoader(with_row_ids(TensorDataset(x[:600], y[:600])), batch_size=150, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    val = DataLoader(TensorDataset(x[600:], y[600:]), batch_size=200)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    run = Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", runs_root=runs, run_id="pictures",
                  seed=0, progress=False).fit(train, val, epochs=6)
    return Path(run.run_dir)


def timeline(events: list[tuple[int, object]], out: Path) -> None:
    kinds = [k for k in KINDS if any(e.KIND == k for _, e in events)]  # the schema's order
    lane = {k: i for i, k in enumerate(reversed(kinds))}
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(kinds) + 1.4), constrained_layout=True)
    began = [s for s, e in events if e.KIND == "epoch_began"]
    for i, start in enumerate(began):
        end = began[i + 1] if i + 1 < len(began) else events[-1][0] + 1
        if i % 2 == 0:
            ax.axvspan(start - 0.5, end - 0.5, color="0.93", zorder=0)
        ax.text((start + end) / 2, len(kinds) - 0.3, f"epoch {i}", ha="center", fontsize=8, color="0.35")
    colours = plt.get_cmap("tab10")
    for seq, e in events:
        ax.plot(seq, lane[e.KIND], "|" if e.KIND in ("microbatch_done", "update_committed") else "o",
                ms=7, color=colours(lane[e.KIND] % 10))
        if e.KIND == "last_committed":
            ax.axvline(seq, color="tab:red", lw=0.6, alpha=0.5, zorder=0)
    ax.set_yticks(range(len(kinds)), list(reversed(kinds)), fontsize=8)
    ax.set_ylim(-0.7, len(kinds) + 0.2)
    ax.set_xlabel("seq (the event's position in the log)")
    ax.set_title("a run's events: 6 epochs of 4 updates; red lines: each LAST commit", fontsize=10)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _detail(e) -> str:
    match e.KIND:
        case "last_committed":
            return f"epoch={e.epoch} covers={e.covers}"
        case "best_committed" | "epoch_summarized" | "validation_done":
            return f"epoch={e.epoch}"
        case "history_appended":
            return f"epoch={e.record.epoch}"
        case "monitor_decided":
            return f"improved={e.improved}"
        case "checkpoint_pruned":
            return f"epoch={e.epoch} ({e.reason})"
        case "update_committed":
            return f"step={e.step}"
    return ""


def commit_group(events: list[tuple[int, object]], out: Path) -> None:
    begin = next(s for s, e in events if e.KIND == "epoch_summarized" and e.epoch == EPOCH_SHOWN)
    start = max(s for s, e in events if s < begin and e.KIND in ("update_committed", "update_skipped"))
    after = next((s for s, e in events if s > begin and e.KIND == "epoch_began"), events[-1][0] + 1)
    shown = [(s, e) for s, e in events if start <= s < after]
    at = next(i for i, (_, e) in enumerate(shown) if e.KIND == "last_committed")
    covers = shown[at][1].covers
    tracker = GroupTracker()
    group = [i for i, (_, e) in enumerate(shown) if tracker.see(e.KIND)]  # LAST and its commit group
    pending = [i for i, (s, e) in enumerate(shown) if 0 < i < at and commits(covers, s, e.KIND)]
    n = len(shown)
    fig, ax = plt.subplots(figsize=(9.5, 0.42 * n + 1.4), constrained_layout=True)
    for i, (seq, e) in enumerate(shown):
        y = n - 1 - i
        colour = "#f4b6b6" if i == at else "#fde2c6" if i in group else "#cfe3f7" if i in pending else "0.92"
        ax.add_patch(plt.Rectangle((0, y - 0.4), 5.2, 0.8, color=colour))
        ax.text(0.15, y, f"{seq:>4}  {e.KIND}", va="center", family="monospace", fontsize=9)
        ax.text(3.3, y, _detail(e), va="center", family="monospace", fontsize=8, color="0.3")

    def bracket(rows: list[int], text: str) -> None:
        top, bottom = n - 1 - min(rows) + 0.4, n - 1 - max(rows) - 0.4
        ax.plot([5.35, 5.5, 5.5, 5.35], [top, top, bottom, bottom], color="0.2", lw=1)
        ax.text(5.65, (top + bottom) / 2, text, va="center", fontsize=9)

    bracket(pending, f"the epoch's close: in the log, pending\nuntil a LAST commits it (seq <= covers={covers},\n"
                     "and the checkpoint it stored)")
    bracket(group, "the commit group: LAST (the marker)\nand what follows it, written with it")
    ax.text(0, -1.0, f"One synced write makes seq {shown[min(pending)][0]}-{shown[max(group)][0]} durable together; a crash "
            "before it leaves them an uncommitted tail that every reader ignores.", fontsize=9)
    ax.set_xlim(0, 9.5)
    ax.set_ylim(-1.4, n - 0.4)
    ax.axis("off")
    ax.set_title(f"the close of epoch {EPOCH_SHOWN} in a real run's log", fontsize=10)
    fig.savefig(out, dpi=110)
    plt.close(fig)


with tempfile.TemporaryDirectory(prefix="nnx-docs-pictures-") as tmp:
    run_dir = train(Path(tmp) / "runs")
    log = LmdbLog(run_dir / "events.lmdb", readonly=True)
    try:
        events = list(log.read())
    finally:
        log.close()
    for name, draw in (("timeline.png", lambda p: timeline(events, p)),
                       ("commit-group.png", lambda p: commit_group(events, p)),
                       ("cartography.png", lambda p: plot_cartography(run_dir, p))):
        path = Path(tmp) / name
        draw(path)
        with mkdocs_gen_files.open(f"{OUT}/{name}", "wb") as f:
            f.write(path.read_bytes())
