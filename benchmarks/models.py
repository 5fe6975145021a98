"""The benchmark's models: architecture, inputs, targets, loss and default batch size."""

import dataclasses
import functools

import torch
from torch import nn


def make_mlp(width=512):
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 10),
    )


def make_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(9216, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def make_resnet18():
    """torchvision's resnet18 for 10 classes, in eval mode (BatchNorm with running statistics).

    Its in-place ReLU and ``out += identity`` break BackPACK's own hooks;
    ``cgn.prepare_model`` (:func:`extended_copy`) gives it the package's hooks,
    which allow them.
    """
    from torchvision.models import resnet18

    return resnet18(num_classes=10).eval()


def make_vgg11():
    """torchvision's ``vgg11`` for 10 classes (random weights, 133M parameters): its classifier's
    first weight has 25088 x 4096 = 103M elements whatever the image size (the adaptive pool's
    output is fixed), so the quantities' work after the backward pass, per element, dominates."""
    from torchvision.models import vgg11

    return vgg11(num_classes=10).eval()


def make_big_embedding():
    """The benchmark GPT with a vocabulary of 50257 and width 768 (GPT-2 small's token embedding,
    38.6M elements, untied head of the same size) in 1 block: large parameters read by a small
    forward pass."""
    from experiments.models import GPT

    return GPT(BIG_VOCABULARY, GPT_CONTEXT, width=768, heads=12, layers=1)


BIG_VOCABULARY = 50257


def big_tokens(n, device):
    return torch.randint(0, BIG_VOCABULARY, (n, GPT_CONTEXT), device=device)


def make_gpt2_small():
    """Hugging Face's GPT-2 small (``benchmark_realistic.make_gpt2``: 124M parameters, tied
    head), for ``benchmark_cpu_ratio --phases`` at sequence 256 (``gpt2_tokens``), batch 8."""
    from benchmarks.benchmark_realistic import make_gpt2

    return make_gpt2()


def gpt2_tokens(n, device):
    return torch.randint(0, BIG_VOCABULARY, (n, 256), device=device)


def make_gpt():
    """The GPT-style language model of the architectures issue (``experiments.models.GPT``).

    4 pre-norm blocks of width 128 with 4 heads (attention from ``nn.Linear``),
    sequence 64, vocabulary 96.
    """
    from experiments.models import GPT

    return GPT(GPT_VOCABULARY, GPT_CONTEXT, width=128, heads=4, layers=4)


GPT_VOCABULARY, GPT_CONTEXT = 96, 64


class _Logits(nn.Module):
    """``model(input_ids).logits`` of a Hugging Face causal language model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def make_moe():
    """A Mixtral-style mixture of experts (``transformers``' ``MixtralForCausalLM``, random
    weights): 2 layers of width 128, 8 experts of width 256, top-2 routing, 4 heads,
    sequence 64 and vocabulary 96 as the GPT's; its blocks are recomputed per example
    (``extensions/fallback/blocks.py``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=GPT_VOCABULARY, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=GPT_CONTEXT)
    return _Logits(MixtralForCausalLM(config).eval())


def make_opt():
    """A small OPT (``transformers``' ``OPTForCausalLM``, random weights): 4 layers of width 128,
    4 heads, ``fc1``/``fc2`` of width 512, sequence 64 and vocabulary 96 as the GPT's. Its decoder
    layer flattens the tokens to ``[N*T, C]`` before ``final_layer_norm``, ``fc1`` and ``fc2``, so
    those get their rows from the layer's block (``extensions/fallback/windows.py``)."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=GPT_VOCABULARY, hidden_size=128, ffn_dim=512, num_hidden_layers=4,
                       num_attention_heads=4, max_position_embeddings=GPT_CONTEXT, word_embed_proj_dim=128,
                       dropout=0.0, attention_dropout=0.0)
    return _Logits(OPTForCausalLM(config).eval())


def make_qwen2_moe():
    """A Qwen2-MoE block's model (``transformers``' ``Qwen2MoeForCausalLM``, random weights) of
    the Mixtral-style one's sizes (2 layers of width 128, 8 experts of width 256, top-2, 4
    heads, sequence 64, vocabulary 96) with a shared expert of width 256 and its sigmoid gate
    beside the routed experts, on the flattened tokens (``extensions/fallback/shared.py``)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=GPT_VOCABULARY, hidden_size=128, intermediate_size=256, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, max_position_embeddings=GPT_CONTEXT)
    return _Logits(Qwen2MoeForCausalLM(config).eval())


class _ImageLogits(nn.Module):
    """``model(pixel_values).logits`` of a Hugging Face image classifier."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).logits


def make_swin():
    """A small Swin (``transformers``' ``SwinForImageClassification``, random weights): 64x64
    images in patches of 4, width 48, 2 blocks in each of 3 stages (heads 2, 4, 8), windows
    of 4x4 tokens (16, then 4, then 1 per image); its window attention runs on
    ``[N*W, 16, C]``, so each block is recomputed per example (``extensions/fallback/regroup.py``)."""
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(image_size=64, patch_size=4, embed_dim=48, depths=[2, 2, 2], num_heads=[2, 4, 8],
                        window_size=4, num_labels=10, drop_path_rate=0.0)
    return _ImageLogits(SwinForImageClassification(config).eval())


def make_swinv2():
    """The Swin above as SwinV2 (``transformers``' ``Swinv2ForImageClassification``): its attention
    reads ``logit_scale`` in its own forward and adds a bias from an MLP (2 -> 512 -> heads) on a
    table without the batch (``extensions/fallback/broadcast.py``)."""
    from transformers import Swinv2Config, Swinv2ForImageClassification

    config = Swinv2Config(image_size=64, patch_size=4, embed_dim=48, depths=[2, 2, 2], num_heads=[2, 4, 8],
                          window_size=4, num_labels=10, drop_path_rate=0.0)
    return _ImageLogits(Swinv2ForImageClassification(config).eval())


def make_timm_swin():
    """The Swin above as timm builds it (``swin_tiny_patch4_window7_224``'s class at 64x64, width 48,
    2 blocks in each of 3 stages, heads 2, 4, 8, windows of 4x4): its ``WindowAttention`` reads its
    relative position table itself (``extensions/fallback/windows.py``)."""
    import timm

    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=10, img_size=64,
                             embed_dim=48, depths=(2, 2, 2), num_heads=(2, 4, 8), window_size=4).eval()


def make_timm_swinv2():
    """The Swin above as timm's SwinV2 (``swinv2_tiny_window8_256``'s class at 64x64, width 48, 2 blocks
    in each of 3 stages, heads 2, 4, 8, windows of 4x4): its ``WindowAttention`` passes its ``qkv``'s
    weight to ``F.linear`` itself, with a bias it concatenates (``extensions/fallback/windows.py``).
    Its blocks' post-norms' weights set to 1: timm starts them at 0 (``_init_respostnorm``), so that every
    gradient inside the blocks is exactly 0 at initialization, which no trained model has."""
    import timm

    model = timm.create_model("swinv2_tiny_window8_256", pretrained=False, num_classes=10, img_size=64,
                              embed_dim=48, depths=(2, 2, 2), num_heads=(2, 4, 8), window_size=4).eval()
    with torch.no_grad():
        for stage in model.layers:
            for block in stage.blocks:
                block.norm1.weight.fill_(1.0)
                block.norm2.weight.fill_(1.0)
    return model


def make_torchvision_swin():
    """The Swin above as torchvision builds it (``SwinTransformer``, patches of 4, width 48, 2 blocks
    in each of 3 stages, heads 2, 4, 8, windows of 4x4): ``ShiftedWindowAttention`` takes and
    returns ``[N, H, W, C]`` and uses its ``qkv`` and ``proj`` through ``F.linear`` (the fallback)."""
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(patch_size=[4, 4], embed_dim=48, depths=[2, 2, 2], num_heads=[2, 4, 8],
                           window_size=[4, 4], stochastic_depth_prob=0.0, num_classes=10).eval()


def classification_loss(reduction):
    return nn.CrossEntropyLoss(reduction=reduction)


def token_loss(reduction):
    """Per-token cross-entropy; an example's own loss (``"none"``) is the mean over its tokens."""
    from experiments.models import TokenCrossEntropy

    return TokenCrossEntropy(reduction, per_token="mean")


def images(*shape):
    return lambda n, device: torch.randn(n, *shape, device=device)


def tokens(n, device):
    return torch.randint(0, GPT_VOCABULARY, (n, GPT_CONTEXT), device=device)


def classes(n, device):
    return torch.randint(0, 10, (n,), device=device)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    make: object  # () -> nn.Module
    inputs: object  # (batch size, device) -> inputs
    batch_size: int  # unless --batch-size says otherwise
    targets: object = classes  # (batch size, device) -> targets
    #: ``reduction -> loss module``: ``"mean"`` trains, ``"none"`` gives each example's loss.
    loss: object = classification_loss


MODELS = {
    "mlp": ModelSpec(make_mlp, images(1, 28, 28), 128),
    "cnn": ModelSpec(make_cnn, images(1, 28, 28), 128),
    "resnet18": ModelSpec(make_resnet18, images(3, 32, 32), 64),
    "gpt": ModelSpec(make_gpt, tokens, 32, targets=tokens, loss=token_loss),
    "vgg11": ModelSpec(make_vgg11, images(3, 32, 32), 2),
    "big-embedding": ModelSpec(make_big_embedding, big_tokens, 8, targets=big_tokens, loss=token_loss),
    "gpt2-small": ModelSpec(make_gpt2_small, gpt2_tokens, 8, targets=gpt2_tokens, loss=token_loss),
    "moe": ModelSpec(make_moe, tokens, 32, targets=tokens, loss=token_loss),
    "qwen2-moe": ModelSpec(make_qwen2_moe, tokens, 32, targets=tokens, loss=token_loss),
    "swin": ModelSpec(make_swin, images(3, 64, 64), 32),
    "swinv2": ModelSpec(make_swinv2, images(3, 64, 64), 32),
    "timm-swin": ModelSpec(make_timm_swin, images(3, 64, 64), 32),
    "timm-swinv2": ModelSpec(make_timm_swinv2, images(3, 64, 64), 32),
    "torchvision-swin": ModelSpec(make_torchvision_swin, images(3, 64, 64), 32),
    "opt": ModelSpec(make_opt, tokens, 32, targets=tokens, loss=token_loss),
}


def model_and_batch(spec, batch_size, device):
    """The seeded model of ``spec`` and a random batch of ``batch_size`` inputs and targets."""
    torch.manual_seed(0)
    model = spec.make().to(device)
    return model, spec.inputs(batch_size, device), spec.targets(batch_size, device)


def mlp_of_width(width):
    return dataclasses.replace(MODELS["mlp"], make=functools.partial(make_mlp, width))
