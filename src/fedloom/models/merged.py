"""LoRA updates merged into the frozen weights.

Some federated LoRA methods move part of the update out of the adapter and into the
frozen weight it adapts: FedEx-LoRA folds the residual mean_k(B_k A_k) − mean(B) mean(A)
in every round, FLoRA the whole stacked update Σ_k p_k B_k A_k before re-initializing the
adapter. The adapted layer then computes

    h = (W0 + s M) x + s B A x,        s = alpha / r (PEFT's scaling of the layer)

where M, in the units of a product B A (so that the server needs no s), is a tensor of the
adapter ``Params``: ``<module>.merged.weight`` beside ``<module>.lora_A.weight`` and
``<module>.lora_B.weight``. It is not trained; it travels down with the adapter and is
saved in its checkpoints, so a global adapter with merged updates is scored, saved and
reloaded like any other. ``FedModel.set_params`` writes W0 + s M into the layer (W0 for a
layer whose M is absent), keeping W0 aside from the first merge on: a federation that never
merges pays nothing. M is (out, in) like B A on every layer; a layer that stores its weight
as (in, out) (GPT-2's ``Conv1D``, PEFT's ``fan_in_fan_out``) gets its transpose.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

#: the name suffix of a merged update (beside ``.lora_A.weight`` and ``.lora_B.weight``)
MERGED = ".merged.weight"


def merged_name(module: str) -> str:
    """The ``Params`` name of the merged update of the adapted ``module``."""
    return module + MERGED


class MergedWeights:
    """The frozen weights of a model's LoRA layers, set to W0 + s M on request."""

    def __init__(self, layers: Mapping[str, LoraLayer]) -> None:
        #: clean module name -> its LoRA layer (the module whose base weight M changes)
        self.layers = dict(layers)
        self._original: dict[str, torch.Tensor] = {}

    def transposed(self, module: str) -> bool:
        """Whether ``module``'s frozen weight is stored (in, out) (PEFT's ``fan_in_fan_out``:
        GPT-2's ``Conv1D``), the transpose of a product B A."""
        return bool(getattr(self.layers[module], "fan_in_fan_out", False))

    def shape(self, module: str) -> torch.Size:
        """The shape of ``module``'s merged update M: (out, in), as B A's."""
        shape = self.weight(module).shape
        return torch.Size(reversed(shape)) if self.transposed(module) else shape

    def weight(self, module: str) -> torch.Tensor:
        """The frozen weight W of ``module``'s LoRA layer (what merging changes)."""
        return cast(torch.Tensor, self.base(module).weight)

    def base(self, module: str) -> nn.Module:
        return self.layers[module].get_base_layer()

    def check(self, merged: Mapping[str, torch.Tensor]) -> None:
        """A ValueError naming the first merged update without a LoRA layer or of the wrong
        shape."""
        for name, delta in merged.items():
            module = name.removesuffix(MERGED)
            if module not in self.layers:
                raise ValueError(f"adapter {name}: no LoRA layer {module!r} to merge into")
            if delta.shape != self.shape(module):
                raise ValueError(
                    f"adapter {name}: shape {tuple(delta.shape)} != "
                    f"{tuple(self.shape(module))} (the frozen weight's)"
                )

    @torch.no_grad()
    def apply(self, merged: Mapping[str, torch.Tensor]) -> None:
        """Set every LoRA layer's frozen weight to W0 + s M (``merged``: ``Params`` entries
        named by :func:`merged_name`), or back to W0 where its M is absent."""
        modules = {name.removesuffix(MERGED): delta for name, delta in merged.items()}
        for module in modules.keys() | self._original.keys():
            weight = self.weight(module)
            original = self._original.setdefault(module, weight.detach().clone())
            if module in modules:
                layer = self.layers[module]
                scale = cast(dict[str, float], layer.scaling)[layer.active_adapters[0]]
                delta = modules[module].to(original)
                weight.copy_(original + scale * (delta.T if self.transposed(module) else delta))
            else:
                weight.copy_(original)
                del self._original[module]
