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
own dtype); a float32 or float64 bucket is never widened. The staged values (float64) travel as
follows:

* a float64 bucket: appended as they are (their sums are those of a float64 all-reduce);
* a float32 bucket (the common case), values declared *float32 sums* (multiples of ``2**-149``:
  float32/float16/bfloat16 numbers added in float64 -- the window's losses -- and counts or
  weights that are such numbers): each value ``v`` is cut into float32 *parts* on a fixed grid
  of powers of two, ``2**b_0 < 2**b_1 < ... < 2**b_M`` with ``b_0 = -149`` (float32's smallest
  subnormal) and steps of ``k = 24 - ceil(log2(world size))`` bits: ``part_j = fmod(v, 2**b_(j+1))
  - fmod(v, 2**b_j)`` for ``j < M`` and the rest ``v - fmod(v, 2**b_M)`` (``fmod`` by a power of two and
  those differences are exact in IEEE arithmetic). Part ``j < M`` is an integer multiple of
  ``2**b_j`` below ``2**k`` of them, so the world size's parts sum -- in any order, as gloo's ring
  takes them -- to an integer below ``2**24`` of them: exact in float32. The rest is a multiple of
  ``2**b_M``; its partial sums are exact until one leaves float32's range, then infinite. The host
  adds a value's summed parts with ``math.fsum`` (correctly rounded): the exact sum of the ranks'
  values rounded once to float64 -- with 2 ranks bitwise what a float64 all-reduce gives (one
  correctly rounded addition), with more ranks at least as accurate. The grid is the same on
  every rank and needs no collective: ``2 * 13`` float32 values for ``[numerator, W]`` on 2 ranks,
  four small ops on the device in :meth:`FusedAgreement.stage` (before the backward), no host read.
* a sum the parts cannot carry -- a non-finite value, ``|v| >= 2**128``, or rests summing past
  float32's range -- comes out non-finite on every rank (a NaN or an infinity in the same sums),
  and a staging not declared float32 sums
  is staged as NaN parts; then :meth:`FusedAgreement.result` all-reduces the staged values in
  float64 on every rank alike (a second collective, only then: today's exact answer).
* any other bucket dtype (float16, bfloat16) or ``carry="float64"``: the values are appended to a
  float64 copy of the bucket, whose sum is divided by the world size and rounded once to the
  bucket's dtype (the hook before the float32 parts: it doubles the last bucket's bytes).

Values known on the host (a CPU run: reading a CPU tensor waits for no device) are staged with
:meth:`FusedAgreement.stage_host`: the same parts, cut by :func:`float32_parts_host` in Python and
written into a float32 buffer that holds the bucket and them (kept between windows), so a window
adds no torch op but one division into that buffer and one copy back -- each small torch op costs
~5-15 us of CPU inside a training loop, and the device path's dozen cost ~15 % of a digits step
(``bench/ddp.py``). The sums, the fallback and the gradients are bitwise the device path's.

Every other bucket, and a backward with nothing staged, is reduced as ``allreduce_hook`` does.
The values must be known before the backward that synchronizes (they are: the window's losses
and denominators are formed by its forwards); :meth:`FusedAgreement.result` reads the sums
after that backward returned (DDP waits for every bucket's future before ``backward`` returns).
A backward under ``no_sync`` runs no hook: the staged values wait for the next synchronizing one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nnx_es.errors import ConfigError

__all__ = ["FusedAgreement", "float32_grid", "float32_parts", "float32_parts_host", "float32_sum", "from_parts"]

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


def float32_parts(values: Tensor, grid: Tensor) -> Tensor:
    """``values`` ((V,) float64 float32 sums: multiples of ``2**-149``) cut into float32 parts on
    ``grid``, value by value: a (V * (M + 1),) float32 tensor formed on the device without a host
    read. ``grid``: the float64 tensor ``[*float32_grid(world), inf]`` (M + 2 powers, on the values'
    device). Summing such tensors of up to the grid's world size in float32, in any order, is
    exact or non-finite; :func:`from_parts` reads the sums."""
    # fmod by inf is the value itself (NaN for a non-finite one; torch's fmod is NaN too where the
    # quotient overflows, |value| >= 2**875); fmod(v, 2**-149) is 0 for a float32 sum, so the
    # differences are [the M parts, the rest from 2**b_M up] of each value, every one exact
    return torch.diff(torch.fmod(values.unsqueeze(1), grid), dim=1).to(torch.float32).view(-1)


def float32_parts_host(values: Sequence[float], grid: Sequence[float], *, on_grid: bool = True) -> list[float]:
    """:func:`float32_parts` of host floats in Python, bitwise the same (``math.fmod`` by a power of two
    and the differences are exact, as on the device): ``len(grid)`` parts per value, value by value.

    A value the parts cannot carry -- not finite, ``|v| >= 2**128`` -- and every value when
    ``on_grid`` is False (not declared float32 sums) gets NaN parts: the sums are then not finite on
    every rank and :meth:`FusedAgreement.result` sums the values in float64, as it does when the
    device's parts of such values (NaN or infinite) come back. ``grid``: :func:`float32_grid`'s."""
    m = len(grid)
    out: list[float] = []
    fmod = math.fmod
    for v in values:
        if not on_grid or not abs(v) < 2.0**128:  # NaN fails the comparison too
            out.extend([math.nan] * m)
            continue
        prev = fmod(v, grid[0])
        for g in grid[1:]:
            r = fmod(v, g)
            out.append(r - prev)
            prev = r
        out.append(v - prev)  # the rest, from the grid's last power up
    return out


def from_parts(sums: list[float], count: int) -> list[float] | None:
    """The ``count`` values whose :func:`float32_parts` were summed into ``sums`` (V * (M + 1) floats),
    each the exact sum rounded once to float64 (``math.fsum``); ``None`` when some sum is not finite
    (a value was not finite, or the parts could not carry it) -- then sum the values in float64."""
    m = len(sums) // count
    out = [math.fsum(sums[i * m:(i + 1) * m]) for i in range(count)]
    for x in out:  # fsum of finite parts is finite; of a NaN or an infinity, not
        if not math.isfinite(x):
            return None
    return out


_FLOAT32_SUMS = 2.0 ** -149


def float32_sum(x: float) -> bool:
    """Whether the host float ``x`` is a float32 sum (a finite multiple of ``2**-149``, ``math.fmod``
    being exact): the declaration :meth:`FusedAgreement.stage` takes for a value known on the host."""
    return math.isfinite(x) and math.fmod(x, _FLOAT32_SUMS) == 0.0


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
        self._staged: Tensor | list[float] | None = None  # a list: staged from the host (stage_host)
        self._tail: Tensor | None = None  # the staged values' float32 parts (cut by stage)
        self._on_grid = False
        #: after a carrying backward: (the summed tail, its kind, this rank's staged values); for
        #: kind "host" the tail's sums and the values are lists
        self._result: tuple[Any, str, Any] | None = None
        grid = float32_grid(self.size)
        self._grid = grid
        self._powers: dict[Any, Tensor] = {}  # device -> the grid and inf, float64
        #: stage_host's buffer (the last bucket, then the parts: float32, CPU), its bucket size and
        #: part count, a view of its bucket and its NumPy view; made on the first host-staged hook
        self._joined: tuple[Tensor, int, int, Tensor, Any] | None = None
        #: how many synchronizing backwards fell back to a float64 all-reduce of the values (a count, for tests)
        self.fallbacks = 0
        #: bytes the last result added to the gradients' all-reduce (its tail), plus a fallback's
        self.last_bytes = 0
        try:
            ddp.register_comm_hook(self, FusedAgreement._hook)
        except RuntimeError as exc:
            raise ConfigError(f"FusedAgreement: this DDP module already has a communication hook ({exc})") from None

    def stage(self, values: Tensor, *, float32_sums: bool = False) -> None:
        """Values (1-D, any float dtype, on the buckets' device) to sum with the next synchronizing backward.

        ``float32_sums``: every value is a multiple of ``2**-149`` (float32/float16/bfloat16 numbers
        added in float64, counts, such weights): they ride in a float32 bucket as float32 parts.
        Otherwise (the safe default) they ride as NaN parts and :meth:`result` sums them in float64
        with a second all-reduce. A wrong declaration gives a wrong sum: check it on the host
        (:func:`float32_sum`, a tensor's dtype), never with a host read of the device."""
        if values.dim() != 1:
            raise ConfigError(f"FusedAgreement.stage takes a 1-D tensor, got shape {tuple(values.shape)}")
        staged = self._staged = values.detach().to(torch.float64)
        self._on_grid = bool(float32_sums)
        self._result = None
        # the parts are cut here, before the backward, off its critical path (the hook only joins them)
        self._tail = None if self._grid is None or self.widen else self._parts(staged)

    def stage_host(self, values: Sequence[float], *, float32_sums: bool = False) -> None:
        """:meth:`stage` for values known on the host (Python floats: a CPU run reads them for free):
        on a float32 CPU bucket their parts are cut in Python and written beside the bucket in a
        buffer kept between windows (no torch op); on any other bucket they are staged as a tensor
        then. The sums and gradients are bitwise :meth:`stage`'s; ``float32_sums`` as there."""
        self._staged = [float(v) for v in values]
        self._on_grid = bool(float32_sums)
        self._result = None
        self._tail = None

    def result(self) -> list[float] | None:
        """The staged values summed over the ranks (float64, as Python floats), once the backward
        carrying them returned; ``None`` if no synchronizing backward carried them yet. Each result
        is handed out once. One host read; a second, float64 all-reduce only when some rank's value
        could not ride in float32 parts exactly (the module docstring; counted in :attr:`fallbacks`)."""
        out, self._result = self._result, None
        if out is None:
            return None
        tail, kind, staged = out
        if kind == "host":  # the summed parts, read from the buffer when the all-reduce completed
            sums = tail
            self.last_bytes = 4 * len(sums)
            count = len(staged)
        else:
            self.last_bytes = tail.numel() * tail.element_size()
            if kind == "float64":
                return tail.tolist()  # type: ignore[no-any-return]
            sums, count = tail.tolist(), staged.numel()
        got = from_parts(sums, count)
        if got is None:  # non-finite sums on every rank alike: every rank falls back alike
            self.fallbacks += 1
            self.last_bytes += 8 * count
            exact = torch.tensor(staged, dtype=torch.float64) if kind == "host" else staged.clone()
            dist.all_reduce(exact, group=self.group)
            return exact.tolist()  # type: ignore[no-any-return]
        return got

    def _parts(self, staged: Tensor) -> Tensor:
        """:func:`float32_parts` of ``staged`` on this agreement's grid (cached per device); NaN parts
        when the staging was not declared float32 sums."""
        grid = self._powers.get(staged.device)
        if grid is None:
            grid = self._powers[staged.device] = torch.tensor([*self._grid, math.inf], dtype=torch.float64,  # type: ignore[misc]
                                                              device=staged.device)
        if not self._on_grid:
            return torch.full((staged.numel() * (grid.numel() - 1),), math.nan, dtype=torch.float32,
                              device=staged.device)
        return float32_parts(staged, grid)

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
        if type(staged) is list:  # staged from the host
            if buf.dtype == torch.float32 and buf.device.type == "cpu" and state._grid is not None \
                    and not state.widen:
                return state._host_hook(buf, staged)
            staged = torch.tensor(staged, dtype=torch.float64, device=buf.device)
            state._tail = None
        staged = staged.to(buf.device)
        if buf.dtype == torch.float64 or (buf.dtype == torch.float32 and state._grid is not None
                                          and not state.widen):
            kind = "float64" if buf.dtype == torch.float64 else "float32"
            tail = staged if kind == "float64" else state._tail
            if tail is None or tail.device != buf.device:
                tail = state._parts(staged)
            joined = torch.cat((buf.div_(size), tail))

            def split(fut: torch.futures.Future) -> Tensor:
                out = fut.value()[0]
                state._result = (out[n:], kind, staged)
                buf.copy_(out[:n])  # into the bucket itself (a view of the result measured no faster)
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

    def _host_hook(self, buf: Tensor, values: list[float]) -> torch.futures.Future:
        """The last bucket ``buf`` (float32, CPU) and the host-staged ``values``' parts in one
        all-reduce: the bucket divided by the world size into the kept buffer (``torch.div`` into
        its view: the same division as ``buf.div_``), the parts written through its NumPy view,
        the reduced bucket copied back; the summed parts are read as the all-reduce completes."""
        n = buf.numel()
        m = len(values) * len(self._grid)  # type: ignore[arg-type]
        joined = self._joined
        if joined is None or joined[1] != n or joined[2] != m:  # DDP rebuilds its buckets once, early
            t = torch.empty(n + m, dtype=torch.float32)
            joined = self._joined = (t, n, m, t[:n], t.numpy())
        t, _, _, head, arr = joined
        arr[n:] = float32_parts_host(values, self._grid, on_grid=self._on_grid)  # type: ignore[arg-type]
        torch.div(buf, self.size, out=head)

        def split(fut: torch.futures.Future) -> Tensor:
            fut.value()
            self._result = (arr[n:].tolist(), "host", values)  # type: ignore[assignment]
            buf.copy_(head)
            return buf

        work = dist.all_reduce(t, group=self.group, async_op=True)
        return work.get_future().then(split)
