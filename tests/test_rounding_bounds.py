"""The rounding bounds other tests take their tolerance from, pinned to hand-computed values.

``tests/test_conv_expansion.py`` and ``tests/test_mixed_precision.py`` (and the tests
of the SNR's resolution) compare against :func:`~cockpit_gradnoise.functional.variance_rounding_bound`,
:func:`~cockpit_gradnoise.functional.expansion_rounding_bound` and
:func:`~cockpit_gradnoise.functional.resolvable_snr`; here each is checked against its
derivation (their docstrings), with ``eps`` written out: ``2**-23`` for float32,
``2**-52`` for float64, ``2**-7`` for bfloat16.
"""

import math

from cockpit_gradnoise import functional

import pytest
import torch

F32_EPS, F64_EPS, BF16_EPS = 2.0**-23, 2.0**-52, 2.0**-7


def test_the_variance_rounding_bound_is_3n_plus_4l_eps_s():
    s = torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64)
    # N = 10, L = 1, float32: (30 + 4) eps = 34 * 2**-23 = 4.0531158447265625e-06 per unit of S.
    got = functional.variance_rounding_bound(s, 10, dtype=torch.float32)
    assert got.tolist() == [4.0531158447265625e-06, 8.106231689453125e-06, 0.0]
    # N = 4, L = 9 (a convolution's positions): (12 + 36) eps = 48 * 2**-23 = 5.7220458984375e-06.
    assert functional.variance_rounding_bound(s, 4, inner_terms=9, dtype=torch.float32)[0] == 5.7220458984375e-06
    # The dtype defaults to S's: float64, N = 2, L = 1: 10 * 2**-52 = 2.220446049250313e-15.
    assert functional.variance_rounding_bound(s, 2)[1] == 2 * 10 * F64_EPS == 4.440892098500626e-15
    # bfloat16, N = 1, L = 1: 7 * 2**-7 = 0.0546875.
    assert functional.variance_rounding_bound(s, 1, dtype=torch.bfloat16)[0] == 7 * BF16_EPS == 0.0546875
    with pytest.raises(ValueError, match="inner_terms must be at least 1"):
        functional.variance_rounding_bound(s, 4, inner_terms=0)


def test_the_expansion_rounding_bound_is_n_eps_r():
    r = torch.tensor([3.0, 0.5], dtype=torch.float64)
    # N = 5, float32: 5 * 3 * 2**-23 = 15 * 2**-23 = 1.7881393432617188e-06; 2.5 * 2**-23 for R = 0.5.
    got = functional.expansion_rounding_bound(r, 5, torch.float32)
    assert got.tolist() == [1.7881393432617188e-06, 2.980232238769531e-07]
    assert got.tolist() == [15 * F32_EPS, 2.5 * F32_EPS]
    # R's dtype by default (float64), and into ``out`` where given.
    out = torch.empty(2, dtype=torch.float64)
    assert functional.expansion_rounding_bound(r, 4, out=out) is out
    assert out.tolist() == [12 * F64_EPS, 2 * F64_EPS]


def test_the_resolvable_snr_is_the_square_root_of_n_minus_1_over_the_bound():
    # N = 4, L = 1, float32: sqrt(3 / (16 * 2**-23)) = sqrt(3 * 2**19) = 512 sqrt(6) = 1254.1387...
    assert functional.resolvable_snr(4, torch.float32) == pytest.approx(512 * math.sqrt(6), rel=1e-15, abs=0)
    assert functional.resolvable_snr(4, torch.float32) == pytest.approx(1254.13874830, rel=1e-10, abs=0)
    # N = 2, L = 3, float64: sqrt(1 / ((6 + 12) * 2**-52)) = 2**26 / sqrt(18) = 2**26 / (3 sqrt(2)).
    assert functional.resolvable_snr(2, torch.float64, inner_terms=3) == pytest.approx(
        2**26 / (3 * math.sqrt(2)), rel=1e-15, abs=0)


def test_the_rounding_bound_of_a_tensor_is_sqrt_eps_times_its_largest_magnitude():
    from cockpit_gradnoise.extensions.precision import rounding_bound

    # float64: sqrt(2**-52) * 4 = 2**-26 * 4 = 2**-24 = 5.960464477539063e-08 (exact in binary).
    values = torch.tensor([3.0, -4.0, 0.5], dtype=torch.float64)
    assert rounding_bound(values) == 2.0**-24 == 5.960464477539063e-08
    # float32: sqrt(2**-23) * 4 = 2**-11.5 * 4 = 1.381067932004...e-03.
    assert rounding_bound(values.float()) == pytest.approx(4 * 2.0**-11.5, rel=1e-15, abs=0)
    assert rounding_bound(values.float()) == pytest.approx(1.3810679320049757e-03, rel=1e-12, abs=0)
    # A float64 result of a float32 computation: the eps given, not the dtype's.
    assert rounding_bound(values, F32_EPS) == rounding_bound(values.float())
    assert rounding_bound(values, BF16_EPS) == pytest.approx(4 * 2.0**-3.5, rel=1e-15, abs=0)
    assert rounding_bound(torch.empty(0, dtype=torch.float64)) == 0.0


def test_the_checks_of_the_fallback_take_the_one_rounding_bound():
    """A block's output tolerance (at its narrowest dtype's eps) and the mixing check (another
    example's entry just above and just below the bound) use :func:`rounding_bound`."""
    from cockpit_gradnoise.extensions.fallback import blocks, mixing

    block = blocks.Block()
    block.output = torch.tensor([[0.25, -2.0]], dtype=torch.float64)
    assert blocks.output_tolerance(block) == 2 * 2.0**-26
    block.dtype = torch.float32  # a float32 router inside a float64 model rounds at float32's
    assert blocks.output_tolerance(block) == pytest.approx(2 * 2.0**-11.5, rel=1e-15, abs=0)
    for factor, mixed in ((1.01, True), (0.99, False)):
        grad = torch.tensor([[factor * 2.0**-26, 0.0], [1.0, -0.5]], dtype=torch.float64)
        assert mixing.mixes(grad, 1) is mixed
    assert not mixing.mixes(torch.tensor([[float("nan")], [1.0]], dtype=torch.float64), 1)
