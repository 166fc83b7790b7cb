"""One accumulation window: its microbatches' losses held on the device and their one host read.

:class:`AccumulationWindow` owns a window's accounting (microbatches, the denominator ``W``, the
numerator, the non-finite mark, how the gradients were divided) and the losses of the
microbatches whose values are still on the device. :meth:`AccumulationWindow.read` reads them
-- with the gradients' finiteness flag or norm, when given -- in one transfer and returns each
microbatch's floats; nothing is read inside a window otherwise.

Host reads (each stalls an accelerator's queue): one transfer at the window's end reads every
microbatch's loss (and terms, and rows of ignored targets) together with the flag
(``torch.stack(...).tolist()``); on the CPU, where a read waits for nothing, a few values are
read one by one instead (:data:`READ_EACH_ON_CPU`). The floats are the same either way, and
the same a read per microbatch gave.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["READ_EACH_ON_CPU", "AccumulationWindow", "MicrobatchRead"]

#: a window's values on the CPU are read one by one (``Tensor.item``: no stack op, no copy -- on the
#: CPU a read waits for nothing), up to :data:`READ_EACH_MAX` of them; False: every device's way, one
#: stacked transfer (``torch.stack(...).tolist()``). The floats are the same (tests run both ways).
READ_EACH_ON_CPU = True
READ_EACH_MAX = 8  # past this many values one stack and one tolist cost less than the reads

#: one microbatch as read: (numerator, exact denominator, per-term numerators (several terms) or None)
MicrobatchRead = tuple[float, float, "dict[str, float] | None"]


class AccumulationWindow:
    """The open window of an update engine (spec 000 §3 "One update").

    ``size``: microbatches per window (k >= 1). Accounting, reset by :meth:`reset` after each
    window: ``microbatches``; ``den`` this rank's denominator (the receipt's ``local_examples``);
    ``num`` the numerators read so far; ``nonfinite`` a read loss was not finite; ``divided`` /
    ``scale`` the gradient is the mean already (a one-microbatch window divides in backward) and
    by what; ``global_den`` / ``collective_bytes`` the data-parallel seam of the step receipt
    (set by the data-parallel strategy; None / 0 for one process); ``num_t`` / ``ign_t`` /
    ``float32_sums`` the data-parallel agreement's running sums.
    """

    __slots__ = ("size", "microbatches", "den", "num", "nonfinite", "divided", "scale", "global_den",
                 "collective_bytes", "num_t", "ign_t", "float32_sums", "_pending", "_tensors", "_floats", "reads")

    def __init__(self, size: int) -> None:
        self.size = size
        #: held microbatches: (denominator, term names, whether ignored rows follow, the loss if read already)
        self._pending: list[tuple[float, tuple[str, ...], bool, float | None]] = []
        #: their 0-dim values to read, in reading order (loss unless read already, then terms, ignored rows)
        self._tensors: list[Tensor] = []
        self._floats = True  # every held value is of a floating dtype (read one by one on the CPU)
        #: the microbatches read, in order, not yet taken by the recorder (:meth:`StepRecorder._release
        #: <nnx_es.runtime.steps.StepRecorder>` takes them, replacing the list)
        self.reads: list[MicrobatchRead] = []
        self.reset()

    def reset(self) -> None:
        """Open the next window (the held microbatches were read: :meth:`read`)."""
        self.microbatches = 0
        self.den = 0.0
        self.num = 0.0
        self.nonfinite = False
        self.divided = False
        self.scale = 0.0
        self.global_den: float | None = None
        self.collective_bytes = 0
        self.num_t: Tensor | float | None = None
        self.ign_t: Tensor | float | None = None
        self.float32_sums = True

    @property
    def full(self) -> bool:
        return self.microbatches >= self.size

    @property
    def holding(self) -> bool:
        """Whether microbatches wait for their read."""
        return bool(self._pending)

    def hold(self, loss_t: Tensor, den: float, terms: dict[str, Tensor] | None, ign: Tensor | None,
             known: float | None) -> None:
        """Add a microbatch: its loss ``loss_t`` (0-dim, on the device), denominator, its terms'
        numerators (several terms; None for one), its rows of ignored targets (or None), and its
        loss's value when the host read it already (``known``; else None)."""
        self.microbatches += 1
        self.den += den
        tensors = self._tensors
        if known is None:
            tensors.append(loss_t)
            if not loss_t.dtype.is_floating_point:
                self._floats = False
        if terms:
            self._pending.append((den, tuple(terms), ign is not None, known))
            tensors.extend(terms.values())
        else:
            self._pending.append((den, (), ign is not None, known))
        if ign is not None:
            tensors.append(ign)
            if not ign.dtype.is_floating_point:
                self._floats = False

    def read(self, flag: Tensor | None = None) -> float | None:
        """Read the held microbatches (and ``flag``, 0-dim) in one transfer; return ``flag``'s value
        (None without one).

        Each held microbatch's :data:`MicrobatchRead` joins :attr:`reads`, in order, until its
        recorder takes them; the window's ``num``, ``nonfinite`` and ``den`` (less the rows of
        ignored targets read now) take them in.
        """
        pending, tensors = self._pending, self._tensors
        self._pending, self._tensors = [], []
        if flag is not None:
            if tensors and flag.device != tensors[0].device:
                flag = flag.to(tensors[0].device)
            tensors.append(flag)
        floats, self._floats = self._floats and (flag is None or flag.dtype.is_floating_point), True
        values: list[float] = []  # none to read when the host read the losses already (a DDP window on the CPU)
        if tensors:
            if floats and READ_EACH_ON_CPU and len(tensors) <= READ_EACH_MAX and tensors[0].device.type == "cpu":
                # nothing to wait for on the CPU: each value read where it is, no stack op; the floats the
                # stacked read gives (a floating dtype converts to a Python float exactly; anything else is stacked)
                values = list(map(Tensor.item, tensors))
            else:
                values = torch.stack(tensors).tolist()  # dtypes promote exactly (fp16/bf16 -> fp32 -> fp64)
        reads = self.reads
        i = 0
        for den, names, ignoring, known in pending:
            if known is None:
                num = values[i]
                i += 1
            else:
                num = known
            nums = None
            if names:
                nums = dict(zip(names, values[i:i + len(names)]))
                i += len(names)
            if ignoring:  # targets an ignore_index leaves out: the exact denominator
                ignored = values[i]
                i += 1
                den -= ignored
                self.den -= ignored
                self.ign_t = None  # under DDP: den holds them now (the staged W must not subtract them again)
            if not math.isfinite(num):
                self.nonfinite = True
            self.num += num
            reads.append((num, den, nums))
        return values[-1] if flag is not None else None
