"""The corrupt-input tests' trained template run and their refusal checks (``test_flipped_bytes.py``,
``test_corrupt_inputs.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from crashkit import raw_values
from events.codec import decode
from nnx_es import Trainer
from trainkit import EpochCounter, loaders, small_net

__all__ = ["assert_refused_untouched", "Count", "data_file", "EPOCHS", "fit", "make_trainer", "resume_run", "RUN_ID", "seq_of", "template"]

torch.set_num_threads(1)

EPOCHS = 2
RUN_ID = "r"


Count = EpochCounter


def make_trainer(runs: Path, run_id: str | None) -> Trainer:
    net = small_net(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    return Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", schedulers=[plateau], callbacks=[Count()],
                   accumulation=2, runs_root=runs, run_id=run_id, seed=0, progress=False)


def fit(trainer: Trainer, **kw: Any):
    return trainer.fit(*loaders(batch_size=8, n_train=32), epochs=EPOCHS, **kw)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("template")
    fit(make_trainer(runs, RUN_ID))
    return runs / RUN_ID


def data_file(run_dir: Path) -> Path:
    return run_dir / "events.lmdb" / "data.mdb"


def resume_run(run_dir: Path):
    return fit(make_trainer(run_dir.parent, None), resume_from=run_dir)


def assert_refused_untouched(run_dir: Path, error: type[Exception], match: str) -> None:
    """A resume of ``run_dir`` raises ``error`` matching ``match`` and leaves data.mdb byte-identical."""
    before = data_file(run_dir).read_bytes()
    with pytest.raises(error, match=match):
        resume_run(run_dir)
    assert data_file(run_dir).read_bytes() == before, "a refused resume changed the log"


def seq_of(run_dir: Path, kind: str, occurrence: int = 0) -> int:
    return [s for s, raw in raw_values(run_dir) if decode(raw, s).KIND == kind][occurrence]
