"""Model transforms: pruning, low-rank adapters, a new head, dynamic int8 quantization (issue 32).

Each transform is a recipe (plain-data constructor arguments), applied in place and recorded on the
net, in every checkpoint's topology, and as a ``model_transformed`` event; a resume or
``NNModel.load`` rebuilds the recorded transforms on a fresh net before loading its weights.
:mod:`nnx_es.transforms.core` says how, :mod:`nnx_es.transforms.kinds` what each does,
:mod:`nnx_es.transforms.callback` how one is applied during a run. Guide: docs/guides/export.md.
"""

from nnx_es.transforms.callback import TransformAt
from nnx_es.transforms.core import Transform, applications, apply_transforms, topology
from nnx_es.transforms.kinds import LoRA, LoRALinear, Prune, Quantize, ReplaceHead

__all__ = ["LoRA", "LoRALinear", "Prune", "Quantize", "ReplaceHead", "Transform", "TransformAt", "applications",
           "apply_transforms", "topology"]
