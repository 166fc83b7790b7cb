"""A runs root for the web app's tests (JSON API and browser), built once per test process.

Runs under it:

* ``base``: a real Trainer run (3-class blobs, per-row records, a StepLR, monitor ``val_loss``), 6 epochs;
* ``other``: the same with another seed, 3 epochs (the diff's second run);
* ``fork``: a fork of ``base`` from its LAST (lineage), 2 epochs;
* ``resumed``: built event by event (:mod:`helpers_runs`): an epoch that crashed, a stateful resume that
  discards it, then a clean finish;
* ``broken``: the clean two-epoch log with one ``scheduler_stepped`` taken out (an audit violation);
* ``killed``: a log that stops mid-epoch, no process writing it (``running (no writer)``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers_runs import RunBuilder, clean_events, resumed_events, write_run
from nnx_es import Trainer, with_row_ids
from trainkit import blobs_data

__all__ = ["RUN_IDS", "build_root", "tree_state"]

RUN_IDS = ("base", "broken", "fork", "killed", "other", "resumed")
_BUILT: dict[str, Path] = {}


def _loaders() -> tuple[DataLoader, DataLoader]:
    x, y = blobs_data(120, 0)
    train = DataLoader(with_row_ids(TensorDataset(x[:96], y[:96])), batch_size=16, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    return train, DataLoader(TensorDataset(x[96:], y[96:]), batch_size=64)


def _trainer(root: Path, run_id: str, seed: int) -> Trainer:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=root, run_id=run_id, schedulers=[sched],
                   monitor="val_loss", progress=False)


def build_root(base: Path) -> Path:
    """The runs root described in the module docstring, under ``base`` (built once per process)."""
    if "root" in _BUILT:
        return _BUILT["root"]
    root = base / "runs"
    root.mkdir(parents=True)
    _trainer(root, "base", 0).fit(*_loaders(), epochs=6)
    _trainer(root, "other", 1).fit(*_loaders(), epochs=3)
    _trainer(root, "fork", 0).fit(*_loaders(), epochs=2, resume_from=root / "base", resume_mode="fork")
    write_run(root / "resumed", resumed_events(root / "resumed"))
    events, _ = clean_events(root / "broken")
    drop = next(i for i, e in enumerate(events) if e.KIND == "scheduler_stepped")
    write_run(root / "broken", events[:drop] + events[drop + 1:])
    k = RunBuilder(root / "killed")
    k.start()
    k.epoch(0, val_loss=0.8)
    k.crash_in_epoch(1)
    write_run(root / "killed", k.events, views=False)
    _BUILT["root"] = root
    return root


def tree_state(root: Path) -> dict[str, Any]:
    """Every entry under ``root``: its kind, and for a file its SHA-256, size and modification time
    (LMDB's ``lock.mdb`` included): what a read-only reader must leave as it was."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            rel = str(p.relative_to(root))
            if name in filenames:
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns)
            else:
                out[rel] = ("dir", st.st_mtime_ns)
    return out


def app_client(root: Path) -> Any:
    """A Starlette test client of the web app over ``root``, addressed as loopback (the Host check)."""
    from starlette.testclient import TestClient

    from nnx_es.web.app import create_app

    return TestClient(create_app(root), base_url="http://127.0.0.1")


def get_json(client: Any, path: str, status: int = 200) -> Any:
    """``GET path``: assert its status (naming the path and body), return its JSON."""
    r = client.get(path)
    assert r.status_code == status, (path, r.text)
    return r.json()
