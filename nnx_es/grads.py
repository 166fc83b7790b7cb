"""A window's gradients at its end: their layout (dense or sparse COO) and their finiteness.

The update engine (:class:`nnx_es.runtime.engine.UpdateEngine`) divides, checks, norms and clips the
gradients of one accumulation window; this module owns what those steps see.

Sparse gradients (``torch.sparse_coo``, e.g. from ``nn.Embedding(sparse=True)``) take the same
steps with the same results as the dense gradient they stand for: each is coalesced in place
(``p.grad = p.grad.coalesce()``: duplicate indices summed, as the dense gradient sums them), and
the division, the finiteness check and the norm run on its values (an implicit zero adds nothing
to a norm and stays zero when divided); clipping scales them through
``torch.nn.utils.clip_grads_with_norm_``. Whether a model has sparse gradients is decided once per
parameter, at the first window its gradient is seen (a gradient keeps that layout unless the model
changes, e.g. an embedding's ``sparse`` flag flipped mid-run); a model without them keeps the dense
path, which tests no layout per step. With fp16 the GradScaler unscales sparse gradients itself
(``GradScaler.unscale_`` works on their values, CPU and CUDA).

The finiteness check without a norm is the fused check behind ``GradScaler.unscale_``
(``torch._amp_foreach_non_finite_check_and_unscale_``) with a scale of exactly 1.0: one op over
every gradient, its answer left on the device until the window's one host read.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["WindowGradients", "exact_reciprocal"]


def exact_reciprocal(x: float) -> bool:
    """Whether ``x`` is a power of two in ``[1, 2**126]``: ``1 / x`` is then exact in float32 and
    multiplying a value by it is bitwise dividing it by ``x`` (:meth:`WindowGradients.nonfinite_flag`)."""
    m, e = math.frexp(x)
    return m == 0.5 and 1 <= e <= 127


class WindowGradients:
    """The trainable parameters of one engine and what their gradients look like at a window's end.

    Args:
        params: the parameters whose gradients a window accumulates (``requires_grad``).

    Attributes:
        params: those parameters, in order.
        unseen: parameters whose gradient's layout no window has shown yet.
        sparse: some parameter's gradient is sparse COO (see :meth:`strided`).
        nbytes: the gradients' size in bytes when dense (what a data-parallel all-reduce moves).
    """

    __slots__ = ("params", "unseen", "sparse", "nbytes", "fused_checks", "_found_inf", "_inverses")

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.unseen = list(params)
        self.sparse = False
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        #: the last finiteness check took every gradient in its one fused op (False before the first
        #: check and after one fell back to the norm): the next may divide them in it (:meth:`nonfinite_flag`)
        self.fused_checks = False
        self._found_inf: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}
        self._inverses: dict[tuple[torch.device, float], Tensor] = {}  # 1 / divide_by, float32, per device

    def strided(self) -> list[Tensor]:
        """The window's gradients as strided tensors: a dense gradient itself, a sparse COO one's values.

        A sparse gradient is first coalesced in place (``p.grad`` is replaced), so its values
        ``(nnz, *dense dims)`` hold each index once: dividing them divides the gradient, and
        their L2 norm is the norm of the dense gradient (duplicates summed before squaring).
        Parameters whose gradient appears for the first time are looked at once here, and
        set ``sparse`` if their gradient is sparse; after that a dense model need not come here
        (the engine takes ``p.grad`` directly while ``sparse`` and ``unseen`` are both empty; a
        parameter that never gets a gradient stays watched: ~0.2 us a window for a few of them).
        """
        if self.unseen:
            first = [p for p in self.unseen if p.grad is not None]  # first gradients (rare after the first window)
            if first:
                self.sparse = self.sparse or any(p.grad.is_sparse for p in first)  # type: ignore[union-attr]
                self.unseen = [p for p in self.unseen if p.grad is None]
            if not self.sparse:
                return [p.grad for p in self.params if p.grad is not None]
        grads = []
        for p in self.params:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                if not g.is_coalesced():
                    g = p.grad = g.coalesce()
                g = g._values()
            grads.append(g)
        return grads

    def nonfinite_flag(self, grads: list[Tensor], divide_by: float = 1.0) -> tuple[Tensor | None, Tensor | None]:
        """A 0-dim tensor telling whether every gradient is finite, in one fused op (no norm), unread.

        ``grads``: strided tensors (a sparse gradient's values, see :meth:`strided`).
        ``divide_by``: a power of two in ``[1, 2**126]`` (:func:`exact_reciprocal`) the gradients are
        divided by in the same op: it multiplies them by ``1 / divide_by``, exact in float32, so each
        value is bitwise what ``torch._foreach_div_(grads, divide_by)`` gives (both correctly rounded;
        a float16/bfloat16 division is that product too), and it is finite exactly when the value
        before was (the check reads the values it scales: ``divide_by >= 1`` overflows nothing). Pass
        it only when :attr:`fused_checks` is True for these same gradients (the fused op checks each
        gradient as it goes: one it cannot take would leave the ones before it divided; raised then).
        Returns ``(flag, found)``: ``found`` is the fused check's buffer (``flag`` is a view of it:
        nonzero when a value is not finite; the caller zeroes it then), or ``None`` when the flag
        is a total norm (not finite when a value is not). No gradients: ``(None, None)``.
        Gradients on several devices, or of dtypes the fused check does not take, fall back to the norm.
        """
        if not grads:
            return None, None
        device = grads[0].device
        bufs = self._found_inf[device] if device in self._found_inf else None  # (no call: per window)
        if bufs is None:
            found = torch.zeros(1, device=device)
            bufs = self._found_inf[device] = (found, torch.ones(1, device=device), found.view(()))
        found, one, flag = bufs  # found stays 0 until a check finds a non-finite value; flag: its 0-dim view
        inverse = one
        if divide_by != 1.0:
            inverse = self._inverses.get((device, divide_by))  # type: ignore[assignment]
            if inverse is None:  # a loader's windows share a few sizes
                if len(self._inverses) >= 16:
                    self._inverses.clear()
                inverse = self._inverses[(device, divide_by)] = torch.full((1,), 1.0 / divide_by, device=device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        except RuntimeError:  # mixed devices or dtypes the fused check does not take
            self.fused_checks = False
            if divide_by != 1.0:
                raise
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).to(device) for g in grads])), None
        self.fused_checks = True
        return flag, found

    def finite(self, grads: list[Tensor]) -> bool:
        """Whether every gradient is finite: :meth:`nonfinite_flag` read at once (one host read)."""
        flag, found = self.nonfinite_flag(grads)
        if flag is None:
            return True
        value = flag.item()
        if found is not None:
            if value:
                found.zero_()
            return not value
        return math.isfinite(value)
