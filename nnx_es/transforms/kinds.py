"""The model transforms: magnitude pruning, low-rank adapters, a new head, dynamic int8 quantization.

Each is a :class:`~nnx_es.transforms.core.Transform` whose constructor arguments are plain data
(module paths as ``fnmatch`` patterns, counts, fractions), so it is its own recipe.

* :class:`Prune` -- L1 (magnitude) unstructured pruning with ``torch.nn.utils.prune``: masked (a
  ``weight_mask`` buffer beside ``weight_orig``: pruned weights stay zero while training) or permanent
  (the zeros written into ``weight`` once; training may move them again). Keeps every parameter.
* :class:`LoRA` -- low-rank adapters on chosen ``nn.Linear`` layers (Hu et al. 2021, "LoRA: Low-Rank
  Adaptation of Large Language Models"): ``y = W x + b + (alpha / r) * B A x`` with ``A`` (r, in)
  Kaiming-uniform and ``B`` (out, r) zero, so the adapted net starts as the net; the base is frozen.
* :class:`ReplaceHead` -- a new ``nn.Linear`` head in place of a ``nn.Linear`` (a new class count).
* :class:`Quantize` -- dynamic int8 quantization of ``nn.Linear`` layers for inference
  (``torch.ao.quantization.quantize_dynamic``: int8 weights, activations quantized per batch). No
  gradient flows through a quantized layer: a forward pass in training mode whose input needs one (a
  trainable layer feeds it) is refused rather than silently leaving that layer untrained.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn.utils import prune as torch_prune

from nnx_es.errors import ConfigError
from nnx_es.transforms.core import Transform, clone, match_modules

__all__ = ["LoRA", "LoRALinear", "Prune", "Quantize", "ReplaceHead"]

_PRUNABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _patterns(value: Any, what: str, *, required: bool) -> list[str] | None:
    if value is None and not required:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{what}: targets must be module paths (fnmatch patterns, e.g. ['0', 'encoder.*']), "
                          f"got {value!r}")
    return list(value)


def _parent(net: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The module holding submodule ``path`` and its attribute name there."""
    parent_path, _, leaf = path.rpartition(".")
    return (net.get_submodule(parent_path) if parent_path else net), leaf


class Prune(Transform):
    """Zero the ``amount`` fraction of smallest-magnitude entries of each target layer's ``parameter``.

    Args:
        targets: module paths (``fnmatch`` patterns) of ``Linear`` / ``Conv`` layers; None: every one.
        amount: fraction in (0, 1) of each layer's entries to prune (of those still unpruned, when the
            layer was pruned before: ``torch.nn.utils.prune`` composes the masks).
        permanent: False (default): masked -- ``<parameter>_orig`` (the same parameter object the optimizer
            holds) and a ``<parameter>_mask`` buffer, applied before every forward, so pruned entries stay
            zero; the state dict holds both. True: the zeros are written into the parameter once and the
            mask dropped (the state dict keeps its plain keys; training may move the zeros again).
        parameter: the parameter's name (default ``"weight"``).

    Raises:
        ConfigError: a bad argument (now), or targets that match nothing or no prunable layer (when applied;
            under :class:`~nnx_es.transforms.TransformAt`, when training begins).
    """

    keeps_parameters: ClassVar[bool] = True

    def __init__(self, targets: Sequence[str] | None = None, amount: float = 0.5, permanent: bool = False,
                 parameter: str = "weight") -> None:
        self.targets = _patterns(targets, "Prune", required=False)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 < amount < 1.0:
            raise ConfigError(f"Prune: amount must be a fraction in (0, 1), got {amount!r}")
        if not isinstance(permanent, bool):
            raise ConfigError(f"Prune: permanent must be True or False, got {permanent!r}")
        if not isinstance(parameter, str) or not parameter.isidentifier():
            raise ConfigError(f"Prune: parameter must be a parameter's name, got {parameter!r}")
        self.amount, self.permanent, self.parameter = float(amount), permanent, parameter

    def check(self, net: nn.Module) -> list[tuple[str, nn.Module]]:
        """The layers it prunes in ``net`` (path, layer); changes nothing.

        Raises:
            ConfigError: a target matches no submodule or no prunable layer, or a layer has no such tensor.
        """
        layers = match_modules(net, self.targets, _PRUNABLE, "Prune")
        for path, layer in layers:
            if not (isinstance(getattr(layer, self.parameter, None), Tensor)):
                raise ConfigError(f"Prune: layer {path!r} has no tensor {self.parameter!r}")
        return layers

    def apply(self, net: nn.Module) -> None:
        for _, layer in self.check(net):
            torch_prune.l1_unstructured(layer, self.parameter, amount=self.amount)
            if self.permanent:
                torch_prune.remove(layer, self.parameter)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + scaling * (x A^T) B^T``.

    ``x``: ``(..., in_features)`` -> ``(..., out_features)``, the base's dtype. ``lora_a``: ``(rank,
    in_features)``, Kaiming-uniform (as ``nn.Linear`` initializes a weight); ``lora_b``: ``(out_features,
    rank)``, zeros; ``scaling = alpha / rank`` (Hu et al. 2021).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, **factory))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, **factory))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + nn.functional.linear(nn.functional.linear(x, self.lora_a), self.lora_b) * self.scaling

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` computing the same function (``W + scaling * B A``): for an export."""
        out = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None,
                        device=self.base.weight.device, dtype=self.base.weight.dtype)
        with torch.no_grad():
            out.weight.copy_(self.base.weight + (self.lora_b @ self.lora_a) * self.scaling)
            if self.base.bias is not None:
                out.bias.copy_(self.base.bias)
        return out


class LoRA(Transform):
    """Low-rank adapters on the target ``nn.Linear`` layers; the base is frozen.

    Args:
        targets: module paths (``fnmatch`` patterns) of ``nn.Linear`` layers (required).
        rank: the adapters' rank r >= 1. alpha: the scale numerator (the update is ``alpha / r * B A``).
        freeze: ``"all"`` (default): every parameter of the net but the adapters' stops requiring a
            gradient (a head added *after* this transform trains); ``"targets"``: only the adapted
            layers' own weight and bias.

    Raises:
        ConfigError: a bad argument (now); targets that match nothing or a layer that is not a ``Linear``
            (when applied).
    """

    def __init__(self, targets: Sequence[str], rank: int = 4, alpha: float = 8.0, freeze: str = "all") -> None:
        self.targets = _patterns(targets, "LoRA", required=True)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigError(f"LoRA: rank must be an int >= 1, got {rank!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise ConfigError(f"LoRA: alpha must be a finite number > 0, got {alpha!r}")
        if freeze not in ("all", "targets"):
            raise ConfigError(f"LoRA: freeze must be 'all' or 'targets', got {freeze!r}")
        self.rank, self.alpha, self.freeze = rank, float(alpha), freeze

    def apply(self, net: nn.Module) -> None:
        layers = match_modules(net, self.targets, (nn.Linear,), "LoRA")
        if self.freeze == "all":
            for p in net.parameters():
                p.requires_grad_(False)
        for path, layer in layers:
            parent, leaf = _parent(net, path)
            setattr(parent, leaf, LoRALinear(layer, self.rank, self.alpha))  # type: ignore[arg-type]


class ReplaceHead(Transform):
    """Replace the ``nn.Linear`` at ``path`` with a new one of ``out_features`` outputs (same inputs).

    The new layer is initialized as ``nn.Linear`` does (from the global RNG) and trains; the old one's
    parameters leave the net, so build the optimizer after applying it.

    Raises:
        ConfigError: a bad argument (now); ``path`` names no ``nn.Linear`` (when applied).
    """

    def __init__(self, path: str, out_features: int, bias: bool = True) -> None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"ReplaceHead: path must be a submodule's dotted path (e.g. '2'), got {path!r}")
        if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 1:
            raise ConfigError(f"ReplaceHead: out_features must be an int >= 1, got {out_features!r}")
        if not isinstance(bias, bool):
            raise ConfigError(f"ReplaceHead: bias must be True or False, got {bias!r}")
        self.path, self.out_features, self.bias = path, out_features, bias

    def apply(self, net: nn.Module) -> None:
        try:
            old = net.get_submodule(self.path)
        except AttributeError:
            raise ConfigError(f"ReplaceHead: the net has no submodule {self.path!r}; its submodules: "
                              f"{[p for p, _ in net.named_modules() if p][:20]}") from None
        if not isinstance(old, nn.Linear):
            raise ConfigError(f"ReplaceHead: {self.path!r} is a {type(old).__name__}, not an nn.Linear")
        parent, leaf = _parent(net, self.path)
        setattr(parent, leaf, nn.Linear(old.in_features, self.out_features, bias=self.bias,
                                        device=old.weight.device, dtype=old.weight.dtype))


def _refuse_gradient_input(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook of a quantized layer: no gradient flows through it, so an input that needs one
    (training mode, a trainable layer before it) would leave that layer untrained without a word."""
    if module.training and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        raise ConfigError(
            f"a dynamically quantized layer ({type(module).__name__}) got an input that needs a gradient: no "
            "gradient flows through int8 quantization, so the trainable layers before it would never train; "
            "freeze them (requires_grad_(False)) or quantize after training")


def _unpruned(layer: nn.Module) -> nn.Module:
    """``layer`` with its pruning masks written into its weights (a copy when it has any): quantization copies
    a layer's hooks, and a masked-pruned layer's hook reads a mask buffer the quantized layer does not have."""
    hooks = [h for h in layer._forward_pre_hooks.values() if isinstance(h, torch_prune.BasePruningMethod)]
    if not hooks:
        return layer
    layer = clone(layer)
    for name in dict.fromkeys(h._tensor_name for h in hooks):
        torch_prune.remove(layer, name)
    return layer


class Quantize(Transform):
    """Dynamic int8 quantization of the target ``nn.Linear`` layers, for inference.

    Args:
        targets: module paths (``fnmatch`` patterns) of ``nn.Linear`` layers; None: every one.

    The quantized layers hold no parameters (int8 packed weights and their scale); the checkpoint keeps
    them as they are. Quantized nets are not exported (``torch.export`` and the ONNX exporter cannot
    trace ``torch.ao`` quantized layers in torch 2.13): export the float net.

    Raises:
        ConfigError: targets that match nothing or no ``Linear`` (when applied).
    """

    def __init__(self, targets: Sequence[str] | None = None) -> None:
        self.targets = _patterns(targets, "Quantize", required=False)

    def apply(self, net: nn.Module) -> None:
        from torch.ao.quantization import quantize_dynamic

        layers = match_modules(net, self.targets, (nn.Linear,), "Quantize")
        for path, layer in layers:
            parent, leaf = _parent(net, path)
            layer = _unpruned(layer)
            with warnings.catch_warnings():  # torch.ao's deprecation notices: the API works in torch 2.13
                warnings.simplefilter("ignore")
                quantized = quantize_dynamic(nn.Sequential(layer), {nn.Linear}, dtype=torch.qint8)[0]
            quantized.register_forward_pre_hook(_refuse_gradient_input)
            quantized.train(layer.training)
            setattr(parent, leaf, quantized)
