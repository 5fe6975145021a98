"""Norms in float64 as 0-dim tensors (what TwoBatchNoiseScale's hooks keep), a large CPU
tensor by pieces: against ``math.fsum``, and TwoBatchNoiseScale exact with every gradient
going by pieces."""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device, functional

import pytest
import torch
import torch.nn.functional as F

from tests import test_two_batch

U = 2.0**-53


def exact(tensor):
    return math.fsum((tensor.double().reshape(-1) ** 2).tolist())


def test_squared_norm_tensors_are_accurate_as_documented_small_and_large():
    """Each within ``(n + 4) 2**-53`` relative of the correctly rounded sum: ``n 2**-53`` for
    the float64 sum, one rounding of the norm's square root and one of its square for the
    small ones. Float32 sums would be off by about ``1e-7`` here, far past the bound."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3 * _device.CHUNK + 5, dtype=torch.float64, generator=generator) * 1e3 + 1
    tensors = [x.float(), x[:70_000].float().reshape(700, 100), x[:3].float(), x[:1000],
               x[:5000].half(), x[: _device.CHUNK + 1].bfloat16(), x[: _device.CHUNK + 7]]
    together = functional.squared_norm_tensors(tensors)
    assert together.dtype == torch.float64 and together.shape == (len(tensors),)
    for tensor, value in zip(tensors, together.tolist()):
        alone = functional.norm_tensor(tensor)
        assert alone.dtype == torch.float64 and alone.dim() == 0
        for got in (value, alone.item() ** 2):
            assert abs(got - exact(tensor)) <= (tensor.numel() + 4) * U * exact(tensor), tensor.shape


def test_a_large_cpu_tensor_is_never_in_float64_whole(monkeypatch):
    """Past :data:`~cockpit_gradnoise._device.CHUNK` elements, by pieces of at most CHUNK."""
    seen = []
    pieces = _device.float64_pieces

    def spied(flat):
        for piece in pieces(flat):
            seen.append(piece.numel())
            yield piece

    monkeypatch.setattr(_device, "float64_pieces", spied)
    large = torch.randn(2 * _device.CHUNK + 3)
    functional.norm_tensor(large)
    functional.squared_norm_tensors([torch.randn(10), large])
    assert seen == [_device.CHUNK, _device.CHUNK, 3] * 2
    seen.clear()
    functional.norm_tensor(torch.randn(_device.CHUNK))  # one vector_norm
    assert seen == []


@pytest.mark.parametrize("sizes", [(2, 3, 4), (3, 3)])
def test_two_batch_noise_scale_is_exact_with_every_gradient_by_pieces(monkeypatch, sizes):
    """The hooks' and the big batch's squared norms by pieces of 5 elements (every parameter
    of the MLP but its last bias): the same records as the brute force of test_two_batch."""
    monkeypatch.setattr(_device, "CHUNK", 5)
    used = []
    pieces = _device.float64_pieces
    monkeypatch.setattr(_device, "float64_pieces", lambda flat: used.append(flat.numel()) or pieces(flat))
    model = test_two_batch.mlp()
    noise = cgn.TwoBatchNoiseScale(model)
    batches = test_two_batch.micro_batches(sizes)
    for x, y in batches:
        (F.cross_entropy(model(x), y) / len(sizes)).backward()
        noise.micro_batch(len(y))
    record = noise.step(3)
    expected = test_two_batch.reference(model, batches, [1 / (len(sizes) * b) for b in sizes])
    test_two_batch.assert_matches(record, expected, sum(sizes))
    # 12 and 8 elements (not 4 or 2): in each backward pass's hooks and once for the big batch.
    assert sorted(used) == sorted([12, 8] * (len(sizes) + 1))
