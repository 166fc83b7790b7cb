"""RNG streams as msgpack-able builtins: torch (CPU), numpy's global, Python's, and the loaders' own generators.

No pickle: tensors become raw bytes, numpy's state its key array's bytes. The
state of each loader's own generators (:class:`LoaderGenerators`: the train
loader's and the validation loader's) is kept under that loader's keys::

    train loader        "loader" (bytes or None), "samplers" (list of bytes, absent when empty)
    validation loader   "val_loader",              "val_samplers"

A state without a loader's keys (a checkpoint from before the validation
loader's were kept) reads as "that loader had no generator of its own".
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["LoaderGenerators", "capture_rng", "generators_mismatch", "loader_generators", "rank_seed",
           "restore_rng", "seed_everything"]

#: each loader role -> (its name in messages, its DataLoader generator's key, its samplers' key)
_ROLES = {"train": ("train loader", "loader", "samplers"), "val": ("validation loader", "val_loader", "val_samplers")}


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


class LoaderGenerators(NamedTuple):
    """One loader's own torch generators, whose states (not seeds) a checkpoint holds.

    loader: the DataLoader's ``generator`` (each epoch's base seed; the shuffle of
    ``shuffle=True``), or None; samplers: a sampler's or batch sampler's own besides it.
    """

    loader: torch.Generator | None = None
    samplers: tuple[torch.Generator, ...] = ()

    @classmethod
    def of(cls, loader: Any) -> LoaderGenerators:
        """``loader``'s own generators (:func:`loader_generators`); none for ``None`` or a plain iterable."""
        found = loader_generators(loader)
        own = getattr(loader, "generator", None)
        own = own if any(own is g for g in found) else None
        return cls(own, tuple(g for g in found if g is not own))

    @property
    def layout(self) -> tuple[bool, int]:
        """(has a DataLoader generator, number of sampler generators): what must match on restore."""
        return self.loader is not None, len(self.samplers)


def _saved_layout(state: Mapping[str, Any], role: str) -> tuple[bool, int]:
    _, own_key, samplers_key = _ROLES[role]
    return state.get(own_key) is not None, len(state.get(samplers_key, []))


def generators_mismatch(state: Mapping[str, Any], loaders: Mapping[str, LoaderGenerators]) -> str | None:
    """Why ``state`` (from :func:`capture_rng`) cannot be restored into ``loaders``' generators:
    the first loader (in ``loaders`` order) that has, or lacks, a DataLoader generator, or has
    another number of sampler generators than the state holds, named; None when all match."""
    def say(layout: tuple[bool, int]) -> str:
        return f"{'a' if layout[0] else 'no'} DataLoader generator and {layout[1]} sampler generator(s)"

    for role, gens in loaders.items():
        saved = _saved_layout(state, role)
        if saved != gens.layout:
            return f"the run's {_ROLES[role][0]} had {say(saved)}, this one has {say(gens.layout)}"
    return None


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s global RNG streams in a group of more than one rank.

    It is child ``rank`` of NumPy's ``SeedSequence(seed mod 2**64)`` -- what
    ``np.random.SeedSequence(seed).spawn(world_size)[rank]`` gives, for any world size -- read
    as one unsigned 64-bit word. The SeedSequence hash mixes ``seed`` and ``rank``, so (unlike
    ``seed + rank``) rank 1 of seed ``s`` is not rank 0 of seed ``s + 1``, and no rank's seed is
    a small integer a user would pick for a run of its own.

    The peers differ: Ignite's examples seed ``seed + rank`` (which collides across runs seeded
    0, 1, 2, ...); Lightning's ``seed_everything`` seeds every rank alike and mixes the rank into
    its DataLoader workers' seeds only; torchtitan seeds data-parallel ranks alike and offsets
    pipeline stages. Spec 000 §3 asks for each rank's own stream, hence a hash of both.

    Returns:
        an int in ``[0, 2**64)``.
    """
    child = np.random.SeedSequence(int(seed) % 2**64, spawn_key=(int(rank),))
    return int(child.generate_state(1, dtype=np.uint64)[0])


def seed_everything(seed: int, *, rank: int = 0, world_size: int = 1) -> int:
    """Seed Python's, numpy's global and torch's RNGs; return the seed they were given.

    One process (``world_size == 1``) seeds them with ``seed`` itself. In a group of more than
    one rank each rank draws its own streams (spec 000 §3: dropout matches one process only in
    distribution): rank ``r`` seeds them as one process would with :func:`rank_seed` ``(seed, r)``.
    NumPy's legacy global stream takes the seed's low 32 bits (as it always has). The loaders' own
    generators and the training partition (the train loader's seed + epoch, the same on every
    rank) are not touched.
    """
    if world_size > 1:
        seed = rank_seed(seed, rank)
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    return seed


def _gen_bytes(gen: torch.Generator) -> bytes:
    return bytes(gen.get_state().numpy().tobytes())


def _set_gen(gen: torch.Generator, raw: bytes) -> None:
    gen.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())


def capture_rng(loaders: Mapping[str, LoaderGenerators]) -> dict[str, Any]:
    """Every RNG stream the training loop draws from, as builtins.

    ``loaders``: role (``"train"``, ``"val"``) -> that loader's own generators, kept under
    the role's keys (see the module docstring).
    """
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": bytes(torch.get_rng_state().numpy().tobytes()),
        "numpy": {"name": name, "keys": np.asarray(keys, dtype=np.uint32).tobytes(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    for role, gens in loaders.items():
        _, own_key, samplers_key = _ROLES[role]
        state[own_key] = _gen_bytes(gens.loader) if gens.loader is not None else None
        if gens.samplers:
            state[samplers_key] = [_gen_bytes(g) for g in gens.samplers]
    return state


def restore_rng(state: Mapping[str, Any], loaders: Mapping[str, LoaderGenerators]) -> None:
    """Restore what :func:`capture_rng` returned (``loaders`` as given to it).

    Raises:
        ValueError: a loader's generators differ from the state's (:func:`generators_mismatch`);
            nothing is restored then.
    """
    why = generators_mismatch(state, loaders)
    if why is not None:
        raise ValueError(f"cannot restore the data order: {why}")
    for role, gens in loaders.items():
        _, own_key, samplers_key = _ROLES[role]
        for gen, raw in zip(gens.samplers, state.get(samplers_key, [])):
            _set_gen(gen, raw)
        if gens.loader is not None:
            _set_gen(gens.loader, state[own_key])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8).clone())
    n = state["numpy"]
    keys = np.frombuffer(n["keys"], dtype=np.uint32).copy()
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
