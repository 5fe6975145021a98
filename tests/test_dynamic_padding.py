"""Issue 32: a new sequence length at every step (dynamic padding), surveyed once per structure.

The survey of the layers on rows that are not examples and the check that the examples do
not mix (``extensions/fallback/regroup.py``, ``mixing.py``) ran at every new shape of the
inputs, every step under dynamic padding. A new length of inputs of a structure surveyed
before now runs one pass without gradients, and the full survey only where that pass's
signature (each module's calls, which of their outputs and inputs lead with the batch)
differs. Reference: one backward pass per example through one float64 forward pass of
the batch on an un-prepared copy (``check.reference_contributions``).
"""

import copy
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import check
from cockpit_gradnoise.extensions.fallback import mixing

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import Problem, classification_losses, run_step
from tests.test_regroup import WithSequenceFirst
from tests.test_tied import assert_matches_references

WINDOW = 4


class Windows(nn.Module):
    """A layer on windows of ``WINDOW`` tokens, ``[N * T / WINDOW, WINDOW, C]``: at one window
    its rows are the examples, at two or more they are not."""

    def __init__(self, width=4):
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x):  # [N, T, C]
        n, t, c = x.shape
        windows = x.reshape(n * (t // WINDOW), WINDOW, c).cumsum(1)
        return torch.tanh(self.inner(windows)).reshape(n, t, c)


class WithWindows(WithSequenceFirst):
    """``head(Windows(embed(x)).mean(1))``."""

    def __init__(self, width=4):
        super().__init__(width)
        self.block = Windows(width)


def batch(examples, length, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(examples, length, 3, dtype=torch.float64, generator=generator)
    return inputs, torch.randint(0, 3, (examples,), generator=generator)


@pytest.fixture
def surveys(monkeypatch):
    """The number of full surveys (each ends with the mixing check)."""
    counted = []
    original = mixing.check

    def counting(*args):
        counted.append(1)
        return original(*args)

    monkeypatch.setattr(mixing, "check", counting)
    return counted


def tracked_lengths(lengths, examples=3, make=WithWindows):
    """A prepared ``make()`` tracked at each of ``lengths`` in turn, the last step compared
    with the reference (no warning allowed)."""
    torch.manual_seed(0)
    model = make().double()
    reference = copy.deepcopy(model)
    loss_fn, per_example_loss = classification_losses("mean")
    prepared = cgn.prepare_model(model)
    for step, length in enumerate(lengths[:-1]):
        inputs, targets = batch(examples, length, step)
        problem = Problem(prepared, extend(loss_fn), per_example_loss, inputs, targets, "mean")
        run_step(problem, [cgn.PerExampleGradNorm(linear(1), param_names=problem.names)], step=step)
    inputs, targets = batch(examples, lengths[-1], len(lengths))
    contributions = check.reference_contributions(reference, (inputs,), targets, loss_fn)
    grads = {name: x * examples for name, x in contributions.items()}
    problem = Problem(prepared, extend(loss_fn), per_example_loss, inputs, targets, "mean")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert_matches_references(problem, 1, grads=grads)


def test_a_new_length_of_a_surveyed_structure_runs_no_survey_and_stays_exact(surveys):
    """Two windows, then three: the same calls with the same rows per example."""
    tracked_lengths([2 * WINDOW, 3 * WINDOW])
    assert len(surveys) == 1


def test_a_new_length_whose_rows_stop_being_examples_is_surveyed_again(surveys):
    """One window (the layer's rows are the examples, no block), then two: the layer's
    output no longer leads with the batch, the signature differs, the survey hooks its block;
    then three, with the signature of two (every surveyed signature is kept)."""
    tracked_lengths([WINDOW, 2 * WINDOW, 3 * WINDOW])
    assert len(surveys) == 2


def test_a_length_equal_to_the_batch_size_is_surveyed_again(surveys):
    """A sequence-first layer (``[T, N, C]``) whose leading size, the length, equals the
    batch size at the new length (the coincidence no shape tells): the signature differs."""
    tracked_lengths([5, 4, 3], examples=3, make=WithSequenceFirst)
    assert len(surveys) == 2
