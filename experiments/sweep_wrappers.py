"""The wrappers the architecture sweep puts around a model: positional inputs to its keywords,
its output to logits (split from ``experiments/sweep_models.py`` to keep each file short)."""

import inspect
import warnings
from typing import List

import torch
from torch import nn


class Logits(nn.Module):
    """``model(**inputs).logits``: positional inputs named for the wrapped model's forward."""

    def __init__(self, model, names, default_dtype=None):
        super().__init__()
        self.model, self.names, self.default_dtype = model, names, default_dtype
        self.use_cache = "use_cache" in inspect.signature(model.forward).parameters

    def forward(self, *inputs):
        kwargs = dict(zip(self.names, inputs))
        if self.use_cache:
            kwargs["use_cache"] = False
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.default_dtype or previous)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="For backward hooks to be called")
                output = self.model(**kwargs)
        finally:
            torch.set_default_dtype(previous)
        # A head whose output names its logits otherwise (PP-LCNet's ``last_hidden_state``
        # is its classifier's output): the first output, as with ``return_dict=False``.
        return output.logits if getattr(output, "logits", None) is not None else output[0]


class DraftLogits(Logits):
    """An assistant's logits (Gemma 4's): ``model(inputs_embeds=..., shared_kv_states=...)``,
    the keys and values of each of ``kinds`` (layer types) passed as positional tensors."""

    def __init__(self, model, kinds: List[str]):
        super().__init__(model, ["inputs_embeds", "shared_kv_states"])
        self.kinds = kinds

    def forward(self, inputs_embeds, *keys_values):
        shared = {kind: tuple(keys_values[2 * i:2 * i + 2]) for i, kind in enumerate(self.kinds)}
        return super().forward(inputs_embeds, shared)
