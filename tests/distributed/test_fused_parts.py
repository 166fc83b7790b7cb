"""The float32 parts that carry the window's [numerator, W] in the gradients' own bucket
(nnx_es.distributed.fused): summed in float32 over the ranks, in any order, they give the exact
sum of the ranks' float64 values rounded once -- no collective needed to test the arithmetic."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nnx_es.distributed.fused import float32_grid, float32_parts, float32_parts_host, float32_sum, from_parts


def _float32_sums(values_per_rank: list[list[float]], world: int, order: list[int]) -> list[float]:
    """What a float32 all-reduce of every rank's parts gives, adding the ranks in ``order``."""
    grid = torch.tensor([*float32_grid(world), math.inf], dtype=torch.float64)
    parts = [float32_parts(torch.tensor(v, dtype=torch.float64), grid) for v in values_per_rank]
    total = parts[order[0]].clone()
    for r in order[1:]:
        total += parts[r]  # float32 addition, rounded -- exact when the parts are carried exactly
    return total.tolist()


def _float32_sum_values(rng: random.Random, terms: int) -> float:
    """A window's numerator as the engine forms it: float32 losses added in float64."""
    total = 0.0
    for _ in range(terms):
        total += float(torch.tensor(rng.uniform(-1, 1) * 10 ** rng.uniform(-30, 30), dtype=torch.float32))
    return total


@pytest.mark.parametrize("world", [2, 3, 16])
def test_parts_summed_in_float32_in_any_order_give_the_exact_sum_rounded_once(world: int) -> None:
    rng = random.Random(world)
    for _ in range(200):
        values = [[_float32_sum_values(rng, rng.randint(1, 6)), rng.choice([0.0, 2.5, 31.0, 1e-3 * 2 ** -10,
                                                                              float(rng.randint(0, 2 ** 40))])]
                  for _ in range(world)]
        order = list(range(world))
        rng.shuffle(order)
        got = from_parts(_float32_sums(values, world, order), 2)
        assert got is not None
        for i in range(2):
            assert got[i] == math.fsum(v[i] for v in values)  # exact, then rounded once
        if world == 2:  # one IEEE addition: bitwise what a float64 all-reduce gives
            assert got == [values[0][0] + values[1][0], values[0][1] + values[1][1]]


def test_the_grid_of_two_ranks_covers_float32_sums_from_2_to_the_minus_149_to_2_to_the_127() -> None:
    grid = float32_grid(2)
    assert grid[0] == 2.0 ** -149 and grid[-1] == 2.0 ** 127 and len(grid) == 13  # 12 parts of 23 bits
    for g in (float32_grid(16), float32_grid(65536)):
        assert g is not None and g[0] == 2.0 ** -149 and g[-2] <= 2.0 ** 104  # last part's sums < 2**128
    assert float32_grid(65537) is None  # parts of fewer than 8 bits: the float64 path


@pytest.mark.parametrize("bad", [2.0 ** 128, -1e300, float("inf"), float("nan")])
def test_a_value_the_parts_cannot_carry_makes_the_sums_non_finite_on_every_rank(bad: float) -> None:
    sums = _float32_sums([[1.5, bad], [2.0, 3.0]], 2, [0, 1])
    assert not all(math.isfinite(x) for x in sums[13:])  # the second value's parts: the same on every rank
    assert from_parts(sums, 2) is None  # the caller all-reduces the values in float64 instead


def test_the_extremes_the_parts_carry_exactly() -> None:
    top = 2.0 ** 128 - 2.0 ** 104  # float32's largest number
    for values, order in (([[1.5, 2.0 ** 127], [-0.0, -(2.0 ** 127)]], [1, 0]),  # the rests cancel exactly
                          ([[top, 2.0 ** -149], [-top, 2.0 ** -149]], [0, 1]),
                          ([[2.0 ** 127 + 2.0 ** 100, 1.0], [2.0 ** -149, 3.0]], [0, 1])):
        got = from_parts(_float32_sums(values, 2, order), 2)
        assert got == [values[0][0] + values[1][0], values[0][1] + values[1][1]]
    # both ranks past 2**127: the rests' float32 sum leaves the range -- non-finite, never rounded
    assert from_parts(_float32_sums([[2.0 ** 127, 0.0], [2.0 ** 127, 0.0]], 2, [0, 1]), 2) is None


def test_the_float32_sum_declaration_on_the_host() -> None:
    assert float32_sum(2.5) and float32_sum(31.0) and float32_sum(2.0 ** -149) and float32_sum(-0.0)
    assert float32_sum(float(torch.tensor(0.1, dtype=torch.float32)) + float(torch.tensor(1e-30)))
    assert float32_sum(0.1)  # float64's 0.1 is a multiple of 2**-56: all the parts need
    assert not float32_sum(0.1 * 2.0 ** -100)  # its last bit is 2**-156
    assert not float32_sum(2.0 ** -160) and not float32_sum(math.inf) and not float32_sum(math.nan)


def test_torch_fmod_by_the_grid_is_exact_where_the_parts_rely_on_it() -> None:
    """The parts rely on fmod(v, 2**b) being exact for |v| < 2**128 (a guard against a torch whose
    vectorized fmod rounds): torch's against Python's (C's fmod, exact by IEEE 754) on every power."""
    rng = random.Random(0)
    grid = [*float32_grid(2), math.inf]
    vals = [_float32_sum_values(rng, rng.randint(1, 4)) for _ in range(300)]
    vals += [2.0 ** -149, -(2.0 ** -149) * 3, 2.0 ** 127 * 1.5, -(2.0 ** 126), float(2 ** 53 + 1) * 2.0 ** -100]
    got = torch.fmod(torch.tensor(vals, dtype=torch.float64).unsqueeze(1), torch.tensor(grid, dtype=torch.float64))
    assert got.tolist() == [[math.fmod(v, g) for g in grid] for v in vals]


@pytest.mark.parametrize("world", [2, 3, 16])
def test_the_hosts_parts_are_the_devices_bitwise_and_those_it_cannot_carry_are_nan(world: int) -> None:
    """stage_host cuts the parts in Python (a CPU run): the same float32 values as float32_parts for every
    value the parts carry; NaN parts for one they cannot, or undeclared ones, where the device's are
    NaN or infinite -- either way the sums come back non-finite and the caller falls back alike."""
    rng = random.Random(world)
    grid = float32_grid(world)
    grid_t = torch.tensor([*grid, math.inf], dtype=torch.float64)
    vals = [_float32_sum_values(rng, rng.randint(1, 6)) for _ in range(300)] + [float(rng.randint(0, 2 ** 40))]
    vals += [0.0, -0.0, 2.0 ** -149, -(2.0 ** -149) * 3, 2.0 ** 127 * 1.5, 2.0 ** 128 - 2.0 ** 104, -(2.0 ** 126)]
    host = torch.tensor(float32_parts_host(vals, grid), dtype=torch.float32)
    device = float32_parts(torch.tensor(vals, dtype=torch.float64), grid_t)
    assert host.numel() == device.numel() == len(vals) * len(grid)
    assert torch.equal(host.view(torch.int32), device.view(torch.int32))  # bitwise, signs of zero included
    for bad in (2.0 ** 128, -1e300, math.inf, math.nan):
        cut = float32_parts_host([1.5, bad], grid)
        assert all(math.isnan(x) for x in cut[len(grid):]) and cut[:len(grid)] == float32_parts_host([1.5], grid)
        dev = float32_parts(torch.tensor([bad], dtype=torch.float64), grid_t)
        assert not torch.isfinite(dev).all()  # the device's parts of it: non-finite too
    assert all(math.isnan(x) for x in float32_parts_host([1.5, 2.0], grid, on_grid=False))
