"""Assertions, frame helpers and rounding units shared by several test files."""

import cockpit_gradnoise as cgn
from cockpit_gradnoise.logs import schema

import pytest
import torch

RTOL = 1e-10
EPS64 = torch.finfo(torch.float64).eps
F32_UNIT = 2.0**-24  # float32's unit roundoff


def gamma(k: int, unit: float = F32_UNIT) -> float:
    """``gamma_k = k u / (1 - k u)``: the relative error of a sum of ``k`` terms (Higham 2002, ch. 3)."""
    return k * unit / (1 - k * unit)


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def without_quantities(frame, quantities=(schema.OPTIMIZER,)):
    """A tidy ``frame`` without the rows of ``quantities``, their names dropped from its
    categories: by default the tracker's ``Optimizer`` rows, which the explicit API does
    not log."""
    kept = frame[~frame.quantity.isin(quantities)].reset_index(drop=True)
    for column in ("quantity", "param", "statistic"):
        kept[column] = kept[column].cat.remove_unused_categories()
    return kept


def without_coverage(rows):
    """``rows`` without the network's ``params_covered``/``params_total`` (tested apart)."""
    return {
        name: {s: v for s, v in stats.items() if s not in schema.COVERAGE_STATISTICS}
        for name, stats in rows.items()
    }


def assert_statistics_match(got, expected, rtol=RTOL, rtol_of=None, atol_of=None):
    """``got`` equals ``expected`` statistic by statistic (``inf == inf``).

    Both are ``{param: {statistic: float}}``; the network's coverage
    statistics in ``got`` are left out. ``rtol_of(name, statistic)``, if given,
    overrides ``rtol`` per statistic; ``atol_of(name, statistic)`` gives an
    absolute tolerance (0 if not given).
    """
    got = without_coverage(got)
    assert set(got) == set(expected)
    for name, stats in expected.items():
        assert set(got[name]) == set(stats), name
        for statistic, value in stats.items():
            tolerance = rtol if rtol_of is None else rtol_of(name, statistic)
            atol = 0 if atol_of is None else atol_of(name, statistic)
            assert got[name][statistic] == pytest.approx(value, rel=tolerance, abs=atol), (
                name,
                statistic,
            )


def rows(cockpit, quantity, step=0):
    """``{param: {statistic: float}}`` of ``quantity`` at ``step``, via ``to_frame``."""
    frame = cgn.to_frame(cockpit)
    frame = frame[(frame.quantity == quantity) & (frame.step == step)]
    result = {}
    for param, statistic, value in zip(frame.param, frame.statistic, frame.value):
        result.setdefault(param, {})[statistic] = value
    return result


def sd_rtol(grads, n, name, inner_terms=1):
    """Relative tolerance of sd and SNR statistics of parameter ``name``, from rounding.

    ``sd_j**2`` comes from ``sum_i x_ij**2 - (sum_i x_ij)**2 / N``. Each
    ``x_ij`` is itself a sum of up to ``inner_terms`` products (over output
    positions or sequence steps), computed in different orders by BackPACK and
    by the reference, so it is off by up to ``inner_terms * eps`` relative; the
    sums over examples add ``N eps``. A relative rounding error
    ``delta <= 2 (N + inner_terms) eps`` in those sums becomes a relative error
    ``delta * (1 + SNR_j**2 / (N - 1))`` in ``sd_j**2`` (because
    ``sum_i x_ij**2 / centred = 1 + SNR_j**2 / (N - 1)``), half that in
    ``sd_j`` and in ``SNR_j``. The largest ``SNR_j`` bounds every statistic.
    """
    rows = [g.reshape(n, -1) for key, g in grads.items() if name in (key, cgn.NETWORK)]
    x = torch.cat(rows, dim=1)
    sd = (n / (n - 1) * (x - x.mean(0)).pow(2).sum(0)).sqrt()
    snr = x.sum(0).abs()[sd > 0] / sd[sd > 0]
    snr_max = snr.max().item() if snr.numel() else 0.0  # all sd 0: a structural zero
    return max(RTOL, 2 * (n + inner_terms) * EPS64 * (1 + snr_max**2 / (n - 1)))


def snr_atol(grads, n, name, inner_terms=1):
    """Absolute tolerance of the SNR statistics of ``name`` where gradients are rounding noise.

    ``grad_j = sum_i x_ij`` rounds by up to ``2 (N + inner_terms) eps A_j``
    with ``A_j = sum_i |x_ij|`` (as in :func:`sd_rtol`). Where the examples'
    contributions cancel exactly (a BatchNorm's bias followed only by linear
    maps and a BatchNorm in training mode: the batch's mean removes it),
    ``|grad_j|`` is within that bound, and ``SNR_j`` is noise of up to that bound
    over ``sd_j``; a quantile or mean over elements moves by at most the
    largest such bound. 0 where no element's gradient is within its bound.
    """
    x = torch.cat([g.reshape(n, -1) for key, g in grads.items() if name in (key, cgn.NETWORK)], 1)
    sd = (n / (n - 1) * (x - x.mean(0)).pow(2).sum(0)).sqrt()
    bound = 2 * (n + inner_terms) * EPS64 * x.abs().sum(0)
    noise = (x.sum(0).abs() <= bound) & (sd > 0)
    return (bound[noise] / sd[noise]).max().item() if noise.any() else 0.0


def rounding_bounds(n, elements, grad_sq, trace_cov):
    """Absolute rounding bounds of ``grad_sq`` and ``trace_cov``.

    Both come from ``S`` and ``M`` (sums over ``N`` examples of sums over
    ``P`` elements, relative error below ``(N + P) eps``) through
    ``(N M - S) / (N - 1)`` and ``N (S - M) / (N - 1)``, where
    ``S = grad_sq + trace_cov`` and ``M = grad_sq + trace_cov / N``; a
    difference's error is at most the sum of its terms' errors.
    """
    s, m = abs(grad_sq + trace_cov), abs(grad_sq + trace_cov / n)
    error = (n + elements) * EPS64
    return error * (n * m + s) / (n - 1), error * n * (s + m) / (n - 1)


def quiet_check(model, inputs, targets, loss):
    """``cgn.check_model`` (float64 reference, one step) without its warnings shown."""
    import warnings

    import cockpit_gradnoise as cgn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cgn.check_model(model, inputs, targets, loss, verbose=False)


class CausalLogits(torch.nn.Module):
    """A ``transformers`` causal LM's logits, called the way the sweep calls it (no cache)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return self.lm(tokens, use_cache=False).logits


def sequence_batch(examples: int, length: int = 5, width: int = 4):
    """``examples`` random float64 sequences ``[examples, length, width]`` (seeded by their
    number) and class targets ``0, 1, 2, 0, ...``."""
    generator = torch.Generator().manual_seed(examples)
    x = torch.randn(examples, length, width, generator=generator, dtype=torch.float64)
    return x, torch.arange(examples) % 3


def token_check(model, vocabulary: int, examples: int = 3, length: int = 5):
    """:func:`quiet_check` of a language model on random tokens and targets (seeded), its
    ``[N, T, V]`` logits' cross-entropy over every token."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocabulary, (examples, length), generator=generator)
    targets = torch.randint(0, vocabulary, (examples, length), generator=generator)

    def loss(logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return quiet_check(model, (tokens,), targets, loss)
