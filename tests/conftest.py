"""Fixtures: the case matrix of ``tests/cases.py`` as parameters."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from tests.cases import BATCH_SIZES, MODELS, REDUCTIONS  # noqa: E402


@pytest.fixture(params=MODELS, ids=lambda case: case.name)
def model_case(request):
    return request.param


@pytest.fixture(params=REDUCTIONS)
def reduction(request):
    return request.param


@pytest.fixture(params=BATCH_SIZES, ids=lambda n: f"N{n}")
def batch_size(request):
    return request.param
