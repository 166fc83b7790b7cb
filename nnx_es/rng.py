"""RNG streams as msgpack-able builtins: torch (CPU), numpy's global, Python's, a loader generator.

No pickle: tensors become raw bytes, numpy's state its key array's bytes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "loader_generators", "restore_rng", "seed_everything"]


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The torch generators a loader's epochs draw from: ``loader.generator`` first, then a
    sampler's or batch sampler's own (``RandomSampler(generator=g)``), each once."""
    found: list[torch.Generator] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's global and torch's RNGs with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _gen_bytes(gen: torch.Generator) -> bytes:
    return bytes(gen.get_state().numpy().tobytes())


def capture_rng(loader_generator: torch.Generator | None = None,
                samplers: Sequence[torch.Generator] = ()) -> dict[str, Any]:
    """Every RNG stream the training loop draws from, as builtins (``samplers``: the train
    loader's generators after ``loader_generator``, see :func:`loader_generators`)."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": bytes(torch.get_rng_state().numpy().tobytes()),
        "numpy": {"name": name, "keys": np.asarray(keys, dtype=np.uint32).tobytes(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "loader": _gen_bytes(loader_generator) if loader_generator is not None else None,
    }
    if samplers:
        state["samplers"] = [_gen_bytes(g) for g in samplers]
    return state


def restore_rng(state: dict[str, Any], loader_generator: torch.Generator | None = None,
                samplers: Sequence[torch.Generator] = ()) -> None:
    """Restore what :func:`capture_rng` returned.

    Raises:
        ValueError: ``samplers`` are not as many generators as the state holds.
    """
    saved = state.get("samplers", [])
    if len(saved) != len(samplers):
        raise ValueError(f"the train loader's samplers draw from {len(samplers)} generator(s) of their own; "
                         f"the checkpoint holds {len(saved)}")
    for gen, raw in zip(samplers, saved):
        gen.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8).clone())
    n = state["numpy"]
    keys = np.frombuffer(n["keys"], dtype=np.uint32).copy()
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if loader_generator is not None and state.get("loader") is not None:
        loader_generator.set_state(torch.frombuffer(bytearray(state["loader"]), dtype=torch.uint8).clone())
