"""The README: short, the two commands first, its links live, its picture a real run's events."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from snippets import REPO

README = REPO / "README.md"


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    assert lines[:4] == [
        "# nnx_es",
        "",
        "    make demo    # set-up + train an MLP on scikit-learn's digits, then audit the run with tools/replay",
        "    make test    # set-up + the whole test suite",
    ]


def test_every_relative_link_of_the_readme_names_a_file_that_exists() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) > 15
    for link in local:
        assert (REPO / link).is_file(), link


def test_the_readmes_picture_is_the_event_sequence_of_a_run_of_its_shape(tmp_path: Path) -> None:
    """The picture lists seq and kind for a run of 2 epochs, 3 updates each, validated, with NNModel's
    defaults; a run of that shape, trained here, has that kind at each seq shown."""
    from events import LmdbLog
    from nnx_es import NNModel

    text = README.read_text()
    picture = text[text.index("```text\nseq  kind"):]
    picture = picture[:picture.index("\n```\n")]
    shown = [(int(m[1]), m[2]) for m in re.finditer(r"^ *(\d+)  ([a-z_]+)", picture, re.M)]
    assert len(shown) > 15
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 8, generator=g)
    y = (x[:, 0] > 0).long()
    run = NNModel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))).train(
        DataLoader(TensorDataset(x[:96], y[:96]), batch_size=32), DataLoader(TensorDataset(x[96:], y[96:]), batch_size=64),
        epochs=2, runs_root=tmp_path, run_id="shape", seed=0, progress=False)
    log = LmdbLog(Path(run.run_dir) / "events.lmdb", readonly=True)
    try:
        kinds = {seq: event.KIND for seq, event in log.read()}
    finally:
        log.close()
    assert shown == [(seq, kinds[seq]) for seq, _ in shown]
    assert shown[-1] == (max(kinds), "run_finalized")
