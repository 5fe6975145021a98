"""Per-model settings of the architecture sweep's builder (``experiments/sweep_models.py``).

What the generic shrink cannot reach, each with its reason: sizes of names the generic keys
miss, defaults that fail a configuration's own validator, sizes a model ties together, and
the models whose own code cannot run in float64. Every entry is the library's own
configuration or constructor argument; none replaces a module.
"""

IMAGE = 32  # pixels a side of the sweep's images (``sweep_models`` reads it from here)
# Configurations a generic shrink cannot reach (sub-configurations as plain dicts), or where
# the library's defaults do not build: DBRX reads ``attn_config.rope_theta`` and clamps with
# ``clip_qkv`` (its default ``None`` fails in ``torch.clamp``).
# Widths of their own names, which the generic keys miss (full size, the check of one such
# model ran past the time limit): EfficientNet's coefficients, Falcon-H1's Mamba mixer,
# LongCat-Flash's latent attention and experts, Perceiver's latents; the HF wrapper of timm:
# a small timm model.
FIXES = {
    "dbrx": {"attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"hidden_size": 32, "ffn_hidden_size": 64, "moe_num_experts": 4,
                            "moe_top_k": 2}},
    # Its default places dense layers first (3 of them: no MoE layer in 2) and 256 experts
    # in 8 groups; here every layer routes, 8 experts in 4 groups, top-2 of the best 2.
    "deepseek_v3": {"first_k_dense_replace": 0, "n_routed_experts": 8, "n_group": 4, "topk_group": 2},
    "efficientnet": {"width_coefficient": 0.25, "depth_coefficient": 0.25, "hidden_dim": 320,
                     "num_hidden_layers": 8},
    "falcon_h1": {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8,
                  "mamba_chunk_size": 8},
    "longcat_flash": {"ffn_hidden_size": 64, "q_lora_rank": 16, "kv_lora_rank": 16,
                      "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "head_dim": 8,
                      "v_head_dim": 8, "qk_head_dim": 16, "n_routed_experts": 4,
                      "zero_expert_num": 2, "moe_topk": 2, "expert_ffn_hidden_size": 32},
    "timm_wrapper": {"architecture": "resnet10t"},
    # 26 self-attention layers of 256 latents 1280 wide: the worker ran out of memory.
    "perceiver": {"num_latents": 8, "d_latents": 32, "num_self_attends_per_block": 2,
                  "num_self_attention_heads": 2, "num_cross_attention_heads": 2},
}
# Sizes that the generic shrink leaves inconsistent, found at the plain step (issue 32), each
# the library's own constructor arguments: LeViT's patch embedding downsamples by 16 whatever
# ``patch_size`` says and its subsampling attention has ``hidden_size / key_dim`` heads; LiLT
# splits the width into 6 box coordinates and by its ``channel_shrink_ratio``; LayoutLMv3
# concatenates 4 coordinates and 2 sizes to the width; HGNetV2's and TextNet's stages carry
# their own channel lists; MobileViTV2's last stage works on 2x2 patches of a 1/32 map;
# Hiera's position table follows its ``image_size`` (a list: the images are ``IMAGE``); xLSTM's width is
# ``embedding_dim``.
STEP_FIXES = {
    "levit": {"patch_size": 16, "image_size": 64, "key_dim": [16, 16, 16],
              "down_ops": [["Subsample", 16, 2, 4, 2, 2], ["Subsample", 16, 4, 4, 2, 2]]},
    "lilt": {"hidden_size": 48},
    "layoutlmv3": {"coordinate_size": 4, "shape_size": 8, "input_size": IMAGE},
    "hgnet_v2": {"stem_channels": [3, 16, 16], "stage_in_channels": [16, 32, 64, 128],
                 "stage_mid_channels": [16, 16, 32, 32], "stage_out_channels": [32, 64, 128, 256],
                 "stage_numb_of_layers": [2, 2, 2, 2], "hidden_sizes": [32, 64, 128, 256]},
    "textnet": {"stem_out_channels": 32, "hidden_sizes": [32, 32, 64, 128, 256]},
    "mobilevitv2": {"patch_size": 2, "image_size": 2 * IMAGE, "n_attn_blocks": [1, 1, 1],
                    "width_multiplier": 0.25},
    "hiera": {"image_size": [IMAGE, IMAGE]},
    "xlstm": {"embedding_dim": 32, "num_blocks": 2},
    # ShieldGemma 2: its image as 2x2 pooled tokens (of 8x8 patches), special tokens and the
    # Yes/No tokens its head reads inside the tiny vocabulary.
    "shieldgemma2": {"mm_tokens_per_image": 4, "boi_token_index": 95, "eoi_token_index": 96,
                     "image_token_index": 97, "yes_token_index": 10, "no_token_index": 11},
    # Local attention in windows of 512 pads 7 tokens to 512 (gradients with NaN): windows of 4.
    "longformer": {"attention_window": 4},
    "led": {"attention_window": 4, "max_encoder_position_embeddings": 64,
            "max_decoder_position_embeddings": 64},
    # BLT's hashed byte n-gram tables: 500002 rows each (0.5 GB per float64 copy of them all).
    "blt": {"encoder_hash_byte_group_vocab": 101},
}
# Models whose own code cannot run in float64, built and checked in float32 (the sweep's
# float32 tolerance for every parameter), with the reason; and those whose code builds
# tensors in the default dtype next to float64 ones, run with float64 as the default.
FLOAT32_ONLY = {
    "canine": "its attention mask is (1 - mask.float()) * finfo(float64).min: -inf in float32, then NaN",
    "fsmt": "its fill_with_neg_inf fills a float32 copy with float64's least value: an overflow",
    "mra": "its attention casts queries, keys and values to float32 and passes float32 on to a Linear",
    "inkling2_text": "its router multiplies float32 hidden states by its weight, kept float32 only in half "
                     "precision",
    "inkling2_loop_text": "its router multiplies float32 hidden states by its weight, kept float32 only in "
                          "half precision",
}
DEFAULT_FLOAT64 = {"xglm"}  # torch.full((), finfo(float64).min): float32 by default, an overflow
# Defaults that do not build even in transformers (a validator, a ``None`` the model needs) or
# sizes tied together that the generic shrink breaks; see :func:`_derived_sizes` for the rules.
BUILD_FIXES = {
    # GQA refused (ESMC, dots.3 note); the differential attention splits values in two KV halves.
    "esmc": {"num_key_value_heads": 2},
    "diffllama": {"num_key_value_heads": 2},
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 16},  # its only routing
    # A ``None`` MoE width and the rope table of each layer type: no default builds.
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                   "rope_theta": 10000.0}}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 4, "indexer_compress_ratio": 2, "hc_lowrank": 8,
                       "ple_embed_dim": 32, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                       "linear_num_key_heads": 2, "linear_num_value_heads": 4},
    # Serialized as (attention, mlp) pairs: 3 layers, one each of input, looped recurrent, output.
    "dory": {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2,
             "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]},
    # The shared transformer block tied across hybrid layers needs two of them (see below).
    # The last layers reuse the keys and values of earlier ones: two that compute, two that reuse.
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "intermediate_size": [64] * 4,
                     "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0], "laurel_rank": 8},
    # Its vision and audio towers take no part in a text-only step (their parameters get no
    # gradient): the smallest that build, not 300M parameters of them.
    "gemma3n_vision": {"architecture": "resnet10t"},
    "gemma3n_audio": {"conf_num_hidden_layers": 1, "sscp_conv_channel_size": [8, 8]},
    # Latent attention, its sliding layers with plain heads of qk_nope + qk_rope = head_dim.
    "dots3_note_text": {"num_key_value_heads": 2, "head_dim": 16, "qk_nope_head_dim": 4},
    "xlnet": {"d_head": 16},  # d_model // n_head
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
              "attention_hidden_size": 64, "attention_head_dim": 32, "mamba_dt_rank": 4},
    "zamba2": {"attention_hidden_size": 64, "attention_head_dim": 32, "mamba_headdim": 8,
               "kv_channels": 16, "adapter_rank": 8, "mamba_d_state": 8, "chunk_size": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "attention_layers": ["global", "local"]},
    # All Mamba by default, which its own mask code refuses: a hybrid of both kinds.
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2,
                         "shared_intermediate_size": 32},
    # Vision and audio towers that a text-only step does not use: their adapters' widths
    # follow the tiny ones (the text model's 32), conv output = downsample width x 16.
    "dots3_note_vision_encoder": {"adapter_in_dim": 32, "adapter_out_dim": 32, "moe_intermediate_size": 32},
    "dots3_note_audio_encoder": {"adapter_input_size": 32, "adapter_out_dim": 32, "downsample_hidden_size": 8,
                                 "conv_output_size": 128, "num_key_value_heads": 2},
    "kolibri1_1": {"index_num_heads": 2, "index_topk": 4, "index_pool_size": 16, "index_compression": 2,
                   "index_num_local_tokens": 2, "index_num_sink_tokens": 1, "mlp_only_intermediate_size": 64},
    # The decoder reads input_ids as (batch x codebooks, length): one codebook, so that the
    # batch's 4 rows are 4 examples (with 4 codebooks they were 1).
    "musicgen_decoder": {"num_codebooks": 1},
    "musicgen_melody_decoder": {"num_codebooks": 1},
    "nemotron3_5_transcribe_word_timestamp": {"blank_token_id": 2},  # inside the tiny vocabulary
    # Mamba-2 mixers of 128 heads of 64 and a shared expert 7688 wide (NeMo's speech LM
    # reuses it as its text model): their tiny sizes.
    "nemotron_h": {"mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 8,
                   "chunk_size": 8, "n_routed_experts": 4, "moe_shared_expert_intermediate_size": 32},
    # Built in training mode (``TRAIN_MODE``), where its positions' axial shape must multiply to
    # the sequence's length and the length be a multiple of the attention chunks: 7 = 7 x 1, chunks
    # of 7; no dropout and a fixed hash seed (its random rotations): deterministic.
    # Assistants drafting from a target model's hidden states and keys and values (built by
    # ``sweep_models._assistant_inputs``): a target of the tiny width, not of 1536 or 3840.
    "gemma4_assistant": {"backbone_hidden_size": 32},
    "gemma4_unified_assistant": {"backbone_hidden_size": 32},
    "reformer": {"axial_pos_shape": [7, 1], "axial_pos_embds_dim": [16, 16], "attention_head_size": 16,
                 "feed_forward_size": 64, "local_attn_chunk_length": 7, "lsh_attn_chunk_length": 7,
                 "max_position_embeddings": 7, "hash_seed": 0, "hidden_dropout_prob": 0.0,
                 "local_attention_probs_dropout_prob": 0.0, "lsh_attention_probs_dropout_prob": 0.0},
}
# Models that need a library which cannot be installed here without compiling it (looked up in
# the package index with pip, 2026-12-04), given as the reason where their build raises
# ImportError (with the library installed they build).
NOT_INSTALLABLE = {
    "dinat": "natten, which the package index holds as sources only (0.14.2 to 0.21.7, C++ kernels "
             "to compile), no wheel: `pip install --dry-run --only-binary=:all: natten` finds none",
    "layoutlmv2": "detectron2, which is not in the package index (`pip install --dry-run "
                  "--only-binary=:all: detectron2` finds none): built from its sources only",
}
# Models whose backward pass runs in training mode only, built and checked in training mode
# with no randomness (their dropout probabilities 0, see ``BUILD_FIXES``), with the reason.
TRAIN_MODE = {
    "reformer": "its reversible layers' backward pass asserts training mode; no dropout, a fixed hash seed",
}
# Defaults that fail the configuration's own validator: what it asks, given to the default.
BUILD_DEFAULTS = {
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "enable_moe_block": False}},
}
