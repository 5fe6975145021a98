"""Coverage of the sweep's models in training mode, where their forward pass draws random numbers.

The architecture sweep (``experiments/architecture_sweep.py``) checks each model in the mode it
was built in (evaluation mode, mostly); its second pass (``--behaviour``) finds which draw random
numbers in training mode (dropout, drop path: ``behaviour.train.random`` in its JSON). This script
runs ``cgn.check_model`` on those models in training mode (float64, its reference replays the
batch's draws), one thread, in one process, and writes per model the sweep's classification
(:func:`architecture_sweep.classify`) and how many elements were left out because a forward
draws random numbers. Run it once per version of the package to compare (issue 32)::

    PYTHONPATH=. python -m experiments.train_mode_coverage --results /tmp/after.json
    python -m experiments.train_mode_coverage --compare /tmp/before.json /tmp/after.json
"""

import argparse
import json
import signal
import time
import warnings

from experiments.architecture_sweep import (
    RESULTS,
    classify,
    computed_in_float32,
    float32_model,
    float32_parameters,
)

TIMEOUT = 120  # seconds by the clock per model


def random_in_training(path=RESULTS) -> list:
    """``[(library, name)]`` of the sweep's records whose training mode draws random numbers."""
    with open(path) as handle:
        results = json.load(handle)["results"]
    return [(r["library"], r["name"]) for r in results.values()
            if ((r.get("behaviour") or {}).get("train") or {}).get("random")]


def _timeout(signum, frame):
    raise TimeoutError(f"over {TIMEOUT} s")


def check_in_training_mode(library: str, name: str) -> dict:
    """The sweep's classification of one model checked in training mode, and the elements
    left out for random draws (``random_elements``)."""
    import cockpit_gradnoise as cgn

    import torch

    from experiments import sweep_models

    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case = sweep_models.build(library, name)
        float32 = computed_in_float32(case)  # (the modules that compute in float32: the sweep's rule)
        model = case.model.train()
        torch.manual_seed(1)
        whole = float32_model(model)
        frame = cgn.check_model(model, case.inputs, case.targets, case.loss_fn, verbose=False,
                                dtype=torch.float32 if whole else torch.float64)
    record = classify(frame, float32_parameters(model, frame, float32) | whole)
    random = [r for r in record["left_out"] if "random" in r["reason"]]
    record["random_elements"] = sum(r["elements"] for r in random)
    record["cpu_seconds"] = time.process_time() - start
    return record


def compare(before_path: str, after_path: str) -> None:
    """Print the models whose coverage changed, and the totals."""
    before, after = (json.load(open(p)) for p in (before_path, after_path))
    full = {"before": 0, "after": 0}
    for key in sorted(set(before) & set(after)):
        b, a = before[key], after[key]
        for label, r in (("before", b), ("after", a)):
            full[label] += r.get("coverage") == 1.0 and r.get("status", "").startswith("exact")
        if b.get("coverage") != a.get("coverage") or b.get("status") != a.get("status"):
            print(f"{key}: {b.get('status')} {b.get('coverage', 0):.4f} ({b.get('random_elements', 0)} "
                  f"left out for draws) -> {a.get('status')} {a.get('coverage', 0):.4f} "
                  f"({a.get('random_elements', 0)})")
    print(f"{len(set(before) & set(after))} models; every element exact: {full['before']} before, "
          f"{full['after']} after")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", help="JSON file to write")
    parser.add_argument("--only", nargs="*", help="library/name")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    import torch

    torch.set_num_threads(1)
    jobs = [tuple(o.split("/", 1)) for o in args.only] if args.only else random_in_training()
    found = {}
    signal.signal(signal.SIGALRM, _timeout)
    for library, name in jobs:
        signal.alarm(TIMEOUT)
        try:
            record = check_in_training_mode(library, name)
        except Exception as error:  # noqa: BLE001 - a model that fails is a row with its message
            record = {"status": "error", "message": f"{type(error).__name__}: {str(error)[:300]}"}
        finally:
            signal.alarm(0)
        found[f"{library}/{name}"] = record
        print(f"{library}/{name}: {record['status']} {record.get('coverage', 0):.4f} "
              f"random {record.get('random_elements', '-')}", flush=True)
        if args.results:
            with open(args.results, "w") as handle:
                json.dump(found, handle, indent=1)


if __name__ == "__main__":
    main()
