"""Training dynamics on a real run: planted label noise shows up as the low-confidence rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import Trainer, read_rows, with_row_ids
from nnx_es.cli.inspect import main as inspect_main
from nnx_es.rows.dynamics import cartography
from trainkit import blobs_data, small_net

N, NOISY = 120, 12


@pytest.fixture(scope="module")
def noisy_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cartography")
    x, y = blobs_data(N, 0)
    centers = torch.tensor([[2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 2.0, 0]])
    clear = (x - centers[y]).norm(dim=1) < 0.6  # rows whose true class is unambiguous: a flipped label is noise
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    flipped = order[clear[order]][:NOISY]
    y = y.clone()
    y[flipped] = (y[flipped] + 1) % 3  # planted label noise: another class than the cluster's
    train = DataLoader(with_row_ids(TensorDataset(x, y)), batch_size=16, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    net = nn.Linear(4, 3)  # a linear model cannot memorise the flipped rows of separable clusters
    trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=0.05), nn.CrossEntropyLoss(), runs_root=root,
                      run_id="noisy", progress=False)
    trainer.fit(train, epochs=12)
    return trainer.run_dir, set(flipped.tolist())


def test_planted_label_noise_shows_up_as_the_least_confident_rows(noisy_run):
    run_dir, flipped = noisy_run
    state = cartography(read_rows(run_dir))
    assert state.row_id.tolist() == list(range(N)) and state.epochs.tolist() == [12] * N
    hardest = set(state.row_id[state.hardest(NOISY)].tolist())
    assert hardest == flipped  # the mislabelled rows are exactly the hardest ones
    noisy = np.isin(state.row_id, list(flipped))
    assert state.confidence[noisy].max() < state.confidence[~noisy].min()
    assert state.correctness[noisy].mean() < 0.2 < 0.8 < state.correctness[~noisy].mean()


def test_inspect_rows_lists_the_hardest_rows(noisy_run, capsys):
    run_dir, flipped = noisy_run
    assert inspect_main([str(run_dir), "rows", "--hardest", str(NOISY), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == NOISY and {r["row_id"] for r in lines} == flipped
    assert [r["confidence"] for r in lines] == sorted(r["confidence"] for r in lines)
    assert set(lines[0]) == {"row_id", "epochs", "confidence", "variability", "correctness"}


def test_inspect_plots_the_data_map(noisy_run, tmp_path, capsys):
    run_dir, _ = noisy_run
    out = tmp_path / "map.png"
    assert inspect_main([str(run_dir), "plot", "cartography", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in capsys.readouterr().out


def test_inspect_rows_of_a_run_without_row_ids_says_so(tmp_path, capsys):
    x, y = blobs_data(32, 0)
    net = small_net(0)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
                      run_id="plain", progress=False)
    trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8), epochs=1)
    assert inspect_main([str(trainer.run_dir), "rows"]) == 2
    assert "no committed per-row training records" in capsys.readouterr().err
    assert inspect_main([str(trainer.run_dir), "summary", "cartography"]) == 2
    assert "'cartography' names a plot" in capsys.readouterr().err
