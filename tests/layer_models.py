"""Models of the case matrix for layers of issue 19: ``padding_idx``, attention, subclasses."""

import torch
from torch import nn

PADDING = 0


def embedding_padding():
    """An embedding with a padding row: its gradient is exactly 0 by definition."""
    return nn.Sequential(
        nn.Embedding(10, 4, padding_idx=PADDING), nn.Flatten(), nn.Tanh(), nn.Linear(4 * 4, 3)
    )


def padded_tokens(n):
    """``n`` sequences of 4 tokens; every other one ends in two padding tokens."""
    tokens = torch.randint(1, 10, (n, 4))
    tokens[::2, -2:] = PADDING
    return tokens
