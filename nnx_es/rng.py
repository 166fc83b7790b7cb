"""RNG streams as msgpack-able builtins: torch (CPU), numpy's global, Python's, a loader generator.

No pickle: tensors become raw bytes, numpy's state its key array's bytes.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's global and torch's RNGs with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _gen_bytes(gen: torch.Generator) -> bytes:
    return bytes(gen.get_state().numpy().tobytes())


def capture_rng(loader_generator: torch.Generator | None = None) -> dict[str, Any]:
    """Every RNG stream the training loop draws from, as builtins."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": bytes(torch.get_rng_state().numpy().tobytes()),
        "numpy": {"name": name, "keys": np.asarray(keys, dtype=np.uint32).tobytes(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "loader": _gen_bytes(loader_generator) if loader_generator is not None else None,
    }
    return state


def restore_rng(state: dict[str, Any], loader_generator: torch.Generator | None = None) -> None:
    """Restore what :func:`capture_rng` returned."""
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8).clone())
    n = state["numpy"]
    keys = np.frombuffer(n["keys"], dtype=np.uint32).copy()
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if loader_generator is not None and state.get("loader") is not None:
        loader_generator.set_state(torch.frombuffer(bytearray(state["loader"]), dtype=torch.uint8).clone())
