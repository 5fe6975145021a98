"""Padded sequences: ``cgn.sequence_losses`` against a per-example loop in float64.

The recipes of ``docs/training-setups.md``, run here in full.

The batch loss is what language models train on, the mean over all labelled
tokens (``F.cross_entropy(..., ignore_index=-1)`` over the flattened batch).
Example ``i``'s loss is ``L_i = N sum_t m_it l_it / n``; the reference
differentiates exactly that, one example at a time.
"""

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references

import pytest
import torch
import torch.nn.functional as F

from tests.cases import CONTEXT, VOCABULARY, gpt
from tests.helpers import assert_statistics_match, rows, sd_rtol

PAD = -1
N = 5


def padded_batch():
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCABULARY, (N, CONTEXT), generator=generator)
    targets = torch.randint(0, VOCABULARY, (N, CONTEXT), generator=generator)
    targets[1, 2:] = PAD  # a short sequence
    targets[3, 1:] = PAD
    targets[4, :] = PAD  # no labelled token: loss and gradient 0
    return tokens, targets


def token_losses(logits, targets):
    flat = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD,
                           reduction="none")
    return flat.view(targets.shape)


def test_the_mean_of_the_sequence_losses_is_the_token_mean_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(N, CONTEXT, VOCABULARY, dtype=torch.float64)
    _, targets = padded_batch()
    losses = cgn.sequence_losses(token_losses(logits, targets), targets, ignore_index=PAD)
    token_mean = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD)
    # Two sums of at most N*T positive terms, in different orders.
    bound = 2 * N * CONTEXT * torch.finfo(torch.float64).eps * token_mean.item()
    assert abs(losses.mean().item() - token_mean.item()) <= bound
    assert losses[4].item() == 0.0


def test_sequence_losses_by_example_are_each_sequences_token_mean():
    torch.manual_seed(0)
    logits = torch.randn(N, CONTEXT, VOCABULARY, dtype=torch.float64)
    _, targets = padded_batch()
    targets[4, 0] = 2
    tokens = token_losses(logits, targets)
    tokens[targets == PAD] = float("nan")  # never read
    losses = cgn.sequence_losses(tokens, targets, ignore_index=PAD, weighting="examples")
    for i in range(N):
        keep = targets[i] != PAD
        expected = F.cross_entropy(logits[i][keep], targets[i][keep])
        assert losses[i].item() == pytest.approx(expected.item(), rel=4 * CONTEXT * 2.0**-52)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "give labels= .* or mask="),
    ({"weighting": "mean"}, "weighting must be one of"),
    ({"labels": torch.zeros(N, 2, dtype=torch.long)}, "same shape"),
])
def test_bad_arguments_are_refused_naming_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cgn.sequence_losses(torch.zeros(N, CONTEXT), **kwargs)


def test_a_batch_without_a_labelled_token_and_an_empty_sequence_by_example_are_refused():
    targets = torch.full((N, CONTEXT), PAD)
    with pytest.raises(ValueError, match="no token of the batch is labelled"):
        cgn.sequence_losses(torch.zeros(N, CONTEXT), targets, ignore_index=PAD)
    _, targets = padded_batch()
    with pytest.raises(ValueError, match=r"sequences \[4\] have no labelled token"):
        cgn.sequence_losses(torch.zeros(N, CONTEXT), targets, ignore_index=PAD,
                            weighting="examples")


def test_quantities_of_a_padded_batch_match_a_per_example_loop():
    torch.manual_seed(0)
    model, tracker = cgn.track(gpt().double(), every=1,
                               quantities=["GradientVarianceQuantiles", "PerExampleGradNorm",
                                           "GradientNoiseScale"])
    tokens, targets = padded_batch()
    losses = cgn.sequence_losses(token_losses(model(tokens), targets), targets, ignore_index=PAD)
    with tracker(0, losses) as loss:
        loss.backward()
    labelled = int((targets != PAD).sum())

    def per_example_loss(logits, example_targets):
        # L_i of the batch: its token losses' sum times N / (labelled tokens of the batch).
        return token_losses(logits, example_targets).sum(1) * (N / labelled)

    grads = references.per_example_gradients(model, per_example_loss, tokens, targets)
    for name in grads:  # the empty sequence's gradient is zero by construction
        grads[name][4] = 0.0
    quantiles = tracker.cockpit.quantities[0].quantiles
    expected = references.gradient_variance_quantiles(
        model, None, tokens, targets, reduction="mean", quantiles=quantiles, gradients=grads)
    tolerances = {name: sd_rtol(grads, N, name, CONTEXT) for name in expected}
    assert_statistics_match(rows(tracker, "GradientVarianceQuantiles"), expected,
                            rtol_of=lambda name, statistic: tolerances[name])
    norms = references.per_example_grad_norm(
        model, None, tokens, targets, quantiles=tracker.cockpit.quantities[1].quantiles,
        gradients=grads)
    assert_statistics_match(rows(tracker, "PerExampleGradNorm"), norms)
    noise = references.gradient_noise_scale(model, None, tokens, targets, gradients=grads)
    got = rows(tracker, "GradientNoiseScale")
    for name, stats in noise.items():
        for statistic in ("grad_sq", "trace_cov"):
            assert got[name][statistic] == pytest.approx(stats[statistic], rel=1e-10)
