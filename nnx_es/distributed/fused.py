"""The window's agreement carried by DDP's own gradient all-reduce: one collective per update.

Today a data-parallel window ends with two collectives: DDP's gradient all-reduce inside the
last microbatch's backward, then the engine's all-reduce of ``[numerator, denominator,
non-finite flag]``. Each is a round trip in which every rank waits for the slowest and gloo's
threads must be scheduled again; on a small model (the digits MLP: one bucket) the second one
costs about as much as the first (``bench/ddp.py``: the hand-written loop with a second
all-reduce per step against the same loop with :class:`FusedAgreement`).

:class:`FusedAgreement` is a DDP communication hook (``DistributedDataParallel.register_comm_hook``,
torch's documented extension point) that appends the staged values to the last bucket the
reducer all-reduces in a backward and splits them off again. The gradients are reduced exactly
as torch's default hook does (``allreduce_hook``: divide by the world size, sum, in the bucket's
own dtype); the bucket is never widened. The staged values (float64) travel as follows:

* a float64 bucket: appended as they are (their sums are those of a float64 all-reduce);
* a float32 bucket (the common case): each value ``v`` is cut into float32 *parts* on a fixed
  grid of powers of two, ``2**b_0 < 2**b_1 < ... < 2**b_M`` with ``b_0 = -149`` (float32's
  smallest subnormal) and steps of ``k = 24 - ceil(log2(world size))`` bits:
  ``part_j = fmod(v, 2**b_j) - fmod(v, 2**b_(j-1))`` (``fmod`` and that difference are exact in
  IEEE arithmetic). A part is an integer multiple of ``2**b_(j-1)`` below ``2**k`` of them, so
  the sum of the world size's parts -- in any order, as gloo's ring takes them -- is an integer
  below ``2**24`` of them: exact in float32. The host adds the summed parts with ``math.fsum``
  (correctly rounded), so the result is the exact sum of the ranks' values rounded once to
  float64 -- with 2 ranks bitwise what a float64 all-reduce gives (one correctly rounded
  addition), with more ranks at least as accurate. The grid is the same on every rank and
  needs no collective; ``2 * 12 + 1`` float32 values for ``[numerator, W]`` on 2 ranks.
* a value the grid cannot carry exactly -- ``|v| >= 2**b_M`` (``2**127`` on 2 ranks), a non-finite
  value, or one with bits below ``2**-149`` (a float64 value that no float32/float16/bfloat16
  sum gives) -- makes a count appended after the parts non-zero. The count is part of the same sum, so
  every rank sees it; then :meth:`FusedAgreement.result` all-reduces the staged values in float64
  on every rank (a second collective, only then: today's exact answer, never a rounded one).
* any other bucket dtype (float16, bfloat16): the values are appended to a float64 copy of the
  bucket, whose sum is divided by the world size and rounded once to the bucket's dtype.

Every other bucket, and a backward with nothing staged, is reduced as ``allreduce_hook`` does.
The values must be known before the backward that synchronizes (they are: the window's losses
and denominators are formed by its forwards); :meth:`FusedAgreement.result` reads the sums
after that backward returned (DDP waits for every bucket's future before ``backward`` returns).
A backward under ``no_sync`` runs no hook: the staged values wait for the next synchronizing one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nnx_es.errors import ConfigError

__all__ = ["FusedAgreement", "float32_grid", "float32_parts", "from_parts"]

_LOW = -149  # float32's smallest subnormal is 2**-149: every float32/float16/bfloat16 sum is a multiple


def float32_grid(world_size: int) -> list[float] | None:
    """The powers of two ``[2**b_0, ..., 2**b_M]`` that cut a float64 value into float32 parts whose
    sums over ``world_size`` ranks are exact (module docstring), or ``None`` when the world is too
    large for parts of at least 8 bits (more than 65,536 ranks: the float64 path is used)."""
    k = 24 - max(0, math.ceil(math.log2(world_size)))
    if k < 8:
        return None
    # the last part's sums stay below 2**(b_(M-1) + 24), within float32's range (< 2**128)
    m = (128 - 24 - _LOW) // k + 1
    return [math.ldexp(1.0, _LOW + j * k) for j in range(m + 1)]


def float32_parts(values: Tensor, grid: Tensor, zeros: Tensor) -> Tensor:
    """``values`` ((V,) float64) cut into float32 parts on ``grid``, value by value, then a count that is
    not 0 when the grid cannot carry some value exactly (too large, non-finite, or with bits below
    ``2**-149``; torch's ``fmod`` gives NaN where the quotient overflows, counted too): a (V * M + 1,) float32 tensor, formed on the device without a host read. ``grid``: the float64
    tensor ``[*float32_grid(world), inf]`` (M + 2 powers, on the values' device); ``zeros``: (V, 1)
    float64 zeros there. Summing such tensors of up to the grid's world size in float32, in any
    order, is exact; :func:`from_parts` reads the sums."""
    # fmod by inf is the value itself (NaN for a non-finite one); fmod by a power of two whose quotient
    # does not overflow (any |value| < 2**128 on this grid) is exact; with a 0 before them the differences
    # are [bits below 2**-149, the M parts, bits from 2**b_M up] of each value, every one exact
    d = torch.diff(torch.fmod(values.unsqueeze(1), grid), dim=1, prepend=zeros)  # (V, M + 2)
    m = d.shape[1] - 2
    missed = torch.count_nonzero(d[:, ::m + 1])  # the first and last columns (NaN counts too)
    return torch.cat((d[:, 1:m + 1].reshape(-1), missed.reshape(1))).to(torch.float32)


def from_parts(sums: list[float], count: int) -> list[float] | None:
    """The ``count`` values whose :func:`float32_parts` were summed into ``sums`` (V * M + 1 floats),
    each the exact sum rounded once to float64 (``math.fsum``); ``None`` when the last entry (the count
    of values the parts could not carry) is not 0 -- then sum the values themselves in float64."""
    if sums[-1] != 0:
        return None
    m = (len(sums) - 1) // count
    return [math.fsum(sums[i * m:(i + 1) * m]) for i in range(count)]


class FusedAgreement:
    """Sum a small vector over the ranks inside DDP's gradient all-reduce (see the module docstring).

    Args:
        ddp: a ``torch.nn.parallel.DistributedDataParallel``; the hook is registered on it (once:
            DDP takes one comm hook).
        group: the process group (default: DDP's own, the default group).
        carry: ``"auto"`` (the module docstring) or ``"float64"``: always append the values to a
            float64 copy of the bucket (what this hook did before the float32 parts; kept to
            measure against, ``bench/ddp.py``).

    Raises:
        ConfigError: ``ddp`` already has a comm hook (torch raises then; the message says so), or
            another ``carry``.
    """

    def __init__(self, ddp: Any, group: Any = None, carry: str = "auto") -> None:
        if carry not in ("auto", "float64"):
            raise ConfigError(f"FusedAgreement(carry=) must be 'auto' or 'float64', got {carry!r}")
        self.group = group
        self.widen = carry == "float64"
        self.size = dist.get_world_size(group)
        self._staged: Tensor | None = None
        #: after a carrying backward: (the summed tail, its kind, this rank's staged values)
        self._result: tuple[Tensor, str, Tensor] | None = None
        grid = float32_grid(self.size)
        self._grid = grid
        self._powers: dict[Any, tuple[Tensor, Tensor]] = {}  # (device, V) -> (the grid + inf, (V, 1) zeros)
        #: how many synchronizing backwards fell back to a float64 all-reduce of the values (a count, for tests)
        self.fallbacks = 0
        #: bytes the last result added to the gradients' all-reduce (its tail), plus a fallback's
        self.last_bytes = 0
        try:
            ddp.register_comm_hook(self, FusedAgreement._hook)
        except RuntimeError as exc:
            raise ConfigError(f"FusedAgreement: this DDP module already has a communication hook ({exc})") from None

    def stage(self, values: Tensor) -> None:
        """Values (1-D, any float dtype, on the buckets' device) to sum with the next synchronizing backward."""
        if values.dim() != 1:
            raise ConfigError(f"FusedAgreement.stage takes a 1-D tensor, got shape {tuple(values.shape)}")
        self._staged = values.detach().to(torch.float64)
        self._result = None

    def result(self) -> list[float] | None:
        """The staged values summed over the ranks (float64, as Python floats), once the backward
        carrying them returned; ``None`` if no synchronizing backward carried them yet. Each result
        is handed out once. One host read; a second, float64 all-reduce only when some rank's value
        could not ride in float32 parts exactly (the module docstring; counted in :attr:`fallbacks`)."""
        out, self._result = self._result, None
        if out is None:
            return None
        tail, kind, staged = out
        self.last_bytes = tail.numel() * tail.element_size()
        if kind == "float64":
            return tail.tolist()  # type: ignore[no-any-return]
        got = from_parts(tail.tolist(), staged.numel())
        if got is None:  # the same count on every rank: every rank falls back alike
            self.fallbacks += 1
            self.last_bytes += staged.numel() * staged.element_size()
            exact = staged.clone()
            dist.all_reduce(exact, group=self.group)
            return exact.tolist()  # type: ignore[no-any-return]
        return got

    def _parts(self, staged: Tensor) -> Tensor:
        """:func:`float32_parts` of ``staged`` on this agreement's grid (cached per device)."""
        key = (staged.device, staged.numel())
        cached = self._powers.get(key)
        if cached is None:
            grid = torch.tensor([*self._grid, math.inf], dtype=torch.float64, device=staged.device)  # type: ignore[misc]
            cached = self._powers[key] = (grid, torch.zeros(staged.numel(), 1, dtype=torch.float64, device=staged.device))
        return float32_parts(staged, *cached)

    @staticmethod
    def _hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none (a GradBucket)
        buf = bucket.buffer()
        size = state.size
        staged = state._staged
        if staged is None or not bucket.is_last():
            buf.div_(size)
            work = dist.all_reduce(buf, group=state.group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        state._staged = None
        n = buf.numel()
        staged = staged.to(buf.device)
        if buf.dtype == torch.float64 or (buf.dtype == torch.float32 and state._grid is not None
                                          and not state.widen):
            kind = "float64" if buf.dtype == torch.float64 else "float32"
            tail = staged if kind == "float64" else state._parts(staged)
            joined = torch.cat((buf.div_(size), tail))

            def split(fut: torch.futures.Future) -> Tensor:
                out = fut.value()[0]
                state._result = (out[n:], kind, staged)
                buf.copy_(out[:n])
                return buf
        else:  # float16 / bfloat16 (or a world too large for the grid, or carry="float64"): a float64 copy
            kind = "float64"
            joined = torch.cat((buf.to(torch.float64), staged))

            def split(fut: torch.futures.Future) -> Tensor:
                out = fut.value()[0]
                state._result = (out[n:], kind, staged)
                buf.copy_(out[:n].div_(size))
                return buf

        work = dist.all_reduce(joined, group=state.group, async_op=True)
        return work.get_future().then(split)
