"""Data recipes: in-memory tabular data sets split into train and validation loaders.

``tabular(dataset=...)`` is what ``nnx-es init --dataset`` records; ``dataset_shape`` tells
the scaffold the input width and class count without building loaders.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from nnx_es.errors import ConfigError

__all__ = ["BUILTIN_DATASETS", "dataset_shape", "load_arrays", "tabular"]

#: data sets shipped with scikit-learn: (features, classes)
BUILTIN_DATASETS = {"digits": (64, 10), "breast_cancer": (30, 2)}


def load_arrays(dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (N, F) float32 and ``y`` (N,) int64 of ``dataset``: ``"digits"`` (pixels / 16),
    ``"breast_cancer"`` (standardized features) or a ``.npz`` file holding arrays ``x`` and ``y``.

    Raises:
        ConfigError: an unknown name, a missing or unreadable file (an object array: no pickles), arrays that
            are not numbers or of the wrong shape.
    """
    if dataset == "digits":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        return (x / 16.0).astype(np.float32), y.astype(np.int64)
    if dataset == "breast_cancer":
        from sklearn.datasets import load_breast_cancer

        x, y = load_breast_cancer(return_X_y=True)
        x = (x - x.mean(0)) / x.std(0)
        return x.astype(np.float32), y.astype(np.int64)
    path = Path(dataset)
    if path.suffix != ".npz":
        raise ConfigError(f"dataset must be 'digits', 'breast_cancer' or a .npz file, got {dataset!r}")
    if not path.is_file():
        raise ConfigError(f"dataset file {dataset!r} does not exist")
    try:  # no pickles: an object array is refused by numpy with a ValueError
        with np.load(path, allow_pickle=False) as arrays:
            if "x" not in arrays or "y" not in arrays:
                raise ConfigError(f"dataset file {dataset!r} must hold arrays 'x' (N, F) and 'y' (N,), has "
                                  f"{arrays.files}")
            x, y = arrays["x"], arrays["y"]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"dataset file {dataset!r} cannot be read: {exc} (save x and y as numeric arrays, "
                          "np.savez(path, x=x, y=y))") from None
    if x.dtype.kind not in "fiub" or y.dtype.kind not in "fiub":
        raise ConfigError(f"dataset file {dataset!r}: x and y must hold numbers, got {x.dtype} and {y.dtype}")
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
        raise ConfigError(f"dataset file {dataset!r}: x must be (N, F) and y (N,), got {x.shape} and {y.shape}")
    return x.astype(np.float32), y.astype(np.int64)


def dataset_shape(dataset: str) -> tuple[int, int]:
    """(features, classes) of ``dataset`` (a .npz file is read; the built-ins are known)."""
    if dataset in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[dataset]
    x, y = load_arrays(dataset)
    return int(x.shape[1]), int(y.max()) + 1


def tabular(dataset: str = "digits", batch_size: int = 32, val_fraction: float = 0.2, seed: int = 0,
            val_batch_size: int = 256) -> tuple[DataLoader[Any], DataLoader[Any] | None]:
    """(train loader, validation loader or None) over ``dataset`` (see :func:`load_arrays`).

    A fixed-seed permutation puts ``val_fraction`` of the rows in validation (0: no validation
    loader); the train loader shuffles with a generator of its own seeded by ``seed`` (so its
    state is checkpointed and a resume continues the same order).

    Raises:
        ConfigError: a bad ``batch_size`` or ``val_fraction``, see also :func:`load_arrays`.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    x_np, y_np = load_arrays(dataset)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(val_fraction * len(x))
    train_idx, val_idx = perm[n_val:], perm[:n_val]
    train = DataLoader(TensorDataset(x[train_idx], y[train_idx]), batch_size=batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(seed))
    val = DataLoader(TensorDataset(x[val_idx], y[val_idx]), batch_size=val_batch_size) if n_val else None
    return train, val
