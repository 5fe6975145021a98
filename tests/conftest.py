"""Fixtures: the case matrix of ``tests/cases.py`` as parameters.

``CGN_TEST_MKLDNN=0`` runs the suite with ``torch.backends.mkldnn`` off (other
CPU kernels: the results must stay within their bounds). The fixture ``paths``
runs a test on the CPU's paths and on those of other devices, by setting
``cockpit_gradnoise._device.on_host``, the one switch between them.
"""

import os

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.cases import BATCH_SIZES, MODELS, REDUCTIONS  # noqa: E402

if os.environ.get("CGN_TEST_MKLDNN") == "0":
    torch.backends.mkldnn.enabled = False


@pytest.fixture
def one_thread():
    """Tiny models: a second thread only adds waiting, a lot of it on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

@pytest.fixture(params=["cpu", "other-devices"])
def paths(request, monkeypatch):
    """The CPU's paths, and those taken on other devices (GPUs), run on CPU tensors."""
    if request.param == "other-devices":
        from cockpit_gradnoise import _device

        monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    return request.param


def _free(metafunc, name):
    """Whether ``name`` is a fixture of the test that no ``parametrize`` mark sets."""
    marked = {
        arg.strip()
        for mark in metafunc.definition.iter_markers("parametrize")
        for arg in (mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0])
    }
    return name in metafunc.fixturenames and name not in marked

def pytest_generate_tests(metafunc):
    """``model_case`` x ``reduction`` x ``batch_size``, each case with its own batch sizes."""
    if _free(metafunc, "model_case") and _free(metafunc, "batch_size"):
        pairs = [(case, n) for case in MODELS for n in case.batch_sizes or BATCH_SIZES]
        metafunc.parametrize(
            "model_case, batch_size", pairs, ids=[f"{case.name}-N{n}" for case, n in pairs]
        )
    elif _free(metafunc, "model_case"):
        metafunc.parametrize("model_case", MODELS, ids=[case.name for case in MODELS])
    elif _free(metafunc, "batch_size"):
        metafunc.parametrize("batch_size", BATCH_SIZES, ids=[f"N{n}" for n in BATCH_SIZES])
    if _free(metafunc, "reduction"):
        metafunc.parametrize("reduction", REDUCTIONS)
