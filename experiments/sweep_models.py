"""Tiny random-weight models of transformers, timm and torchvision for the architecture sweep.

Each builder returns a :class:`Case`: a float64 model in evaluation mode (float32 where
the model's own code cannot run in float64: ``FLOAT32_ONLY``, or where a float64 check
would not fit in memory: ``TORCHVISION_FLOAT32``; in training mode without randomness where
its backward pass runs only in training mode: ``TRAIN_MODE``), one
small batch, targets and the loss a user would train it with. Nothing is
downloaded: configurations are the libraries' defaults shrunk generically
(width 32, 2 layers, 2 heads, vocabulary 99, images of 32 or 64 pixels).
A model that cannot be built or trained that way raises :class:`Unavailable`
with the reason, and the sweep records it as skipped.
"""

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from experiments.sweep_fixes import (  # the per-model settings
    BUILD_DEFAULTS,
    BUILD_FIXES,
    DEFAULT_FLOAT64,
    FIXES,
    FLOAT32_ONLY,
    IMAGE,
    NOT_INSTALLABLE,
    STEP_FIXES,
    TRAIN_MODE,
)
from experiments.sweep_wrappers import DraftLogits, Logits

BATCH = 4
LENGTH = 7  # not the batch size: a coincidence of sizes must not pass for exactness
VOCABULARY = 99
TIMM_IMAGE = 32
# Transformers of timm that take these (ViT, DeiT, CaiT, EVA, XCiT, ...) are built this
# narrow: at their smallest named width one check takes tens of seconds of CPU time.
TIMM_NARROW = {"embed_dim": 32, "depth": 2, "num_heads": 2}

# transformers' tasks, in the order a model type takes its first: one head per architecture.
TASKS = (
    ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),  # encoders: before their causal head
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
)

# A default configuration's keys and the tiny values they get (only keys the config has).
WIDTH_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "embedding_size",
              "d_embed", "word_embed_proj_dim", "emb_dim")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers",
              "decoder_layers", "num_decoder_layers", "num_encoder_layers")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
             "decoder_attention_heads")
TINY = {
    **dict.fromkeys(WIDTH_KEYS, 32),
    **dict.fromkeys(LAYER_KEYS, 2),
    **dict.fromkeys(HEAD_KEYS, 2),
    "num_key_value_heads": 1,
    "head_dim": 16,
    "d_kv": 16,
    "rotary_dim": 8,
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
                     "d_inner"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts"), 4),
    "num_experts_per_tok": 2,
    **dict.fromkeys(("max_position_embeddings", "n_positions"), 64),
    "hidden_size_global": 32,  # BLT's local encoder and decoder: the global model's width
    "vocab_size": VOCABULARY,
    "decoder_vocab_size": VOCABULARY,  # Marian: its own, tied to the shared embedding of vocab_size
    "image_size": IMAGE,
    "patch_size": 4,
    "num_channels": 3,
    "num_labels": 5,
    # Per-layer inputs (Gemma 3n, Gemma 4): a table of vocabulary x layers x this width.
    "vocab_size_per_layer_input": VOCABULARY,
    "hidden_size_per_layer_input": 8,
    "audio_hidden_size": 32,  # a speech head's input: the audio encoder's width
}
# Sizes whose 0 turns their part off (a Gemma 4 assistant has no per-layer inputs): kept at 0.
OFF_AT_ZERO = ("hidden_size_per_layer_input", "vocab_size_per_layer_input")
# Sizes a default leaves ``None`` and the model then fails on (``head_dim ** -0.5``,
# ``heads // None``, an embedding of ``None`` rows): the tiny one.
NONE_FILLED = {"head_dim": 16, "num_key_value_heads": 1, "vocab_size": VOCABULARY}
# Multi-head latent attention (DeepSeek-V2/V3 and their kin): the rotary part of a head is
# ``head_dim`` too, the query's head is its rotary and plain parts together, and keys and
# values have as many heads as queries.
LATENT_ATTENTION = {"num_key_value_heads": 2, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "qk_head_dim": 16, "v_head_dim": 8, "head_dim": 8}
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
              "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")
SUB_CONFIGS = ("text_config", "vision_config", "encoder", "decoder")


class Unavailable(Exception):
    """The model cannot be built or trained from a generic tiny configuration (the reason)."""


@dataclass
class Case:
    """One model as a user trains it: ``loss_fn(model(*inputs), targets)``."""

    model: nn.Module
    inputs: Tuple[torch.Tensor, ...]
    targets: torch.Tensor
    loss_fn: Callable
    detail: str  # the class and the configuration's notable choices


def logits_loss(logits, targets):
    """Mean cross-entropy over every position (or example) of the batch."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _staged(values: dict) -> dict:
    """Staged vision models (``depths`` a list): one block per stage, widths and heads follow."""
    stages = len(values["depths"])
    kwargs = {"depths": [1] * stages}
    if isinstance(values.get("hidden_sizes"), list):  # multiples of 32: BiT's 32 groups
        kwargs["hidden_sizes"] = [32 * 2 ** i for i in range(len(values["hidden_sizes"]))]
    if isinstance(values.get("embed_dim"), list):
        kwargs["embed_dim"] = [16 * 2 ** i for i in range(len(values["embed_dim"]))]
    for key in ("num_heads", "num_attention_heads"):
        if isinstance(values.get(key), list):
            kwargs[key] = [1] * len(values[key])
    return kwargs


def _one_layer_per_kind(values: dict) -> dict:
    """Hybrid stacks (attention and state-space, sliding, dense and sparse layers): the first
    layer of each kind, with every per-layer setting cut alike (see :func:`_per_layer`)."""
    depth = values.get("num_hidden_layers")
    if depth is None:  # a depth read from its block pattern (NemotronH)
        depth = len(values.get("layers_block_type") or ())
    overrides = {int(i): layer for i, layer in (values.get("per_layer_config") or {}).items()}
    per_layer = [key for key, value in values.items() if isinstance(value, list) and len(value) == depth]
    # A layer's kind: its named types (strings, flags) and its own overrides; sizes are not kinds.
    named = [key for key in per_layer if all(isinstance(v, (str, bool)) or v is None for v in values[key])]
    if not named and not overrides:  # one kind: TINY's depth, lists of one entry per layer cut alike
        if not per_layer or depth <= TINY["num_hidden_layers"]:
            return {}
        kept = list(range(TINY["num_hidden_layers"]))
    else:
        kinds = [(tuple(values[key][i] for key in named), repr(overrides.get(i))) for i in range(depth)]
        kept = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())
    kwargs = _per_layer(values, per_layer, kept, depth, overrides)
    if values.get("num_hidden_layers") is not None:
        kwargs["num_hidden_layers"] = len(kept)
    if values.get("num_kv_shared_layers") == depth:  # an assistant reading all its keys and values
        kwargs["num_kv_shared_layers"] = len(kept)
    return kwargs


def _per_layer(values: dict, per_layer: List[str], kept: List[int], depth: int, overrides: dict) -> dict:
    """The per-layer settings of the layers ``kept``: lists of one entry per layer (sizes
    shrunk as ``TINY`` shrinks the global one, layer indices renumbered), lists of layer
    indices (``index_layers``, ``mlp_only_layers``) and ``per_layer_config`` renumbered."""
    new = {old: i for i, old in enumerate(kept)}
    kwargs = {}
    for key in per_layer:
        cut = [values[key][i] for i in kept]
        size = TINY.get(key.replace("_per_layer", ""))
        if key.endswith("_layers") and all(isinstance(v, int) and v in new for v in cut):
            cut = [new[v] for v in cut]  # a layer's source layer (kv_source_layers)
        elif isinstance(size, int) and all(isinstance(v, int) for v in cut):
            cut = [size] * len(cut)
        kwargs[key] = cut
    for key, value in values.items():
        if ("layer" in key and key not in per_layer and isinstance(value, list) and value
                and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < depth for v in value)):
            kwargs[key] = [new[v] for v in value if v in new]
    if overrides:
        kwargs["per_layer_config"] = {new[i]: {**layer, **_tiny_sizes(layer)} for i, layer in overrides.items()
                                      if i in new}
    return kwargs


def _tiny_sizes(values: dict) -> dict:
    """``TINY``'s sizes for the integer settings ``values`` has (a layer's overrides); as many
    key-value heads as heads where the layer had as many."""
    sizes = {key: TINY[key] for key, value in values.items()
             if key in TINY and isinstance(value, int) and not isinstance(value, bool)}
    if "num_key_value_heads" in sizes and values["num_key_value_heads"] == values.get("num_attention_heads"):
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    if isinstance(values.get("kv_lora_rank"), int):  # latent attention's sizes (dots.3)
        sizes.update({key: tiny for key, tiny in LATENT_ATTENTION.items()
                      if key in values and key != "num_key_value_heads"})
    return sizes


def _derived_sizes(values: dict, kwargs: dict) -> dict:
    """Sizes a validator ties to the shrunk ones: Mamba-2's ``head_dim`` from the expanded width
    and its heads, Mamba heads that split the expanded width (Bamba, GraniteMoeHybrid), and
    ``None`` sizes the model needs (``NONE_FILLED``)."""
    tiny = {**values, **kwargs}
    derived = {key: size for key, size in NONE_FILLED.items() if key in values and values[key] is None}
    if isinstance(values.get("expand"), int) and isinstance(values.get("num_heads"), int):  # Mamba-2
        derived.update(head_dim=tiny["hidden_size"] * values["expand"] // tiny["num_heads"], n_groups=1,
                       state_size=8, chunk_size=8, time_step_rank=8)
    if isinstance(values.get("mamba_n_heads"), int) and "mamba_d_ssm" not in values:  # Bamba, Granite
        derived.update(mamba_d_head=16, mamba_n_heads=tiny["hidden_size"] * values["mamba_expand"] // 16,
                       mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8)
    return derived


def _for_head(config, head: type):
    """The configuration ``head`` takes: a composite one's sub-configuration of that class
    (the text model of Qwen3.5, Llama 4, Emu3; MusicGen's decoder), else ``config``."""
    wanted = getattr(head, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for value in vars(config).values():
        if isinstance(value, wanted):
            return value
    return config


def _tokens(values: dict) -> dict:
    """Special tokens inside the tiny vocabulary, and a padding token where it is ``None``."""
    kwargs = {key: 2 for key in TOKEN_KEYS
              if isinstance(values.get(key), int) and values[key] >= VOCABULARY}
    if values.get("pad_token_id") is None and "pad_token_id" in values:
        kwargs["pad_token_id"] = 0
    return kwargs


def _routing(values: dict, experts: int, aliases: dict) -> dict:
    """Routing that fits ``experts``: top-2 where the default routes to more experts than
    there are or leaves the number to the checkpoint (DeepSeek-V2's ``None``), and grouped
    experts (a group scored by its best 2) in 2 groups, the best one kept, where the
    default's groups would hold fewer than 2. Under the names the config serializes them
    by (its ``attribute_map``: Kimi's and Bailing's ``num_experts_per_token``)."""
    top_k, groups = (aliases.get(key, key) for key in ("num_experts_per_tok", "n_group"))
    kwargs = {}
    if top_k in values and (values[top_k] is None or values[top_k] > experts):
        kwargs[top_k] = TINY["num_experts_per_tok"]
    if isinstance(values.get(groups), int) and experts // values[groups] < 2:
        kwargs.update({groups: 2, "topk_group": 1})
    return kwargs


def _latent_attention(values: dict) -> dict:
    """``LATENT_ATTENTION``'s sizes; where the default's ``head_dim`` is the query's whole
    head (Mistral 4: its rotary part follows as ``partial_rotary_factor`` of it), that."""
    kwargs = {key: tiny for key, tiny in LATENT_ATTENTION.items() if isinstance(values.get(key), int)}
    if values.get("head_dim") == values["qk_rope_head_dim"] + values.get("qk_nope_head_dim", 0) != \
            values["qk_rope_head_dim"]:
        kwargs["head_dim"] = LATENT_ATTENTION["qk_head_dim"]
    return kwargs


def _tiny_kwargs(config) -> dict:
    values = config.to_dict()
    kwargs = {key: tiny for key, tiny in TINY.items() if isinstance(values.get(key), int)
              and not isinstance(values.get(key), bool) and not (key in OFF_AT_ZERO and values[key] == 0)}
    aliases = getattr(config, "attribute_map", None) or {}
    experts = [kwargs.get(key, values.get(aliases.get(key, key)))
               for key in ("num_experts", "num_local_experts", "n_routed_experts")]
    experts = [count for count in experts if isinstance(count, int) and count > 0]
    if experts:
        kwargs.update(_routing(values, min(experts), aliases))
    if isinstance(values.get("qk_rope_head_dim"), int):
        kwargs.update(_latent_attention(values))
    if isinstance(values.get("depths"), list):  # widths and depth follow the stages
        for key in ("hidden_size", "num_layers", "num_hidden_layers"):
            kwargs.pop(key, None)
        kwargs.update(_staged(values))
    elif "num_hidden_layers" in kwargs or isinstance(values.get("layers_block_type"), list):
        kwargs.update(_one_layer_per_kind(values))
    if isinstance(values.get("window_size"), int) and isinstance(values.get("depths"), list):
        # Window attention (Swin): windows of 2x2 tokens that divide every stage's grid
        # (16, 8, 4, 2 tokens a side at 64 pixels; several windows per image but the last).
        kwargs.update(window_size=2, image_size=2 * IMAGE)
    if isinstance(values.get("num_groups"), int):
        kwargs["num_groups"] = 2  # group norms (BiT) at tiny widths
    kwargs.update(_tokens(values))
    kwargs.update(_derived_sizes(values, kwargs))
    for key in [*SUB_CONFIGS, *(k for k in values if k.endswith("_config"))]:  # audio_config, ...
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            kwargs[key] = type(sub)(**{**sub.to_dict(), **_tiny_kwargs(sub),
                                       **BUILD_FIXES.get(sub.model_type, {})}).to_dict()
    return kwargs


def tiny_config(model_type: str):
    """The default configuration of ``model_type``, shrunk (see ``TINY``)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type, **BUILD_DEFAULTS.get(model_type, {}))
    values = {key: value for key, value in default.to_dict().items()
              if key not in ("out_features", "out_indices", "stage_names")}  # follow the stages
    # The experts of mixture-of-experts blocks as a loop of products: the grouped ones
    # (transformers' default) refuse float64, which the references need.
    return type(default)(**{**values, **_tiny_kwargs(default), "experts_implementation": "eager",
                            **BUILD_FIXES.get(model_type, {}), **FIXES.get(model_type, {}),
                            **STEP_FIXES.get(model_type, {})})


def transformers_architectures() -> Dict[str, Tuple[str, str]]:
    """``{model_type: (task, class name)}``: each architecture with its first head in ``TASKS``."""
    from transformers.models.auto import modeling_auto

    found = {}
    for task, mapping in TASKS:
        for model_type, names in getattr(modeling_auto, mapping).items():
            name = names[0] if isinstance(names, (tuple, list)) else names
            found.setdefault(model_type, (task, name))
    return dict(sorted(found.items()))


def _assistant_inputs(config, tokens: torch.Tensor, dtype) -> Tuple[tuple, List[str]]:
    """What transformers' generation passes an assistant (``AssistantDraftCandidateGenerator``
    of ``generation/candidate_generator.py``): the target model's token embeddings beside its
    last hidden states, and its ``shared_kv_states``. The target: the assistant's own text
    configuration at its ``backbone_hidden_size``, computing its own keys and values, with its
    first head of ``TASKS``; random weights, no gradient (the assistant is what trains)."""
    import transformers

    text = config.get_text_config()
    target_config = type(text)(**{**text.to_dict(), "num_kv_shared_layers": 0,
                                  "hidden_size": config.backbone_hidden_size})
    target = getattr(transformers, transformers_architectures()[text.model_type][1])(target_config)
    target = target.to(dtype).eval()
    with torch.no_grad():
        output = target(input_ids=tokens, output_hidden_states=True, return_shared_kv_states=True,
                        use_cache=False)
        embeds = torch.cat([target.get_input_embeddings()(tokens), output.hidden_states[-1]], -1)
    kinds = sorted(output.shared_kv_states)
    return (embeds, *[t for kind in kinds for t in output.shared_kv_states[kind]]), kinds


def transformers_case(model_type: str) -> Case:
    """A tiny ``model_type`` with its first head of ``TASKS``, random weights, float64."""
    import transformers

    task, name = transformers_architectures()[model_type]
    try:
        head = getattr(transformers, name)
        config = _for_head(tiny_config(model_type), head)
        model = head(config)
    except Exception as error:  # noqa: BLE001 - any failure of a generic config is a skip
        if isinstance(error, ImportError) and model_type in NOT_INSTALLABLE:
            raise Unavailable(f"build: needs {NOT_INSTALLABLE[model_type]}") from error
        raise Unavailable(f"build: {type(error).__name__}: {str(error)[:300]}") from error
    dtype = torch.float32 if model_type in FLOAT32_ONLY else torch.float64
    model = model.to(dtype).train(model_type in TRAIN_MODE)
    if hasattr(model, "set_default_language"):  # X-MOD: one adapter per language
        model.set_default_language(config.languages[0])
    tokens = torch.randint(3, VOCABULARY, (BATCH, LENGTH))
    if task == "image-classification" and model.main_input_name == "pixel_values":
        inputs, names = _images(model, config, dtype)
    elif task == "image-classification" and "pixel_values" in _arguments(model):
        # Text about an image (ShieldGemma 2): the image's tokens, then the text's.
        image_tokens = torch.full((BATCH, config.mm_tokens_per_image), config.image_token_index)
        text = torch.randint(3, config.boi_token_index, (BATCH, LENGTH))
        images = _images(model, config.vision_config, dtype)[0][0]
        inputs, names = (torch.cat([image_tokens, text], 1), images), ["input_ids", "pixel_values"]
    elif (task == "seq2seq" and hasattr(config, "audio_length_per_tok")
          and {"input_features"} <= _arguments(model) and "decoder_input_ids" not in _arguments(model)):
        # Speech added to the text, a group of frames per token (Voxtral Realtime): mel features.
        frames = config.audio_length_per_tok * LENGTH
        features = torch.randn(BATCH, config.audio_config.num_mel_bins, frames, dtype=dtype)
        inputs, names = (tokens, features), ["input_ids", "input_features"]
    elif "shared_kv_states" in _arguments(model) and hasattr(config, "backbone_hidden_size"):
        inputs, kinds = _assistant_inputs(config, tokens, dtype)  # an assistant (Gemma 4's)
        detail = f"{name} ({task}); a tiny target's hidden states and keys and values ({', '.join(kinds)})"
        return _with_targets(DraftLogits(model, kinds), inputs, detail)
    elif task == "seq2seq":
        inputs = (tokens, torch.randint(3, VOCABULARY, (BATCH, LENGTH - 2)))
        names = ["input_ids", "decoder_input_ids"]
    else:
        inputs, names = (tokens,), ["input_ids"]
    default_dtype = torch.float64 if model_type in DEFAULT_FLOAT64 else None
    detail = f"{name} ({task})" + (f"; float32: {FLOAT32_ONLY[model_type]}" if model_type in FLOAT32_ONLY else "")
    detail += f"; training mode: {TRAIN_MODE[model_type]}" if model_type in TRAIN_MODE else ""
    return _with_targets(Logits(model, names, default_dtype), inputs, detail)


def _arguments(model: nn.Module) -> set:
    return set(inspect.signature(model.forward).parameters)


def _images(model: nn.Module, config, dtype) -> Tuple[tuple, List[str]]:
    """Images of ``config``'s ``image_size`` (``IMAGE`` where it is not one side); SigLIP 2's
    as its vision tower takes them: flattened patches, their mask and each image's grid."""
    size = getattr(config, "image_size", IMAGE)
    size = size if isinstance(size, int) else IMAGE
    channels = getattr(config, "num_channels", 3)
    if "spatial_shapes" in _arguments(model):
        vision = config.vision_config
        patch, grid = vision.patch_size, int(vision.num_patches ** 0.5)
        patches = torch.randn(BATCH, grid * grid, vision.num_channels * patch * patch, dtype=dtype)
        mask = torch.ones(BATCH, grid * grid, dtype=torch.long)
        shapes = torch.tensor([[grid, grid]] * BATCH)
        return (patches, mask, shapes), ["pixel_values", "pixel_attention_mask", "spatial_shapes"]
    return (torch.randn(BATCH, channels, size, size, dtype=dtype),), ["pixel_values"]


def _perturb(model: nn.Module):
    """Add noise to every parameter: zero initializations (timm's and torchvision's last
    BatchNorm of a residual block, layer scales) would leave whole branches with a gradient
    of exactly zero, which the comparison would pass without testing anything."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.1)


def _with_targets(model: nn.Module, inputs: tuple, detail: str) -> Case:
    """The case with random class targets shaped as ``model``'s logits; checks it trains."""
    _perturb(model)
    try:
        logits = model(*inputs)
        targets = torch.randint(0, logits.shape[-1], logits.shape[:-1])
        logits_loss(logits, targets).backward()
    except Exception as error:  # noqa: BLE001
        raise Unavailable(f"plain step: {type(error).__name__}: {str(error)[:300]}") from error
    if not all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None):
        raise Unavailable("plain step: gradients with NaN or Inf at this tiny configuration")
    model.zero_grad(set_to_none=True)
    return Case(model, inputs, targets, logits_loss, detail)


# timm and torchvision: one model per family (module), the smallest by its number of parameters.
SMALL_WORDS = ("400mf", "atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "mini", "small", "s_", "_s", "b0",
               "18", "t_", "_t")


def _candidates(names: List[str], limit=10) -> List[str]:
    def rank(name):
        hits = [i for i, word in enumerate(SMALL_WORDS) if word in name]
        return (min(hits) if hits else len(SMALL_WORDS), len(name), name)

    return sorted(names, key=rank)[:limit]


def _smallest(names: List[str], build: Callable[[str], nn.Module]) -> str:
    """The name among a few likely ones whose model has the fewest parameters (built on ``meta``)."""
    sizes = {}
    for name in _candidates(names):
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sizes[name] = sum(p.numel() for p in build(name).parameters())
        except Exception:  # noqa: BLE001,S112 - a candidate that does not build is not chosen
            continue
    if not sizes:  # builders computing their widths with tensors (RegNet) cannot run on meta:
        for name in _candidates(names):  # the likeliest small name that builds on the CPU
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    build(name)
                return name
            except Exception:  # noqa: BLE001,S112
                continue
        raise Unavailable("no model of the family builds with random weights")
    return min(sizes, key=sizes.get)


def timm_families() -> List[str]:
    import timm

    return list(timm.list_modules())


def timm_case(family: str, model_name: str = "") -> Case:
    """The smallest model of timm's module ``family`` (or ``model_name``), random weights."""
    import timm

    name = model_name or _smallest(timm.list_models(module=family),
                                   lambda n: timm.create_model(n, pretrained=False))
    errors = []
    default = timm.get_pretrained_cfg(name, allow_unregistered=True)
    default_size = tuple(getattr(default, "input_size", (3, 224, 224)) or (3, 224, 224))[-1]
    # Narrow at the smallest size the model takes where it is more than TIMM_IMAGE (DeepSeek's
    # ViT: patches of 14, 126 px at least), before its full width: 412M parameters at 546 px
    # killed the worker for memory.
    least = tuple(getattr(default, "min_input_size", None) or (TIMM_IMAGE,))[-1]
    narrow = ((({"img_size": least, **TIMM_NARROW}, least),) if least > TIMM_IMAGE else ())
    attempts = (({"img_size": TIMM_IMAGE, **TIMM_NARROW}, TIMM_IMAGE), *narrow,
                ({"img_size": TIMM_IMAGE}, TIMM_IMAGE), ({}, TIMM_IMAGE), ({}, default_size))
    for kwargs, size in attempts:
        try:
            model = timm.create_model(name, pretrained=False, num_classes=5, **kwargs).double().eval()
            images = torch.randn(BATCH, 3, size, size, dtype=torch.float64)
            shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
            return _with_targets(model, (images,), f"{name}({shown}) at {size}px")
        except (Unavailable, TypeError, RuntimeError, AssertionError, ValueError) as error:
            errors.append(str(error)[:200])
    raise Unavailable(f"{name}: " + " | ".join(errors))


def torchvision_families() -> Dict[str, List[str]]:
    import torchvision

    families = {}
    for name in torchvision.models.list_models(module=torchvision.models):
        module = torchvision.models.get_model_builder(name).__module__.rsplit(".", 1)[-1]
        families.setdefault(module, []).append(name)
    return families


# Families whose smallest named model is large (ViT-B/16 86M parameters, MaxViT-T 31M: past
# the time limit in float64), built small with the library's own class and constructor
# arguments. VGG's cannot be: its classifier is fixed at 25088x4096 and 4096x4096 (120M).
TORCHVISION_SMALL = {
    "vision_transformer": ("VisionTransformer", {"image_size": IMAGE, "patch_size": 8, "num_layers": 2,
                                                 "num_heads": 2, "hidden_dim": 32, "mlp_dim": 64}),
    "maxvit": ("MaxVit", {"input_size": (IMAGE, IMAGE), "stem_channels": 16, "partition_size": 2,
                          "block_channels": [16, 32], "block_layers": [1, 1], "head_dim": 8,
                          "stochastic_depth_prob": 0.0}),
}


# Families that cannot be built small (VGG's classifier takes 512 x 7 x 7 features, its
# adaptive pool's fixed output, whatever the image) and whose check in float64 would hold
# about 14 GB (a float64 copy of VGG-11 is 1.1 GB; the check holds the model, a reference copy
# and its rows, a prepared copy with its gradient and sums): built and checked in float32
# (``check_model(..., dtype=torch.float32)``, the float32 tolerance) at the smallest batch
# that has a spread between examples, 2: peak 7.3 GB, 10 s of CPU time (9.1 GB at batch 4).
TORCHVISION_FLOAT32 = {"vgg": 2}


def torchvision_case(family: str, model_name: str = "") -> Case:
    """The smallest classification model of torchvision's module ``family`` (or ``model_name``)."""
    import torchvision

    if family in TORCHVISION_FLOAT32 and not model_name:
        name = _smallest(torchvision_families()[family], lambda n: torchvision.models.get_model(n, num_classes=5))
        model = torchvision.models.get_model(name, num_classes=5).float().eval()
        images = torch.randn(TORCHVISION_FLOAT32[family], 3, IMAGE, IMAGE)
        return _with_targets(model, (images,), f"{name} at {IMAGE}px; float32 at batch "
                             f"{TORCHVISION_FLOAT32[family]}: a float64 check of its 129M parameters holds about 14 GB")
    if family in TORCHVISION_SMALL and not model_name:
        cls, kwargs = TORCHVISION_SMALL[family]
        model = getattr(torchvision.models, cls)(num_classes=5, **kwargs).double().eval()
        images = torch.randn(BATCH, 3, IMAGE, IMAGE, dtype=torch.float64)
        shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        return _with_targets(model, (images,), f"{cls}({shown}) at {IMAGE}px")
    name = model_name or _smallest(torchvision_families()[family],
                                   lambda n: torchvision.models.get_model(n, num_classes=5))
    errors = []
    for size in (32, 64, 224, 299):
        try:
            model = torchvision.models.get_model(name, num_classes=5).double().eval()
            images = torch.randn(BATCH, 3, size, size, dtype=torch.float64)
            return _with_targets(model, (images,), f"{name} at {size}px")
        except Unavailable as error:
            errors.append(str(error)[:200])
    raise Unavailable(f"{name}: " + " | ".join(errors))


def build(library: str, name: str) -> Case:
    """The case of ``name`` in ``library`` (``transformers``, ``timm``, ``torchvision``);
    ``family:model`` picks a model of a timm or torchvision family."""
    torch.manual_seed(0)
    family, _, model_name = name.partition(":")
    if library == "transformers":
        return transformers_case(name)
    if library == "timm":
        return timm_case(family, model_name)
    if library == "torchvision":
        return torchvision_case(family, model_name)
    raise ValueError(f"unknown library {library!r}")


def all_names() -> Dict[str, List[str]]:
    """Every architecture of the full sweep, per library."""
    return {
        "transformers": list(transformers_architectures()),
        "timm": timm_families(),
        "torchvision": sorted(torchvision_families()),
    }


# A handful per library for --quick (the test suite): seconds each.
QUICK = {
    # albert: a shared layer group; lfm2_moe: short convolutions and attention, experts top-2
    "transformers": ["llama", "gpt2", "bert", "t5", "vit", "albert", "lfm2_moe"],
    "timm": ["resnet:resnet10t", "vision_transformer:vit_tiny_patch16_224"],
    "torchvision": ["mobilenetv3:mobilenet_v3_small", "squeezenet:squeezenet1_1"],
}
