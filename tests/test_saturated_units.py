"""Issue 32: a bias element whose every contribution is tiny but real is not a structural zero.

Found on HF Swinv2 (``continuous_position_bias_mlp.0.bias``, a ``Linear`` followed by
``ReLU(inplace=True)``): units active only on rows whose gradient a saturated sigmoid (or
the shifted windows' ``-100`` mask) makes ~1e-88 got ``sum_i x_i = sum_i x_i**2 = 0``, so
their SNR was left out and ``snr_mean`` was off by 3.5e-3. Those contributions are exact
(one term each, no cancellation): the structural-zero test (:func:`.sums.structural_zeros`)
compared them with magnitudes read at the layer's output *after* the in-place ReLU had
rebased it, i.e. the gradient at the ReLU's output, large on the rows where the unit is
off and whose true terms are exact zeros. The block paths now hand the rest of the block a
copy of each biased ``Linear``'s output (:mod:`.block_biases`), so the gradient at the
captured tensor is the gradient at the layer's output. The same model on the native
``Linear`` rule (rows that are examples) is exact too: its magnitudes come from the
layer's own output gradient.
"""

from cockpit_gradnoise import functional
from cockpit_gradnoise.extensions.fallback import block_vmap, blocks

import pytest
import torch
from torch import nn

from tests.test_regroup import assert_exact_with_structural_zeros

TOKENS = 6
# Pre-activations of at most minus this on the rows where unit 0 is on: sigmoid'(z) = y (1 - y)
# <= e^-100, about 4e-44 there (float64 holds it and its square; on the other side, z >= 37,
# 1 - y rounds to 0 and the gradient is an exact 0). On the other rows the sigmoid is not
# saturated (z in [1, 3]), so the gradient at the ReLU's output is of order 0.1 there.
SATURATING = 100.0


class SaturatedUnit(nn.Module):
    """``sigmoid(out(relu_(fc(rows))))`` per token. ``fc``'s unit 0 is on (``100 x > 0``) only
    on tokens with ``x >= 1``, where ``out`` then gives ``z <= -100``; unit 1 (``-x``) only on
    ``x <= -1``, where ``z`` is in ``[1, 3]``. ``flatten``: on the rows ``[N*T, 1]`` (the block
    path) or on ``[N, T, 1]`` (the native rules)."""

    def __init__(self, flatten):
        super().__init__()
        self.flatten = flatten
        self.fc, self.act, self.out = nn.Linear(1, 2), nn.ReLU(inplace=True), nn.Linear(2, 1)
        self.head = nn.Linear(1, 3)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[SATURATING], [-1.0]]))
            self.fc.bias.zero_()
            self.out.weight.copy_(torch.tensor([[-1.0, 1.0]]))
            self.out.bias.zero_()

    def forward(self, x):  # [N, T, 1]
        rows = x.reshape(-1, 1) if self.flatten else x
        y = torch.sigmoid(self.out(self.act(self.fc(rows)))).reshape(x.shape)
        return self.head(y.mean(1))


def saturated(flatten):
    torch.manual_seed(0)  # the head's weights
    return SaturatedUnit(flatten).double()


def saturating_inputs(examples):
    """``[N, T, 1]`` of magnitudes in ``[1, 3]``, both signs in every example."""
    generator = torch.Generator().manual_seed(examples)
    magnitudes = 1.0 + 2.0 * torch.rand(examples, TOKENS, 1, generator=generator, dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(TOKENS // 2).reshape(1, TOKENS, 1)
    targets = torch.randint(0, 3, (examples,), generator=generator)
    return magnitudes * signs, targets


def test_the_unit_s_contributions_are_tiny_and_real():
    """What the tests below rest on: ``fc.bias[0]``'s contributions are each one sum of
    terms ``~e^-100``, far below the other unit's, and not zero."""
    model = saturated(flatten=False)
    inputs, targets = saturating_inputs(3)
    rows = []
    for i in range(3):
        model.zero_grad()
        nn.functional.cross_entropy(model(inputs[i : i + 1]), targets[i : i + 1]).backward()
        rows.append(model.fc.bias.grad.clone())
    x = torch.stack(rows)
    assert (x[:, 0] != 0).all() and (x[:, 0].abs() < 1e-40).all()
    assert (x[:, 1].abs() > 1e-3).all()


@pytest.mark.parametrize("vectorized", [True, False], ids=["vmap", "loop"])
def test_block_path_keeps_a_saturated_unit(vectorized, monkeypatch):
    """Through the block path, by ``vmap`` and by the loop: exact, ``snr_mean`` included."""
    ran = []
    chunk, loop = block_vmap.chunk, blocks.per_example_gradients
    monkeypatch.setattr(block_vmap, "chunk", lambda *args: ran.append("vmap") or chunk(*args))
    monkeypatch.setattr(blocks, "per_example_gradients", lambda *args: ran.append("loop") or loop(*args))
    if not vectorized:
        monkeypatch.setattr(blocks, "vectorized", lambda *args: None)
    inputs, targets = saturating_inputs(3)
    assert_exact_with_structural_zeros(saturated(flatten=True), inputs, targets)
    assert ran and set(ran) == {"vmap" if vectorized else "loop"}


def test_native_rules_keep_a_saturated_unit():
    inputs, targets = saturating_inputs(3)
    assert_exact_with_structural_zeros(saturated(flatten=False), inputs, targets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_underflowed_square_gives_sd_plus_zero_not_a_negative_snr(dtype):
    """``S = 0`` beside ``T != 0`` (every square underflowed: contributions below 1e-162 in
    float64): ``C = S - T**2 / N`` by a fused multiply-add is -0.0 there, and ``|T| / -0.0``
    was ``-inf``, reported as an SNR of ``-1.8e308``. sd is +0 now and the SNR the cap, as
    :func:`gradient_sd` and :func:`signal_to_noise` give (examples that agree to rounding)."""
    n = 3
    limit = functional.resolvable_snr(n, dtype)
    tiny = 1e-40 if dtype == torch.float32 else 1e-184
    squares, total = torch.tensor([0.0, 2e-5], dtype=dtype), torch.tensor([-tiny, 4e-3], dtype=dtype)
    assert total[0] != 0 and torch.addcmul(squares, total, total, value=-1.0 / n)[0] == 0
    sd, snr, _, _, left_out = functional.sd_and_signal_to_noise([(squares, total)], n, limit)
    assert sd[0] == 0 and not sd[0].signbit()
    assert snr[0] == limit and left_out == [0]
    plain = functional.signal_to_noise(total, functional.gradient_sd(squares.clone(), total, n), limit)
    assert torch.equal(snr, plain)
