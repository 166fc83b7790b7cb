"""Small models whose recipes are recoverable (every constructor argument kept as an attribute of
the same name): what ``nnx-es init --model mlp`` scaffolds."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from nnx_es.errors import ConfigError

__all__ = ["MLP"]

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class MLP(nn.Module):
    """A multilayer perceptron: ``(N, in_features)`` float32 -> ``(N, out_features)`` logits.

    Args:
        in_features / out_features: input width, number of outputs (classes, or 1 for a binary head).
        hidden: widths of the hidden layers, in order.
        activation: ``"relu"``, ``"gelu"`` or ``"tanh"``, after each hidden layer.
        dropout: dropout probability after each activation (0: none).

    Raises:
        ConfigError: a width < 1, an unknown activation or a dropout outside [0, 1).
    """

    def __init__(self, in_features: int, out_features: int, hidden: Sequence[int] = (128,),
                 activation: str = "relu", dropout: float = 0.0) -> None:
        super().__init__()
        widths = [in_features, *hidden, out_features]
        if any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths):
            raise ConfigError(f"MLP widths must be ints >= 1, got in_features={in_features!r}, hidden={hidden!r}, "
                              f"out_features={out_features!r}")
        if activation not in _ACTIVATIONS:
            raise ConfigError(f"MLP activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"MLP dropout must be in [0, 1), got {dropout!r}")
        self.in_features, self.out_features = in_features, out_features
        self.hidden, self.activation, self.dropout = list(hidden), activation, float(dropout)
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-2], widths[1:-1]):
            layers += [nn.Linear(a, b), _ACTIVATIONS[activation]()]
            if dropout:
                layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(widths[-2], widths[-1]))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)  # type: ignore[no-any-return]
