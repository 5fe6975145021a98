"""sd and SNR of several layers into two buffers, and their quantiles in place."""

from cockpit_gradnoise import functional, order_statistics
from cockpit_gradnoise.extensions import arena
from cockpit_gradnoise.functional.fused import memory_order

import numpy
import pytest
import torch

N = 8


def layer_sums(shape, dtype, seed, permute=False):
    """``(S, T)`` of ``N`` contributions per element, and the contributions (float64).

    A third of the elements have identical examples (rounded as a per-example
    computation rounds them), a tenth are 0 for every example.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, *shape, generator=generator, dtype=torch.float64)
    row = torch.randn(shape, generator=generator, dtype=torch.float64)
    same = torch.rand(shape, generator=generator) < 1 / 3
    x = torch.where(same, row, x)
    x = torch.where(torch.rand(shape, generator=generator) < 0.1, 0.0, x).to(dtype)
    s, t = (x * x).sum(0), x.sum(0)
    if permute:  # the layout of a convolution's sums: not contiguous, dense
        s, t, x = s.permute(2, 0, 1), t.permute(2, 0, 1), x.permute(0, 3, 1, 2)
    return s, t, x.double()


def in_one_buffer(layers):
    """The layers' ``(S, T)`` copied into the slots of one ``[2, total]`` buffer, in
    another order than the layers' (as :func:`.arena.place` lays them out)."""
    sizes = [t.numel() for _, t, _ in layers]
    buffer = torch.empty(2, sum(sizes), dtype=layers[0][0].dtype)
    offsets = dict(zip(reversed(range(len(sizes))), numpy.cumsum([0] + sizes[::-1][:-1])))
    placed = []
    for k, (s, t, x) in enumerate(layers):
        slot = buffer[:, offsets[k] : offsets[k] + sizes[k]].view(2, *t.shape)
        slot[0].copy_(t)
        slot[1].copy_(s)
        placed.append((slot[1], slot[0], x))
    return placed, buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("over_union, over_sums", [(False, False), (True, False), (False, True)],
                         ids=["into buffers", "in place over a union", "over each layer's sums"])
def test_sd_and_signal_to_noise_of_layers(dtype, over_union, over_sums):
    """Against a float64 two-pass sd within the rounding bound; sd exactly 0 for
    identical examples; SNR at the limit there, 0 / 0 left out and counted. Over
    a union (the layers' sums in one buffer): the same, formed over the sums; over
    each layer's sums: the large layer's over its own, the small ones' over a copy."""
    eps = torch.finfo(dtype).eps
    limit = functional.resolvable_snr(N, dtype)
    layers = [layer_sums((3,), dtype, 0), layer_sums((700,), dtype, 1),
              layer_sums((70_000,), dtype, 2), layer_sums((5, 4, 6), dtype, 3, permute=True)]
    union = None
    if over_union:  # a union's layers are contiguous: the permuted layout left out
        layers, buffer = in_one_buffer(layers[:3])
        union = arena.union_of([(s, t) for s, t, _ in layers])
        assert union is not None
    sums = [(s, t) for s, t, _ in layers]
    layers = [(s.clone(), t.clone(), x) for s, t, x in layers]  # the sums, for the checks
    sd, snr, sds, snrs, left_out = functional.sd_and_signal_to_noise(sums, N, limit, union,
                                                                     over_sums=over_sums)
    if over_sums:  # no buffer; the large layer's sums overwritten, the small ones' not
        assert sd is None and snr is None
        assert [view.data_ptr() == s.data_ptr() for view, (s, _) in zip(sds, sums)] == [
            False, False, True, False]
        assert [view.data_ptr() == t.data_ptr() for view, (_, t) in zip(snrs, sums)] == [
            False, False, True, False]
        assert torch.equal(sums[0][0], layers[0][0]) and torch.equal(sums[3][1], layers[3][1])
        sd = snr = torch.cat(sds)
    elif over_union:  # formed over the sums
        assert sd.data_ptr() == buffer[1].data_ptr() and snr.data_ptr() == buffer[0].data_ptr()
        assert all(view.data_ptr() == s.data_ptr() for view, (s, _) in zip(sds, sums))
        assert all(view.data_ptr() == t.data_ptr() for view, (_, t) in zip(snrs, sums))
    else:
        assert not layers[-1][0].is_contiguous()
        assert layers[-1][0].stride() == layers[-1][1].stride()
    assert sd.numel() == snr.numel() == sum(t.numel() for _, t, _ in layers)
    assert sum(view.numel() for view in sds) == sd.numel()
    cases = {}
    for (s, t, x), got_sd, got_snr, z in zip(layers, sds, snrs, left_out):
        # Per element in the order of the sums' memory, as the function gives them.
        def ordered(per_element, like=s):
            return memory_order(torch.empty_like(like).copy_(per_element))

        identical = ordered((x == x[0]).all(0), torch.empty_like(s, dtype=torch.bool))
        centred = ordered(((x - x.mean(0)) ** 2).sum(0), torch.empty_like(s, dtype=torch.float64))
        s, t = (memory_order(a).double() for a in (s, t))
        got = got_sd.double()
        assert torch.equal(got[identical], torch.zeros_like(got[identical]))
        # C_j = S_j - T_j**2 / N is off by at most (3N + 4) eps S_j (the
        # rounding bound); the factor N / (N - 1), the sqrt and sd's
        # rounding add at most 4 eps of sd**2 <= 2 N / (N - 1) S_j.
        bound = N / (N - 1) * ((3 * N + 4) * eps * s + 4 * eps * 2 * s)
        assert ((got**2 - N / (N - 1) * centred).abs() <= bound).all()
        ratio = got_snr.double()
        kept = got > 0
        expected = torch.clamp(t.abs()[kept] / got[kept], max=limit)
        assert ((ratio[kept] - expected).abs() <= eps * expected).all()
        at_limit = ~kept & (t != 0)
        assert (ratio[at_limit] == torch.tensor(limit, dtype=dtype).item()).all()
        out = ~kept & (t == 0)
        assert (ratio[out] == 0).all() and z == int(out.sum())
        cases.update(identical=identical.any(), at_limit=at_limit.any(), out=out.any())
    assert all(cases.values()), "every case must occur"


def test_quantile_summaries_in_place_equal_numpy_on_the_kept_values():
    """Bit for bit numpy.quantile, per array and of the union (joined or given),
    with placeholder zeros left out; an array with nothing kept has no summary."""
    rng = numpy.random.default_rng(0)
    levels = (0.0, 0.05, 0.5, 0.95, 1.0)
    kept = [numpy.abs(rng.standard_normal(size)).astype(numpy.float32) for size in (5, 9000, 1)]
    kept[1][:300] = 0.0  # kept zeros tie with the placeholders
    left_out = [2, 100, 0]
    arrays = [numpy.concatenate([numpy.zeros(z, numpy.float32), a]) for a, z in zip(kept, left_out)]
    for a in arrays:
        rng.shuffle(a)
    arrays.append(numpy.zeros(4, numpy.float32))
    left_out.append(4)
    for joined in (None, numpy.concatenate(arrays)):
        work = [a.copy() for a in arrays]
        each, union = order_statistics.quantile_summaries_in_place(
            work, levels, left_out, joined=None if joined is None else joined.copy()
        )
        # A summary: the quantiles in level order, then the mean.
        for values, summary in zip(kept, each):
            expected = numpy.quantile(values.astype(numpy.float64), levels).tolist()
            assert summary[: len(levels)] == expected
            assert summary[-1] == pytest.approx(values.astype(numpy.float64).mean(), rel=1e-12)
        assert each[-1] == []
        everything = numpy.concatenate(kept).astype(numpy.float64)
        assert union[: len(levels)] == numpy.quantile(everything, levels).tolist()
        assert union[-1] == pytest.approx(everything.mean(), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_over_each_layers_sums_expanded_ones_too_as_into_buffers(dtype):
    """Sums expanded over positions (``R``, whose bound is formed over ``R``): sd, SNR and the
    left-out counts as into buffers (the same operations, to rounding), over the sums."""
    generator = torch.Generator().manual_seed(5)
    expanded = list(layer_sums((300, 70), dtype, 4)[:2])
    expanded.append(expanded[0] * 12 * (1 + torch.rand(expanded[0].shape, generator=generator, dtype=dtype)))
    layers = [tuple(expanded), layer_sums((40,), dtype, 6)[:2]]
    copies = [tuple(x.clone() for x in layer) for layer in layers]
    limit = functional.resolvable_snr(N, dtype)
    _, _, sds, snrs, left_out = functional.sd_and_signal_to_noise(copies, N, limit)
    sd, _, over_sds, over_snrs, over_left_out = functional.sd_and_signal_to_noise(
        layers, N, limit, over_sums=True)
    assert sd is None and over_sds[0].data_ptr() == layers[0][0].data_ptr()
    assert over_snrs[0].data_ptr() == layers[0][1].data_ptr()
    assert over_left_out == left_out and left_out[0] > 0
    eps = torch.finfo(dtype).eps
    for got, expected in zip(over_sds + over_snrs, sds + snrs):
        torch.testing.assert_close(got, expected, rtol=4 * eps, atol=0)
    assert (over_sds[0] == 0).any() and (over_sds[0] > 0).any()


def test_over_sums_that_overlap_is_formed_into_buffers():
    """Two layers' sums in the same memory: formed into buffers, the sums left as they were."""
    s, t, _ = layer_sums((70_000,), torch.float32, 7)
    before = s.clone(), t.clone()
    sd, snr, sds, _, _ = functional.sd_and_signal_to_noise([(s, t), (s[:10], t[:10])], N, 1e3,
                                                            over_sums=True)
    assert sd is not None and sd.numel() == 70_010
    assert torch.equal(s, before[0]) and torch.equal(t, before[1])
    assert not functional.fused.disjoint([s, t, s[5:7]]) and functional.fused.disjoint([s, t])
