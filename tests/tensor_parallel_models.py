"""The models of ``test_tensor_parallel``'s jobs: an MLP with a frozen and an unused layer, an
attention block, and a Megatron-style block on sequences with torchtitan's split
(:func:`sequence_plan`). Plain torch modules: the spawned processes import them by name."""

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """Two split layers, a plain one, a frozen one and an unused one."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(5, 8), nn.Linear(8, 4), nn.Linear(4, 3)
        self.frozen = nn.Linear(5, 3).requires_grad_(False)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))) + self.frozen(x)


class Attention(nn.Module):
    """One self-attention block on ``[N, L, 8]``, 2 heads; the heads are inferred from the
    projections' width, so that each process runs its own heads when they are split."""

    def __init__(self, width=8, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        # No key bias: its gradient is 0 (softmax ignores it), ParamGradRatio's rows rounding noise.
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width, bias=False), nn.Linear(width, width)
        self.o, self.head = nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x):
        n, length, _ = x.shape
        q, k, v = (layer(x).view(n, length, -1, self.head_dim).transpose(1, 2)
                   for layer in (self.q, self.k, self.v))
        mixed = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, length, -1)
        return self.head(torch.tanh(self.o(mixed)).mean(1))


class Sequence(nn.Module):
    """A Megatron-style block on ``[N, 4, 6]`` sequences, split as torchtitan's llama plan
    (:func:`plan`): a plain layer on whole sequences, then a LayerNorm under SequenceParallel,
    ``fc1`` Colwise, ``fc2`` Rowwise back to positions, a residual, an RMSNorm under
    SequenceParallel, the head Colwise gathered whole (the loss not parallel), the logits'
    mean over positions classified; an unused layer."""

    def __init__(self, width=8, hidden=16, classes=4):
        super().__init__()
        self.embed = nn.Linear(6, width)
        self.block = nn.ModuleDict({"norm": nn.LayerNorm(width), "fc1": nn.Linear(width, hidden),
                                    "fc2": nn.Linear(hidden, width)})
        self.norm, self.head, self.unused = nn.RMSNorm(width), nn.Linear(width, classes), nn.Linear(2, 2)

    def forward(self, x):
        x = self.positions(self.embed(x))
        block = self.block
        x = x + block["fc2"](torch.tanh(block["fc1"](block["norm"](x))))
        return self.head(self.norm(x)).mean(1)

    def positions(self, x):
        """The residual stream: whole, or this process's positions where the plan says so."""
        cut = getattr(self, "cut", None)
        return x if cut is None else cut(x)


class Cut(nn.Module):
    """An identity whose input PrepareModuleInput cuts along positions (``Shard(1)``)."""

    def forward(self, x):
        return x


def sequence_plan(model, mesh, loss_parallel=False):
    """torchtitan's layout: the residual stream split along positions (``Shard(1)``) from
    the block on; norms under SequenceParallel; fc2's output reduce-scattered to positions;
    the head's input gathered (``input_layouts=Shard(1)``) and its output whole, or with
    ``loss_parallel`` split along the classes (a DTensor for ``loss_parallel()``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model.cut = Cut()
    first, last = ("block.mlp.gate_proj", "block.mlp.up_proj"), "block.mlp.down_proj"  # LlamaBlock's
    if "mlp" not in model.block:
        first, last = ("block.fc1",), "block.fc2"
    return parallelize_module(model, mesh, {
        "cut": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                  use_local_output=True),
        "block.norm": SequenceParallel(), **{name: ColwiseParallel(input_layouts=Shard(1)) for name in first},
        last: RowwiseParallel(output_layouts=Shard(1)), "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                use_local_output=not loss_parallel)})


class LlamaBlock(Sequence):
    """:class:`Sequence` with transformers' own Llama classes (a tiny config, random weights):
    ``LlamaRMSNorm`` before a ``LlamaMLP`` (gate, up, down projections, SiLU) with a residual,
    and as the final norm; split by :func:`sequence_plan` as torchtitan splits Llama."""

    def __init__(self, width=8, hidden=16, classes=4):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        nn.Module.__init__(self)
        config = LlamaConfig(hidden_size=width, intermediate_size=hidden, hidden_act="silu", num_attention_heads=2,
                             num_key_value_heads=2)
        self.embed = nn.Linear(6, width)
        self.block = nn.ModuleDict({"norm": LlamaRMSNorm(width), "mlp": LlamaMLP(config)})
        self.norm, self.head, self.unused = LlamaRMSNorm(width), nn.Linear(width, classes), nn.Linear(2, 2)
        for norm in (self.block["norm"], self.norm):
            nn.init.normal_(norm.weight, 1.0, 0.3)  # not all ones

    def forward(self, x):
        x = self.positions(self.embed(x))
        x = x + self.block["mlp"](self.block["norm"](x))
        return self.head(self.norm(x)).mean(1)
