"""Test cases as data: models, losses, reductions and batch sizes.

Every quantity is checked against its reference in ``cockpit_gradnoise.references``
over the product of ``MODELS`` x ``REDUCTIONS`` x ``BATCH_SIZES``, in float64.
"""

import contextlib
import copy
import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from cockpit_gradnoise import Cockpit, prepare_model, references
from cockpit_gradnoise.check import reference_contributions

import torch
from backpack import extend
from torch import nn

from tests import library_models, matrix_models
from tests.layer_models import Attention, embedding_padding, padded_tokens, timm_convnext, timm_vit
from tests.models import GPT, NanoGPT, ThreeUses, TokenCrossEntropy, hf_gpt2


class WithUnusedAndFrozen(nn.Module):
    """An MLP with a frozen first layer and a layer the forward pass never uses."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 5)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 3)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3))

    def forward(self, x):
        return self.body(self.frozen(x))


def mlp(bias=True):
    return nn.Sequential(nn.Linear(6, 5, bias=bias), nn.ReLU(), nn.Linear(5, 3, bias=bias))


def cnn(bias=True):
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=bias),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 3 * 3, 3, bias=bias),
    )


def grouped_cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, groups=2, padding=1),
        nn.Tanh(),
        nn.ConvTranspose2d(4, 2, 2, groups=2, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 10 * 10, 3),
    )


def conv_one_position():
    """A convolution with one output position: per-example norms by Gram matrices."""
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Tanh(), nn.Linear(4, 3))


def conv1d():
    return nn.Sequential(nn.Conv1d(2, 3, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4, 3))


def embedding():
    return nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Tanh(), nn.Linear(3 * 4, 3))


def resnet18():
    """torchvision's ResNet-18 in eval mode (BatchNorm with running statistics)."""
    from torchvision.models import resnet18 as torchvision_resnet18

    return torchvision_resnet18(num_classes=3).eval()


def layernorm_sequence():
    """Linear along a sequence (BackPACK's extra dimensions), then LayerNorm."""
    return nn.Sequential(
        nn.Linear(4, 6), nn.LayerNorm(6), nn.GELU(), nn.Flatten(), nn.Linear(3 * 6, 3)
    )


def groupnorm_cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 3),
    )


def rmsnorm_mlp():
    return nn.Sequential(nn.Linear(6, 5), nn.RMSNorm(5), nn.Tanh(), nn.Linear(5, 3))


VOCABULARY, CONTEXT, WIDTH, HEADS = 11, 4, 8, 2


def gpt(blocks="gpt"):
    return GPT(VOCABULARY, CONTEXT, WIDTH, HEADS, layers=2, blocks=blocks)


def classification_losses(reduction):
    return nn.CrossEntropyLoss(reduction=reduction), nn.CrossEntropyLoss(reduction="none")


def token_losses(reduction):
    return TokenCrossEntropy(reduction), TokenCrossEntropy("none", per_token=reduction)


@dataclass(frozen=True)
class ModelCase:
    """A model and how to draw its inputs (targets are 3 classes)."""

    name: str
    make: Callable[[], nn.Module]
    inputs: Callable[[int], torch.Tensor]
    #: Batch sizes to test (``BATCH_SIZES`` if ``None``): fewer for large models.
    batch_sizes: Optional[Tuple[int, ...]] = None
    #: Longest sum inside one example's contribution (output positions, sequence
    #: steps): it rounds too, see ``tests.helpers.sd_rtol``.
    inner_terms: int = 1
    #: ``reduction -> (loss_fn, per_example_loss)``; ``targets(n)`` draws targets.
    losses: Callable = classification_losses
    targets: Callable[[int], torch.Tensor] = lambda n: torch.randint(0, 3, (n,))
    #: Sets the per-example gradients ``{name: [N, *shape]}`` that are zero by
    #: structure to exactly 0 (an attention key's bias), where the loop computes
    #: rounding noise; ``None`` if none are.
    known_zeros: Optional[Callable[[dict], None]] = None
    #: BatchNorm in training mode: examples interact, so the reference is each example's
    #: contribution through the batch (:func:`reference_gradients`), drawn with the
    #: random state of the tracked pass (dropout, stochastic depth).
    examples_interact: bool = False
    #: Random numbers drawn in the forward pass (stochastic depth), examples independent:
    #: the reference differentiates each example's loss through one pass of the batch
    #: (``check.reference_contributions``), from the tracked pass's random state.
    random_forward: bool = False


MODELS = [
    ModelCase("mlp", mlp, lambda n: torch.randn(n, 6)),
    ModelCase("mlp-nobias", lambda: mlp(bias=False), lambda n: torch.randn(n, 6)),
    ModelCase("cnn", cnn, lambda n: torch.randn(n, 2, 5, 5)),
    ModelCase("cnn-nobias", lambda: cnn(bias=False), lambda n: torch.randn(n, 2, 5, 5)),
    ModelCase("grouped-conv", grouped_cnn, lambda n: torch.randn(n, 2, 5, 5)),
    ModelCase("conv1d", conv1d, lambda n: torch.randn(n, 2, 9)),
    ModelCase("conv-one-position", conv_one_position, lambda n: torch.randn(n, 2, 3, 3)),
    ModelCase("embedding", embedding, lambda n: torch.randint(0, 10, (n, 3))),
    ModelCase("unused-frozen", WithUnusedAndFrozen, lambda n: torch.randn(n, 6)),
    ModelCase("layernorm-sequence", layernorm_sequence, lambda n: torch.randn(n, 3, 4)),
    ModelCase("groupnorm-cnn", groupnorm_cnn, lambda n: torch.randn(n, 2, 5, 5)),
    ModelCase("rmsnorm-mlp", rmsnorm_mlp, lambda n: torch.randn(n, 6)),
    ModelCase(
        "gpt",
        gpt,
        lambda n: torch.randint(0, VOCABULARY, (n, CONTEXT)),
        losses=token_losses,
        targets=lambda n: torch.randint(0, VOCABULARY, (n, CONTEXT)),
        inner_terms=CONTEXT,
    ),
    ModelCase(
        "transformer-encoder",
        lambda: gpt(blocks="encoder"),
        lambda n: torch.randint(0, VOCABULARY, (n, CONTEXT)),
        losses=token_losses,
        targets=lambda n: torch.randint(0, VOCABULARY, (n, CONTEXT)),
        inner_terms=CONTEXT,
    ),
    ModelCase("resnet18", resnet18, lambda n: torch.randn(n, 3, 32, 32), batch_sizes=(3,),
              inner_terms=32 * 32),
    # Other libraries' models, unmodified (tests/library_models.py; the fallback's issue 19).
    # Llama computes its RMSNorm in float32 even in a float64 model, also backwards: the
    # batch's gradient and c * g_i round alike only where c = 1/(N T) is a power of two.
    ModelCase(
        "hf-llama",
        lambda: library_models.llama(VOCABULARY, WIDTH, HEADS),
        lambda n: torch.randint(0, VOCABULARY, (n, CONTEXT)),
        batch_sizes=(2, 8),
        losses=token_losses,
        targets=lambda n: torch.randint(0, VOCABULARY, (n, CONTEXT)),
        inner_terms=CONTEXT,
    ),
    # position_ids (N, T) passed by the wrapper, so that wpe sees the batch.
    ModelCase(
        "hf-gpt2",
        lambda: library_models.gpt2(VOCABULARY, WIDTH, HEADS),
        lambda n: torch.randint(0, VOCABULARY, (n, CONTEXT)),
        batch_sizes=(2, 7),
        losses=token_losses,
        targets=lambda n: torch.randint(0, VOCABULARY, (n, CONTEXT)),
        inner_terms=CONTEXT,
    ),
    # Class token, position table and layer-scale gamma used directly: the fallback.
    ModelCase("timm-vit", library_models.timm_vit, lambda n: torch.randn(n, 2, 8, 8),
              batch_sizes=(2, 7), inner_terms=5),
    # Layers (issue 19): padding_idx, nn.MultiheadAttention converted by prepare_model,
    # subclasses of supported layers. Models in tests/layer_models.py.
    ModelCase("embedding-padding", embedding_padding, padded_tokens),
    ModelCase("multihead-attention", Attention, lambda n: torch.randint(0, 11, (n, 4)),
              batch_sizes=(2, 7), inner_terms=4 + 2),
    ModelCase("timm-convnext", timm_convnext, lambda n: torch.randn(n, 3, 32, 32),
              batch_sizes=(3,), inner_terms=8 * 8),
    ModelCase("timm-vit-16px", timm_vit, lambda n: torch.randn(n, 3, 16, 16), batch_sizes=(3,),
              inner_terms=4 * 4),
    # Training mode, examples independent: exact per example through the dropout and drop
    # path masks the tracked pass drew (the fallback replays the top module's and the
    # blocks' children).
    ModelCase("timm-vit-train", lambda: library_models.timm_vit(training=True),
              lambda n: torch.randn(n, 2, 8, 8), batch_sizes=(2, 7), inner_terms=5,
              random_forward=True),
    ModelCase("timm-convnext-train", library_models.timm_convnext_train,
              lambda n: torch.randn(n, 3, 32, 32), batch_sizes=(2, 7), inner_terms=8 * 8,
              random_forward=True),
]
REDUCTIONS = ["mean", "sum"]


def case_named(name: str) -> ModelCase:
    """The case of ``MODELS`` called ``name``."""
    return next(case for case in MODELS if case.name == name)
BATCH_SIZES = [2, 7, 64]
#: Where :func:`build` puts a problem's model and batch: the CPU, or the device that
#: ``CGN_TEST_DEVICE`` names (``benchmarks/gpu_check.sh`` runs the brute-force tests on a GPU,
#: on cases without random numbers in the forward pass: ``random_state`` is the CPU's).
DEVICE = torch.device(os.environ.get("CGN_TEST_DEVICE", "cpu"))


@dataclass
class Problem:
    """One built case: an extended model, losses and a batch."""

    model: nn.Module
    loss_fn: nn.Module
    per_example_loss: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    reduction: str
    #: The random state the tracked forward pass starts from (dropout masks).
    random_state: Optional[torch.Tensor] = None

    @property
    def names(self):
        """Names of the trainable parameters (Cockpit refuses frozen ones)."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    @property
    def params(self):
        return [p for p in self.model.parameters() if p.requires_grad]


@functools.lru_cache(maxsize=None)
def _prepared(case: ModelCase, dtype, seed, converter=False):
    """The seeded, prepared model of ``case`` and the random state after building it.

    Cached: BackPACK's converter takes seconds on a ResNet.
    """
    torch.manual_seed(seed)
    model = prepare_model(case.make().to(dtype), use_converter=converter)
    return model, torch.get_rng_state()


def build(case: ModelCase, n: int, reduction: str, dtype=torch.float64, seed=0,
          converter=False) -> Problem:
    """Seeded model and batch of ``n`` examples for ``case``.

    ``converter=True`` prepares it with BackPACK's converter and hooks on every module,
    which Cockpit's second-order quantities (its ``"full"`` configuration) need.
    """
    model, random_state = _prepared(case, dtype, seed, converter)
    model = copy.deepcopy(model).to(DEVICE)
    torch.set_rng_state(random_state)
    inputs = case.inputs(n)
    if inputs.is_floating_point():
        inputs = inputs.to(dtype)
    inputs, targets = inputs.to(DEVICE), case.targets(n).to(DEVICE)
    loss_fn, per_example_loss = case.losses(reduction)
    return Problem(
        model,
        extend(loss_fn),
        per_example_loss,
        inputs,
        targets,
        reduction,
        torch.get_rng_state(),
    )


def reference_gradients(case: ModelCase, problem: Problem) -> dict:
    """``{name: g_i stacked}`` with ``c g_i`` example ``i``'s contribution to ``param.grad``
    (``c = 1/N`` for the mean): a per-example loop, or where examples interact the
    contributions through the batch (``references.contributions_through_batch``), from
    the tracked pass's random state; structural zeros set to 0 (``case.known_zeros``)."""
    if case.examples_interact:
        torch.set_rng_state(problem.random_state)
        contributions = references.contributions_through_batch(
            problem.model, problem.loss_fn, problem.inputs, problem.targets
        )
        scale = 1.0 / len(problem.inputs) if problem.reduction == "mean" else 1.0
        grads = {name: x / scale for name, x in contributions.items()}
    elif case.random_forward:
        torch.set_rng_state(problem.random_state)
        contributions = reference_contributions(
            problem.model, (problem.inputs,), problem.targets, problem.loss_fn
        )
        scale = 1.0 / len(problem.inputs) if problem.reduction == "mean" else 1.0
        grads = {name: x / scale for name, x in contributions.items()}
    else:
        grads = references.per_example_gradients(
            problem.model, problem.per_example_loss, problem.inputs, problem.targets
        )
    if case.known_zeros is not None:
        case.known_zeros(grads)
    return grads


def run_step(
    problem: Problem, quantities, step=0, cockpit=None, optimizer=None,
    around_backward=contextlib.nullcontext,
):
    """One tracked backward pass of ``problem``, inside ``around_backward()``; returns the cockpit."""
    if cockpit is None:
        cockpit = Cockpit(problem.params, quantities=quantities)
    problem.model.zero_grad()
    outputs = problem.model(problem.inputs)
    loss = problem.loss_fn(outputs, problem.targets)
    info = {
        "batch_size": len(problem.inputs),
        "individual_losses": problem.per_example_loss(outputs, problem.targets),
        "loss": loss,
    }
    if optimizer is not None:
        info["optimizer"] = optimizer
    with cockpit(step, info=info):
        with around_backward():
            loss.backward(create_graph=cockpit.create_graph(step))
    return cockpit


# Tied parameters and embeddings applied without the batch dimension (issue 19) -----------
# nanoGPT's patterns with layers this branch supports (nn.LayerNorm, no c_attn bias): the
# head tied to wte, wpe(torch.arange(T)), T equal to a batch size; and one embedding used
# three times (T5-style). A tied parameter's contribution sums over its uses, each a sum over
# positions: up to (uses x positions) terms.
NANO_CONTEXT = 4


def nanogpt(bias=False, norm="torch"):
    return NanoGPT(VOCABULARY, NANO_CONTEXT, WIDTH, HEADS, layers=2, bias=bias, norm=norm)


def fused_key_bias_is_zero(grads):
    """The key third of every fused ``c_attn`` bias ``[q | k | v]``: softmax ignores it."""
    for name, g in grads.items():
        if name.endswith("c_attn.bias"):
            g[:, WIDTH : 2 * WIDTH] = 0.0


def _token_case(name, make, uses=1, batch_sizes=(2, NANO_CONTEXT, 7), known_zeros=None):
    return ModelCase(
        name, make, lambda n: torch.randint(0, VOCABULARY, (n, NANO_CONTEXT)),
        batch_sizes=batch_sizes, inner_terms=uses * NANO_CONTEXT, losses=token_losses,
        targets=lambda n: torch.randint(0, VOCABULARY, (n, NANO_CONTEXT)),
        known_zeros=known_zeros,
    )


MODELS.extend([
    _token_case("nanogpt-tied-arange", nanogpt, uses=2),
    _token_case("three-uses", lambda: ThreeUses(VOCABULARY, WIDTH), uses=3),
])


# The full nanoGPT patterns and Hugging Face's GPT-2, tied (issue 19) -----------------------
# nanoGPT's own LayerNorm class (the fallback), c_attn with its bias, the head tied to wte,
# wpe(torch.arange(T)); GPT2LMHeadModel with its default tie and Conv1D projections (native
# rule), position_ids of shape (1, T). The key third of every fused c_attn bias has an exactly
# zero gradient (softmax ignores it), which the extensions find (extensions/sums.py) and the
# reference is told (known_zeros). Batch sizes 2, T and 7, as the other tied cases.
FULL_NANOGPT_AND_GPT2 = [
    _token_case("nanogpt", lambda: nanogpt(bias=True, norm="nanogpt"), uses=2,
                known_zeros=fused_key_bias_is_zero),
    _token_case("hf-gpt2-tied", lambda: hf_gpt2(VOCABULARY, NANO_CONTEXT, WIDTH, HEADS, 2), uses=2,
                known_zeros=fused_key_bias_is_zero),
]
MODELS.extend(FULL_NANOGPT_AND_GPT2)


# torchvision's VisionTransformer, MobileNetV3, EfficientNet and ConvNeXt, BERT with padding
# (issue 19). Models in tests/matrix_models.py, built small from the libraries' own classes.
# Sequences: batch sizes 2, odd and equal to the sequence length (positions applied without
# the batch dimension: HF's position_ids (1, T)). Vision: eval mode exact per example; in
# training mode (BatchNorm on the batch, dropout and stochastic depth drawn) against the
# contributions through the batch. 16x16 images: the first convolution has 8x8 positions.
VIT_POSITIONS = 2 * 2 + 1  # patches and the class token
BERT_VOCABULARY, BERT_LENGTH = 13, 5
IMAGE = (3, 16, 16)
SWIN_POSITIONS = 4 * 4  # 4x4 patches of a 16x16 image, in windows of 2x2


def key_third_is_zero(suffix, width):
    """The key third of every fused ``[q | k | v]`` bias ending in ``suffix`` is zero."""
    def zero(grads):
        for name, g in grads.items():
            if name.endswith(suffix):
                g[:, width : 2 * width] = 0.0
    return zero


def key_bias_is_zero(grads):
    """BERT's ``key.bias``: softmax ignores a constant added to all of a query's scores."""
    for name, g in grads.items():
        if name.endswith("attention.self.key.bias"):
            g.zero_()


def _image_case(name, make, examples_interact=False, random_forward=False):
    return ModelCase(name, make, lambda n: torch.randn(n, *IMAGE), batch_sizes=(2, 7),
                     inner_terms=8 * 8, examples_interact=examples_interact,
                     random_forward=random_forward)


def masked_token_losses(reduction):
    return matrix_models.MaskedTokenLoss(reduction), matrix_models.MaskedTokenLoss("none")


MODELS.extend([
    ModelCase("torchvision-vit", matrix_models.torchvision_vit, lambda n: torch.randn(n, 3, 8, 8),
              batch_sizes=(2, VIT_POSITIONS), inner_terms=VIT_POSITIONS,
              known_zeros=key_third_is_zero("self_attention.in_proj_bias", 8)),
    ModelCase("hf-bert-padded",
              lambda: matrix_models.bert_classifier(BERT_VOCABULARY, BERT_LENGTH),
              lambda n: matrix_models.padded_bert_batch(n, BERT_VOCABULARY, BERT_LENGTH),
              batch_sizes=(2, BERT_LENGTH), inner_terms=BERT_LENGTH, known_zeros=key_bias_is_zero),
    ModelCase("hf-bert-masked-lm",
              lambda: matrix_models.bert_masked_lm(BERT_VOCABULARY, BERT_LENGTH),
              lambda n: matrix_models.masked_lm_batch(n, BERT_VOCABULARY, BERT_LENGTH)[0],
              batch_sizes=(2, BERT_LENGTH), inner_terms=2 * BERT_LENGTH,
              losses=masked_token_losses, known_zeros=key_bias_is_zero,
              targets=lambda n: matrix_models.masked_lm_batch(n, BERT_VOCABULARY, BERT_LENGTH)[1]),
    # ShiftedWindowAttention uses its qkv and proj Linears' parameters through F.linear (the
    # fallback); the key third of qkv.bias is zero by structure there too.
    ModelCase("torchvision-swin", matrix_models.torchvision_swin, lambda n: torch.randn(n, *IMAGE),
              batch_sizes=(2, 7), inner_terms=SWIN_POSITIONS,
              known_zeros=key_third_is_zero("attn.qkv.bias", matrix_models.SWIN_WIDTH)),
    _image_case("torchvision-mobilenet", matrix_models.torchvision_mobilenet),
    _image_case("torchvision-efficientnet", matrix_models.torchvision_efficientnet),
    _image_case("torchvision-convnext", matrix_models.torchvision_convnext),
    _image_case("torchvision-mobilenet-train",
                lambda: matrix_models.torchvision_mobilenet(training=True), examples_interact=True),
    _image_case("torchvision-efficientnet-train",
                lambda: matrix_models.torchvision_efficientnet(training=True),
                examples_interact=True),
    # No BatchNorm: exact per example, through the stochastic depth the tracked pass drew
    # (the fallback replays CNBlock's children: layer_scale is used before it).
    _image_case("torchvision-convnext-train",
                lambda: matrix_models.torchvision_convnext(training=True), random_forward=True),
])


# Hugging Face's T5 (issue 19): relative position buckets ([q, k] without the batch), the
# bias reused by every layer and met by the batch in torch.where (the encoder's padding mask)
# or in SDPA's addition (the decoder); the shared embedding used three times. Batch sizes 2,
# the decoder's length and the encoder's (q = k = B). T5's LayerNorm computes in float32
# even in a float64 model, also backwards, so the batch's gradient and c * g_i round alike
# only where c = 1/(N T) is a power of two (as hf-llama): odd batches, at the sum, are in
# tests/test_meetings.py.
T5_VOCABULARY, T5_LENGTH, T5_DECODER_LENGTH = 13, 8, 4
MODELS.append(ModelCase(
    "hf-t5", lambda: matrix_models.t5(T5_VOCABULARY, T5_DECODER_LENGTH),
    lambda n: matrix_models.t5_batch(n, T5_VOCABULARY, T5_LENGTH, T5_DECODER_LENGTH),
    batch_sizes=(2, T5_DECODER_LENGTH, T5_LENGTH), inner_terms=3 * T5_LENGTH, losses=token_losses,
    targets=lambda n: torch.randint(0, T5_VOCABULARY, (n, T5_DECODER_LENGTH)),
))
# In training mode: the dropout masks the tracked pass drew, per example (random_forward).
MODELS.append(ModelCase(
    "hf-t5-train", lambda: matrix_models.t5(T5_VOCABULARY, T5_DECODER_LENGTH, training=True),
    lambda n: matrix_models.t5_batch(n, T5_VOCABULARY, T5_LENGTH, T5_DECODER_LENGTH),
    batch_sizes=(2, T5_LENGTH), inner_terms=3 * T5_LENGTH, losses=token_losses,
    targets=lambda n: torch.randint(0, T5_VOCABULARY, (n, T5_DECODER_LENGTH)),
    random_forward=True,
))
