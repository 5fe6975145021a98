"""The benchmark's models checked on a device: the package's per-example results there
against the float64 brute force there (``cgn.check_model``), before timing them.

For each model of ``benchmark.py`` (the GPT, resnet18, the Mixtral-style mixture of
experts, the small Swin; random weights), a batch of a few examples on ``--device``:
``cgn.check_model`` runs float64 copies, a per-example loop (one backward pass per
example) and the package's extensions, and compares each trainable parameter's
per-example squared norms, sums of contributions and of their squares, and gradient.
A model passes as the architecture sweep's ``classify`` says "exact": every trainable
element covered, every relative error within ``experiments.architecture_sweep.TOLERANCE``
(issue 32's "exact to 1e-10 (float64)"), where a gradient that is zero by structure (an
attention key's bias: rounding noise in the reference) is measured against the network's
largest contribution. The mixture of experts runs its experts by ``transformers``' eager
loop here: its grouped products take no float64.

The quantities themselves (quantiles, norms, noise scale, ratios) against the references
on a device: ``CGN_TEST_DEVICE=cuda pytest tests/test_core_quantities.py ...``
(``tests/cases.py``), as ``benchmarks/gpu_check.sh`` runs them. ::

    python -m benchmarks.check_device --device cuda
    python -m benchmarks.check_device --device cpu --models gpt,moe
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn

import torch

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.models import MODELS, model_and_batch  # noqa: E402
from experiments.architecture_sweep import TOLERANCE, classify  # noqa: E402


def with_eager_experts(model):
    """``model`` with ``transformers``' experts run by their eager loop, where it has any."""
    setter = getattr(getattr(model, "model", None), "set_experts_implementation", None)
    if setter is not None and getattr(model.model.config, "_experts_implementation", None) is not None:
        setter("eager")
    return model


def check(name, batch, device):
    """The sweep's verdict (``classify``: status, coverage, worst relative error, ...) on
    ``cgn.check_model``'s table of model ``name``, and the seconds it took."""
    spec = MODELS[name]
    model, x, y = model_and_batch(spec, batch, device)
    start = time.perf_counter()
    frame = cgn.check_model(with_eager_experts(model), x, y, spec.loss("mean"), verbose=False)
    return classify(frame, float32=set()), time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,resnet18,moe,swin")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    print(f"torch {torch.__version__}, device {device}, batch {args.batch_size}, float64, "
          f"tolerance {TOLERANCE:g}", flush=True)
    failed = []
    for name in args.models.split(","):
        verdict, seconds = check(name, args.batch_size, device)
        passed = verdict["status"] == "exact" and verdict["coverage"] == 1.0
        print(f"  {name}: {verdict['status']}, coverage {verdict['coverage']:.4f}, largest relative error "
              f"{verdict['worst_rel_error']:.2e} ({verdict['worst_param']}), zero by structure "
              f"{len(verdict['zero_by_structure'])}, {seconds:.1f} s: {'PASS' if passed else 'FAIL'}", flush=True)
        if not passed:
            failed.append(name)
    print("check_device: " + (f"FAILED {failed}" if failed else "all passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
