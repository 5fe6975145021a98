"""torchvision's and Hugging Face's models for the case matrix, built small from their own
classes (random weights, nothing downloaded): a ``VisionTransformer``, stacks of
MobileNetV3's, EfficientNet's and ConvNeXt's blocks, and BERT with padded batches.

BERT's inputs are one tensor ``[N, 3, T]`` (token ids, attention mask, token types), so
that a per-example loop slices the mask with the tokens: every example sees the same
masked inputs alone as in the batch.
"""

import cockpit_gradnoise as cgn

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 3
IGNORE = -100  # Hugging Face's label of tokens without a loss


def torchvision_vit(image=8, patch=4, width=8, heads=2):
    """``VisionTransformer`` as ``vit_b_16`` builds it, one layer: ``nn.MultiheadAttention``
    (converted by ``prepare_model``; its key third of ``in_proj_bias`` has a zero gradient),
    ``class_token`` and ``pos_embedding`` used directly in forward (the fallback)."""
    from torchvision.models import VisionTransformer

    model = VisionTransformer(image_size=image, patch_size=patch, num_layers=1, num_heads=heads,
                              hidden_dim=width, mlp_dim=2 * width, num_classes=CLASSES).eval()
    # torchvision starts the head at zero, which leaves every other gradient zero.
    nn.init.normal_(model.heads.head.weight)
    return model


def torchvision_mobilenet(training=False):
    """``MobileNetV3`` with two of its inverted residual blocks (squeeze-excitation, ReLU and
    Hardswish, the second with its residual connection), BatchNorm, Dropout in the head."""
    from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3

    blocks = [InvertedResidualConfig(8, 3, 8, 8, True, "RE", 2, 1, 1),
              InvertedResidualConfig(8, 3, 16, 8, True, "HS", 1, 1, 1)]
    return MobileNetV3(blocks, last_channel=16, num_classes=CLASSES).train(training)


def torchvision_efficientnet(training=False):
    """``EfficientNet`` with three MBConv blocks (no expansion; expansion 2 with stride 2,
    then one with its residual and stochastic depth), SiLU, squeeze-excitation, BatchNorm,
    Dropout in the head."""
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    blocks = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(2, 3, 2, 8, 8, 2)]
    return EfficientNet(blocks, dropout=0.2, stochastic_depth_prob=0.2, num_classes=CLASSES,
                        last_channel=16).train(training)


def torchvision_convnext(training=False):
    """``ConvNeXt`` with two stages of one ``CNBlock`` (depthwise 7x7 convolution, LayerNorm,
    MLP, ``layer_scale`` used directly, then stochastic depth), ``LayerNorm2d`` stem,
    downsampling and head; in training mode, stochastic depth drops the second block of half the examples'
    blocks (``"row"`` mode: per example)."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    stages = [CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)]
    return ConvNeXt(stages, stochastic_depth_prob=0.5 if training else 0.0, layer_scale=0.5,
                    num_classes=CLASSES).train(training)


SWIN_WIDTH = 8


def torchvision_swin():
    """``SwinTransformer`` with one stage of two blocks (the second with shifted windows and
    their mask): ``ShiftedWindowAttention`` holds ``relative_position_bias_table`` and uses
    its ``qkv`` and ``proj`` Linears' parameters itself (``F.linear``), never calling them."""
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(patch_size=[4, 4], embed_dim=SWIN_WIDTH, depths=[2], num_heads=[2],
                           window_size=[2, 2], stochastic_depth_prob=0.0,
                           num_classes=CLASSES).eval()


class Bert(nn.Module):
    """A Hugging Face BERT on ``[N, 3, T]`` inputs (ids, attention mask, token types):
    its logits (``[N, classes]``, or ``[N, T, vocabulary]`` for masked LM)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        ids, mask, types = batch.unbind(1)
        return self.model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits


def _bert_config(vocabulary, length, width, heads):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocabulary, hidden_size=width, num_hidden_layers=1, num_attention_heads=heads,
        intermediate_size=2 * width, max_position_embeddings=length, type_vocab_size=2,
        num_labels=CLASSES, pad_token_id=0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def bert_classifier(vocabulary, length, width=8, heads=2):
    """``BertForSequenceClassification``: ``nn.Embedding(padding_idx=0)``, positions of
    shape ``(1, T)`` (without the batch dimension), submodules called ``output``, pooler."""
    from transformers import BertForSequenceClassification

    return Bert(BertForSequenceClassification(_bert_config(vocabulary, length, width, heads))).eval()


def bert_masked_lm(vocabulary, length, width=8, heads=2):
    """``BertForMaskedLM``: as :func:`bert_classifier`, no pooler, the decoder tied to the
    word embedding (a Linear and an ``nn.Embedding(padding_idx=0)`` sharing one weight)."""
    from transformers import BertForMaskedLM

    return Bert(BertForMaskedLM(_bert_config(vocabulary, length, width, heads))).eval()


def padded_bert_batch(n, vocabulary, length, mask_token=1, generator=None):
    """``[n, 3, T]``: ids (token 0 is padding, ``mask_token`` is never drawn), attention mask
    and token types (0, then 1 for the second half of each sequence, 0 on padding).

    Lengths from 2 to ``T``, the first sequence full, the second as short as allowed.
    """
    lengths = torch.randint(2, length + 1, (n,), generator=generator)
    lengths[0], lengths[1] = length, 2
    positions = torch.arange(length)
    mask = (positions < lengths[:, None]).long()
    ids = torch.randint(mask_token + 1, vocabulary, (n, length), generator=generator) * mask
    types = (positions >= (lengths[:, None] + 1) // 2).long() * mask
    return torch.stack([ids, mask, types], dim=1)


def masked_lm_batch(n, vocabulary, length, mask_token=1):
    """``(inputs, targets)`` of masked language modelling on :func:`padded_bert_batch`: some
    tokens of each sequence (always its first) replaced by ``mask_token`` and labelled, in
    :func:`masked_lm_targets`' layout. Drawn from a generator seeded with ``n``: the case
    draws its inputs and its targets apart."""
    generator = torch.Generator().manual_seed(n)
    inputs = padded_bert_batch(n, vocabulary, length, mask_token, generator)
    ids, mask = inputs[:, 0], inputs[:, 1].bool()
    chosen = (torch.rand(n, length, generator=generator) < 0.3) & mask
    chosen[torch.arange(n), 0] = True  # every sequence has a labelled token
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE))
    inputs[:, 0] = torch.where(chosen, torch.full_like(ids, mask_token), ids)
    return inputs, masked_lm_targets(labels)


def masked_lm_targets(labels):
    """``[N, T + 2]``: the labels, then the batch's ``N`` and labelled-token count ``n`` in
    every row, the constants of ``L_i = N sum_t m_it l_it / n`` (``cgn.sequence_losses``),
    so that example ``i`` alone has the loss it has in the batch."""
    n, labelled = len(labels), int((labels != IGNORE).sum())
    constants = torch.tensor([n, labelled]).expand(n, 2)
    return torch.cat([labels, constants], dim=1)


class MaskedTokenLoss(nn.Module):
    """Masked LM loss on :func:`masked_lm_targets`: ``"mean"`` is Hugging Face's (the mean over
    labelled tokens), ``"sum"`` is ``sum_i L_i``, ``"none"`` the ``L_i`` of
    ``cgn.sequence_losses``, for a slice of the batch rescaled to the batch's constants
    (by exactly 1 on the whole batch)."""

    def __init__(self, reduction="mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, targets):
        labels, batch, labelled = targets[:, :-2], targets[:, -2], targets[:, -1]
        if self.reduction == "mean":
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        tokens = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE,
                                 reduction="none")
        losses = cgn.sequence_losses(tokens, labels, ignore_index=IGNORE)
        here = (labels != IGNORE).sum().to(losses.dtype)
        losses = losses * (batch.to(losses.dtype) * here / (len(labels) * labelled.to(losses.dtype)))
        return losses if self.reduction == "none" else losses.sum()


class T5(nn.Module):
    """A Hugging Face T5 on ``[N, 3, T]`` inputs (encoder ids, attention mask, decoder
    ids in the first ``decoder_length`` columns): its logits ``[N, decoder_length, V]``."""

    def __init__(self, model, decoder_length):
        super().__init__()
        self.model, self.decoder_length = model, decoder_length

    def forward(self, batch):
        ids, mask, decoder = batch.unbind(1)
        return self.model(input_ids=ids, attention_mask=mask,
                          decoder_input_ids=decoder[:, : self.decoder_length]).logits


def t5_config(vocabulary, width=16, heads=2, layers=2, buckets=8, dropout=0.0):
    """A tiny ``T5Config``: relative position buckets, dropout ``dropout``."""
    from transformers import T5Config

    return T5Config(vocab_size=vocabulary, d_model=width, d_kv=width // heads, d_ff=2 * width,
                    num_layers=layers, num_decoder_layers=layers, num_heads=heads,
                    relative_attention_num_buckets=buckets, relative_attention_max_distance=16,
                    dropout_rate=dropout, pad_token_id=0, decoder_start_token_id=0)


def t5(vocabulary, decoder_length, attention="sdpa", training=False):
    """``T5ForConditionalGeneration``: a relative position bias table in the encoder's and
    the decoder's first layer, applied to a ``[q, k]`` bucket index without the batch
    and reused by every layer; one embedding used three times (encoder, decoder, head).
    In training mode with dropout 0.3 (on the embeddings, the attention weights, which the
    bias enters before, and every residual branch)."""
    from transformers import T5ForConditionalGeneration

    config = t5_config(vocabulary, dropout=0.3 if training else 0.0)
    config._attn_implementation = attention
    return T5(T5ForConditionalGeneration(config), decoder_length).train(training)


def t5_batch(n, vocabulary, length, decoder_length):
    """``[n, 3, T]``: padded encoder ids (lengths 2 to ``T``, as :func:`padded_bert_batch`),
    their attention mask, and decoder ids (no padding) in the first ``decoder_length``
    columns. The shortest sequence has two different tokens: with equal ones, attention
    over them ignores its weights, and the bias's gradient is zero (rounding noise)."""
    padded = padded_bert_batch(n, vocabulary, length)
    padded[1, 0, :2] = torch.tensor([2, 3])
    decoder = torch.randint(1, vocabulary, (n, length))
    decoder[:, decoder_length:] = 0
    return torch.stack([padded[:, 0], padded[:, 1], decoder], dim=1)
