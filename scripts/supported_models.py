"""The checker's output for the models of docs/supported-models.md.

Run: ``PYTHONPATH=. python scripts/supported_models.py [llama|gpt2|vit ...]``
(random weights from tiny configs, batch 4; about a minute on a CPU).
"""

import sys
import warnings

import cockpit_gradnoise as cgn

import torch
from torch.nn import functional as F


def token_loss(outputs, targets):
    """Mean cross-entropy over every token of the batch, from a ``ModelOutput``'s logits."""
    return F.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                         tie_word_embeddings=False)
    tokens = torch.randint(0, 32, (4, 6))
    return LlamaForCausalLM(config).eval(), tokens, torch.randint(0, 32, (4, 6)), token_loss


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    tokens = torch.randint(0, 32, (4, 6))
    return GPT2LMHeadModel(config).eval(), tokens, torch.randint(0, 32, (4, 6)), token_loss


def vit():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=10)
    images = torch.randn(4, 3, 32, 32)
    return model.eval(), images, torch.randint(0, 10, (4,)), torch.nn.CrossEntropyLoss()


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0)
    tokens, mask = torch.randint(1, 32, (4, 6)), torch.ones(4, 6, dtype=torch.long)
    mask[1, 3:] = 0  # a padded sequence
    inputs = (tokens * mask, mask, torch.randint(1, 32, (4, 5)))  # ids, mask, decoder ids
    return T5ForConditionalGeneration(config).eval(), inputs, torch.randint(0, 32, (4, 5)), token_loss


def swin():
    from torchvision.models.swin_transformer import SwinTransformer

    # swin_t's layout at a tiny width: two stages, plain and shifted windows, patch merging.
    model = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                            window_size=[2, 2], stochastic_depth_prob=0.0, num_classes=10)
    images = torch.randn(4, 3, 32, 32)
    return model.eval(), images, torch.randint(0, 10, (4,)), torch.nn.CrossEntropyLoss()


MODELS = {"llama": llama, "gpt2": gpt2, "vit": vit, "t5": t5, "swin": swin}


def main(names):
    warnings.filterwarnings("ignore")  # torch's and transformers' notices about tiny configs
    for name in names or MODELS:
        torch.manual_seed(0)
        print(f"## {name}")
        cgn.check_model(*MODELS[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
