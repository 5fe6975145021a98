"""The architecture sweep's second pass: behaviour kept, and a tracked step's time against a plain one.

For one model of ``experiments/sweep_models.py`` (float64 as built), a plain copy and the
model after ``cgn.track(model, every=1)`` (default quantities):

- **eval outputs**: the plain copy's output in evaluation mode against the tracked
  model's, outside a tracked step (the forward pass of a user's step, gradients on) and
  inside one (after ``loss.backward()`` in the ``with tracker(...)`` block). The same
  kernels give the same bits (``torch.equal``; the plain output outside with gradients on
  too, under which torch may choose other kernels); where ``cgn.track`` replaced a module
  (``nn.MultiheadAttention`` by its linear form) the sums are reassociated, and the
  difference is held to :func:`rounding_bound`;
- **dropout still random**: in training mode, the plain copy's outputs at two seeds; if
  they differ (dropout, drop path), the tracked model's must differ too; the tracked
  model at the plain copy's seed gives the plain output (else "other draws" is said);
  a model without randomness must give the plain training-mode output (BatchNorm's
  batch statistics);
- **step time**: CPU time (``time.process_time``, the worker runs one thread) of a plain
  training step (forward, loss, backward, SGD step) and of a tracked one, in training
  mode, the median of ``ROUNDS`` alternated repetitions after one warm-up each (one where
  the tracked warm-up takes over ``SLOW_STEP`` s: the worker's time limit). Tiny
  models: this is the per-module overhead, not what a realistic model pays.
"""

import os
import statistics
import time

# Two kernels computing the same function in a dtype of unit roundoff u (reassociated sums
# of a tiny model: widths and lengths of at most a few hundred, a few layers) differ by at
# most about n u times the output's scale, n the number of rounded operations along a path:
# n = 10^3 (2e-13 of the scale in float64).
ROUNDING_TERMS = 1e3
ROUNDS = 3
SLOW_STEP = 3.0  # CPU seconds of a tracked warm-up step above which one repetition is timed
SEEDS = (1, 2)


def flat_output(output):
    """The model's output as one float64 vector (a tensor, or a tuple of tensors)."""
    import torch

    tensors = output if isinstance(output, (tuple, list)) else (output,)
    return torch.cat([t.detach().flatten().double() for t in tensors if isinstance(t, torch.Tensor)])


def rounding_bound(reference, dtype) -> float:
    """``ROUNDING_TERMS * eps(dtype) * max(1, max |reference|)``: what reassociated
    arithmetic can change (see ``ROUNDING_TERMS``)."""
    import torch

    scale = max(1.0, float(reference.abs().max())) if reference.numel() else 1.0
    return ROUNDING_TERMS * torch.finfo(dtype).eps * scale


def compared(reference, other, dtype) -> dict:
    """``identical`` (the same bits), the largest absolute difference and the bound."""
    import torch

    identical = reference.shape == other.shape and torch.equal(reference, other)
    difference = (0.0 if identical else float("inf") if reference.shape != other.shape
                  else float((reference - other).abs().max()))
    return {"identical": identical, "max_abs_diff": difference,
            "bound": rounding_bound(reference, dtype)}


def _within(comparison: dict) -> bool:
    return comparison["identical"] or comparison["max_abs_diff"] <= comparison["bound"]


def per_example_losses(logits, targets):
    """One loss per example whose mean is ``sweep_models.logits_loss`` (every example has
    the same number of positions)."""
    import torch.nn.functional as F

    losses = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
    return losses.view(targets.shape).flatten(1).mean(1) if targets.dim() > 1 else losses


def _forward(model, inputs, train: bool, seed=None):
    import torch

    model.train(train)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return flat_output(model(*inputs))


def eval_outputs(case, plain, model, tracker) -> dict:
    """Plain against tracked in evaluation mode, outside and inside a tracked step (step 0);
    in the mode the case was built in, where that is training mode without randomness (a
    backward pass that runs in training mode only: Reformer's)."""
    import torch

    dtype = next(p.dtype for p in plain.parameters() if p.is_floating_point())
    # training mode where every module was built in it (a wrapper such as ``sweep_models.Logits``
    # is left in training mode around a model in evaluation mode)
    built_training = all(module.training for module in plain.modules())
    reference = _forward(plain, case.inputs, train=built_training)
    # with gradients on, torch can pick other kernels (attention): plain against tracked alike
    reference_with_grad = flat_output(plain(*case.inputs))
    model.train(built_training)
    logits = model(*case.inputs)  # a user's forward pass: gradients on
    outside = flat_output(logits)
    with tracker(0, per_example_losses(logits, case.targets)) as loss:
        loss.backward()
        with torch.no_grad():
            inside = flat_output(model(*case.inputs))
    model.zero_grad(set_to_none=True)
    return {"outside": compared(reference_with_grad, outside, dtype),
            "inside": compared(reference, inside, dtype)}


def train_outputs(case, plain, model) -> dict:
    """Training mode: whether the plain copy is random, whether the tracked model still is,
    and the tracked output at the plain copy's first seed."""
    import torch

    dtype = next(p.dtype for p in plain.parameters() if p.is_floating_point())
    first, second = (_forward(plain, case.inputs, True, seed) for seed in SEEDS)
    random = not torch.equal(first, second)
    tracked_first = _forward(model, case.inputs, True, SEEDS[0])
    result = {"random": random, "same_seed": compared(first, tracked_first, dtype)}
    if random:
        result["tracked_random"] = not torch.equal(tracked_first, _forward(model, case.inputs, True, SEEDS[1]))
    return result


def _plain_step(case, model, optimizer, step):
    optimizer.zero_grad(set_to_none=True)
    case.loss_fn(model(*case.inputs), case.targets).backward()
    optimizer.step()


def _tracked_step(case, model, optimizer, step, tracker):
    optimizer.zero_grad(set_to_none=True)
    losses = per_example_losses(model(*case.inputs), case.targets)
    with tracker(step, losses, optimizer=optimizer) as loss:
        loss.backward()
    optimizer.step()


def step_times(case, plain, model, tracker) -> dict:
    """Median CPU seconds of a plain and of a tracked training step, alternated."""
    import torch

    plain.train()
    model.train()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    tracked_opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = {"plain": [], "tracked": []}
    rounds, step = ROUNDS, 0
    while step < rounds + 1:  # step 1: the warm-up of each
        step += 1
        for kind, run in (("plain", lambda: _plain_step(case, plain, plain_opt, step)),
                          ("tracked", lambda: _tracked_step(case, model, tracked_opt, step, tracker))):
            start = time.process_time()
            run()
            times[kind].append(time.process_time() - start)
        if step == 1 and times["tracked"][0] > SLOW_STEP:
            rounds = 1  # within the worker's time limit
    plain_s, tracked_s = statistics.median(times["plain"][1:]), statistics.median(times["tracked"][1:])
    return {"plain_ms": 1e3 * plain_s, "tracked_ms": 1e3 * tracked_s, "rounds": rounds,
            "ratio": tracked_s / plain_s if plain_s > 0 else None}


def verdict(behaviour: dict) -> str:
    """``kept``, or what differs (a package defect)."""
    differs = []
    for where in ("outside", "inside"):
        comparison = behaviour.get("eval", {}).get(where)
        if comparison and not _within(comparison):
            differs.append(f"eval output {where} the step differs by {comparison['max_abs_diff']:.1e} "
                           f"(bound {comparison['bound']:.1e})")
    train = behaviour.get("train", {})
    if train.get("random") and not train.get("tracked_random"):
        differs.append("training mode no longer random")
    same = train.get("same_seed")
    if same and not _within(same) and not train.get("random"):
        differs.append(f"training-mode output differs by {same['max_abs_diff']:.1e}")
    if "error" in behaviour:
        differs.append(f"error: {behaviour['error']}")
    if differs:
        return "; ".join(differs)
    if "train_not_measured" in behaviour:
        return f"kept in evaluation mode; training mode not measured: {behaviour['train_not_measured']}"
    return "kept"


def plain_training_failure(case, plain) -> str:
    """Why the plain copy cannot take a training step (torchvision's Inception and
    GoogLeNet: auxiliary heads in training mode, a tuple of outputs or a kernel larger
    than the tiny image), or ``""``: a limit of the sweep's case, not of the package."""
    import torch

    plain.train()
    try:
        _plain_step(case, plain, torch.optim.SGD(plain.parameters(), lr=0.0), 0)
    except Exception as error:  # noqa: BLE001 - the reason is the cell's text
        return f"the plain model's training step raises {type(error).__name__}: {str(error)[:150]}"
    return ""


def _plain_copy(model, rebuild):
    """A copy of ``model``: ``cgn.check``'s deep copy, else ``rebuild()``, checked to hold
    the same parameters."""
    from cockpit_gradnoise.check import _copy

    import torch

    try:
        return _copy(model)
    except RuntimeError:
        if rebuild is None:
            raise
    plain = rebuild()
    same = [torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True)]
    if not all(same):
        raise RuntimeError("the model built again differs from the first build: no plain copy")
    return plain


def behaviour_one(case, track=None, rebuild=None) -> dict:
    """The behaviour and the step times of ``case``'s model (changed: it is tracked); an
    ``error`` with the message where tracking it raised (the parts measured so far kept).
    ``track``: ``cgn.track`` (a test passes one that changes the model); ``rebuild``: a
    function giving the same model again, for the plain copy where ``copy.deepcopy``
    refuses the model (RecurrentGemma: a tensor with a graph in a buffer)."""
    import traceback
    import warnings

    import cockpit_gradnoise as cgn

    behaviour = {}
    try:
        plain = _plain_copy(case.model, rebuild)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, tracker = (track or cgn.track)(case.model, every=1)
            behaviour["eval"] = eval_outputs(case, plain, model, tracker)
            plain_failure = plain_training_failure(case, plain)
            if plain_failure:
                behaviour["train_not_measured"] = plain_failure
            else:
                behaviour["train"] = train_outputs(case, plain, model)
                behaviour["time"] = step_times(case, plain, model, tracker)
    except Exception as error:  # noqa: BLE001 - a finding: a user's tracked step raises
        where = traceback.extract_tb(error.__traceback__)[-1]
        behaviour["error"] = (f"{type(error).__name__}: {str(error)[:300]} "
                              f"({os.path.relpath(where.filename)}:{where.lineno})")
    behaviour["verdict"] = verdict(behaviour)
    return behaviour


def behaviour_record(library: str, name: str) -> dict:
    """``{"library", "name", "behaviour"}`` of one architecture (in the sweep's worker):
    the fields this pass merges into the sweep's record."""
    import warnings

    from experiments import sweep_models

    start, cpu = time.perf_counter(), time.process_time()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case = sweep_models.build(library, name)
    except Exception as error:  # noqa: BLE001 - sweep_models.Unavailable or a builder's bug
        behaviour = {"skipped": f"build: {type(error).__name__}: {error}"[:300]}
    else:
        behaviour = behaviour_one(case, rebuild=lambda: sweep_models.build(library, name).model)
    behaviour.update(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu)
    return {"library": library, "name": name, "behaviour": behaviour}
