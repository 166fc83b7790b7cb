"""NNModel: a classifier around an ``nn.Module``, trained through the Trainer."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from nnx_es.checkpoint import load_component, verify_checkpoint
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.result import RunResult, load_result
from nnx_es.storage import BlobStore
from nnx_es.trainer import Trainer

__all__ = ["NNModel"]


class NNModel:
    """Wraps ``net`` (logits out, shape ``(N, C)``) for training and prediction.

    Args:
        net: the module; ``net(x)`` maps ``(N, *features)`` float32 to ``(N, C)`` logits.
    """

    def __init__(self, net: nn.Module) -> None:
        if not isinstance(net, nn.Module):
            raise ConfigError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        self.net = net
        self.run: RunResult | None = None

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.net.parameters()

    def train(
        self,
        train_loader: Iterable[Any],
        val_loader: Iterable[Any] | None = None,
        *,
        epochs: int,
        optimizer: Optimizer | Callable[[Iterable[nn.Parameter]], Optimizer] | None = None,
        loss: Any = None,
        **trainer_kwargs: Any,
    ) -> RunResult:
        """Train with a :class:`~nnx_es.trainer.Trainer` and return the run.

        optimizer: an optimizer over ``self.parameters()``, or a factory called
        with them; default ``Adam(lr=1e-3)``. loss: default ``CrossEntropyLoss``.
        With a ``val_loader`` and no ``monitor``, the monitor is ``val_loss``
        (mode min), so the run has a BEST; ``metrics`` defaults to
        ``("accuracy",)``. Other keyword arguments go to :class:`~nnx_es.trainer.Trainer`.
        """
        if val_loader is not None:
            trainer_kwargs.setdefault("monitor", "val_loss")
        trainer_kwargs.setdefault("metrics", ("accuracy",))
        if optimizer is None:
            optimizer = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        elif not isinstance(optimizer, Optimizer):
            optimizer = optimizer(self.net.parameters())
        trainer = Trainer(self.net, optimizer, loss if loss is not None else nn.CrossEntropyLoss(), **trainer_kwargs)
        self.run = trainer.fit(train_loader, val_loader, epochs=epochs)
        return self.run

    def load(self, run_dir: str | Path, which: str = "best") -> int:
        """Load the weights of the run's BEST or LAST checkpoint (hash-verified); return its epoch.

        Raises:
            ResumeError: the run has no such checkpoint.
            CorruptCheckpointError: a manifest or blob does not verify.
        """
        result = load_result(run_dir)
        pointer = {"best": result.best, "last": result.last}.get(which)
        if which not in ("best", "last"):
            raise ConfigError(f"which must be 'best' or 'last', got {which!r}")
        if pointer is None:
            raise ResumeError(f"run {result.run_id!r} has no committed {which.upper()} checkpoint")
        store = BlobStore(Path(run_dir) / "blobs")
        manifest = verify_checkpoint(store, pointer.manifest)
        self.net.load_state_dict(load_component(store, manifest, "model"))
        return pointer.epoch

    @torch.no_grad()
    def predict_proba(self, x: Tensor) -> Tensor:
        """Class probabilities: ``x`` of shape ``(N, *features)`` float -> ``(N, C)`` float32, rows sum to 1.

        Runs in eval mode without gradients, on the model's device; returns on CPU.
        """
        if not isinstance(x, Tensor):
            x = torch.as_tensor(x, dtype=torch.float32)
        was = self.net.training
        self.net.eval()
        try:
            device = next((p.device for p in self.net.parameters()), torch.device("cpu"))
            logits = self.net(x.to(device))
        finally:
            self.net.train(was)
        if logits.dim() != 2:
            raise ValueError(f"predict_proba expects logits of shape (N, C), the net returned {tuple(logits.shape)}")
        return torch.softmax(logits.float(), dim=-1).cpu()

    def predict(self, x: Tensor) -> Tensor:
        """Predicted class ids, shape ``(N,)`` int64."""
        return self.predict_proba(x).argmax(dim=-1)
