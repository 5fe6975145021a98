"""Does the gradient noise scale predict the critical batch size?

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch
Training" (arXiv:1812.06162): the steps ``S`` and examples ``E = B S`` that
batch size ``B`` needs to reach a fixed loss (learning rate tuned per batch
size) follow ``(S / S_min - 1) (E / E_min - 1) = 1``, that is
``S = S_min + E_min / B``; the critical batch size ``B_crit = E_min / S_min``
is close to the noise scale, which ``B_simple = tr(Sigma) / |G|^2``
approximates. For each task this script trains every batch size of
``--batch-sizes`` with every learning rate of the task's grid until the
validation loss reaches the task's target, fits ``S_min, E_min``, measures
``GradientNoiseScale``'s smoothed ``B_simple`` along one more run, and writes
a figure per task and a markdown page with the numbers to ``--out``.

    python -m experiments.critical_batch_size --out docs/experiments
    python -m experiments.critical_batch_size --quick --out /tmp/cbs

The tasks: the digits CNN of ``experiments.train_digits`` (plain SGD), and a
character-level GPT (``experiments.models.GPT``, Adam) trained on source
files of Python's own standard library. Nothing downloads.
"""

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import cockpit_gradnoise as cgn

import backpack
import matplotlib
import matplotlib.ticker
import numpy as np
import scipy
import scipy.optimize
import torch
from cockpit.utils.schedules import linear
from torch import nn

from experiments.models import GPT, TokenCrossEntropy
from experiments.train_digits import digits_cnn

#: Batch sizes of the full run: 8 to 512 in powers of two.
BATCH_SIZES = (8, 16, 32, 64, 128, 256, 512)
#: The factor within which McCandlish et al.'s Figure 4 shows B_simple and
#: B_crit agreeing across their tasks (roughly an order of magnitude).
PAPER_FACTOR = 10.0
PAGE = "critical-batch-size.md"
RESULTS = "critical-batch-size.json"


# ----------------------------------------------------------------------------
# Pure functions: the formulas
# ----------------------------------------------------------------------------


def steps_to_target(steps, losses, target) -> float:
    """First step at which ``losses`` reach ``target``, interpolated between evaluations.

    The loss is evaluated at ``steps`` (increasing); the crossing between two
    evaluations ``(s0, l0)``, ``(s1, l1)`` with ``l0 > target >= l1`` is placed
    on the straight line between them,
    ``s0 + (s1 - s0) (l0 - target) / (l0 - l1)``.

    Returns:
        The step as a float; ``steps[0]`` if the first loss is already at or
        below the target; ``inf`` if the target is never reached.
    """
    steps, losses = np.asarray(steps, dtype=float), np.asarray(losses, dtype=float)
    if steps.shape != losses.shape or steps.ndim != 1:
        raise ValueError(f"steps and losses must be 1-d of one length, got {steps.shape}, "
                         f"{losses.shape}")
    reached = np.flatnonzero(losses <= target)
    if reached.size == 0:
        return math.inf
    i = reached[0]
    if i == 0:
        return float(steps[0])
    s0, s1, l0, l1 = steps[i - 1], steps[i], losses[i - 1], losses[i]
    return float(s0 + (s1 - s0) * (l0 - target) / (l0 - l1))


def predicted_steps(batch_size, s_min, e_min):
    """Steps the paper's model predicts for batch size ``B``: ``S = S_min + E_min / B``.

    Equivalent to ``(S / S_min - 1)(E / E_min - 1) = 1`` with ``E = B S``
    (McCandlish et al. 2018, eq. 2.11).
    """
    return s_min + e_min / np.asarray(batch_size, dtype=float)


def fit_steps_examples(batch_sizes, steps) -> Tuple[float, float]:
    """``S_min, E_min`` of McCandlish et al.'s hyperbola, by least squares in log space.

    Minimizes ``sum_B (log S_B - log(S_min + E_min / B))^2`` over
    ``S_min, E_min >= 0`` (relative errors: steps span orders of magnitude),
    from the weighted linear fit of ``S`` against ``1 / B``. Points with a
    non-finite ``S`` (target not reached) are left out.

    Returns:
        ``(S_min, E_min)``; NaN for both, with a warning, when fewer than two
        points remain. A parameter at its bound 0 is a defined result:
        ``E_min = 0`` (steps do not fall with batch size: ``B_crit = 0``) or
        ``S_min = 0`` (steps fall as ``1 / B`` throughout: ``B_crit`` above
        the measured range); either comes with a warning.
    """
    b, s = np.asarray(batch_sizes, dtype=float), np.asarray(steps, dtype=float)
    keep = np.isfinite(s) & (s > 0)
    b, s = b[keep], s[keep]
    if len(b) < 2:
        warnings.warn(f"fit_steps_examples needs two batch sizes that reached the target, "
                      f"got {len(b)}; S_min and E_min are NaN", stacklevel=2)
        return math.nan, math.nan
    # Linear least squares of S on (1, 1/B) weighted by 1/S: relative errors, as below.
    design = np.stack([np.ones_like(b), 1.0 / b], axis=1) / s[:, None]
    start, *_ = np.linalg.lstsq(design, np.ones_like(s), rcond=None)
    floor = 1e-3 * np.array([s.min(), (b * s).min()])  # an interior start for the bounds
    start = np.maximum(start, floor)
    def cost(p):
        return float(np.sum((np.log(predicted_steps(b, *p)) - np.log(s)) ** 2))

    interior = scipy.optimize.least_squares(
        lambda p: np.log(predicted_steps(b, *p)) - np.log(s),
        start, bounds=(0.0, np.inf), x_scale=floor * 1e3, xtol=1e-14, ftol=1e-14, gtol=1e-14,
    ).x
    # The optimizer only approaches a bound; the fits on the bounds have closed
    # forms (geometric means), and the best of the three is the answer.
    on_bounds = [(np.exp(np.mean(np.log(s))), 0.0), (0.0, np.exp(np.mean(np.log(b * s))))]
    best = min([tuple(interior)] + on_bounds, key=cost)
    s_min, e_min = (float(v) for v in best)
    if s_min == 0.0 or e_min == 0.0:
        warnings.warn(f"the fit sits at a bound (S_min={s_min:.3g}, E_min={e_min:.3g}): "
                      "the steps do not follow the hyperbola over these batch sizes",
                      stacklevel=2)
    return s_min, e_min


def critical_batch(s_min, e_min) -> float:
    """``B_crit = E_min / S_min``; ``inf`` for ``S_min = 0 < E_min``, NaN if undefined."""
    if not (math.isfinite(s_min) and math.isfinite(e_min)):
        return math.nan
    if s_min <= 0:
        return math.inf if e_min > 0 else math.nan
    return e_min / s_min


def value_at_step(steps, values, step) -> float:
    """The value tracked at the last of ``steps`` at or before ``step`` (NaN if none)."""
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    before = np.flatnonzero(steps <= step)
    return float(values[before[-1]]) if before.size and math.isfinite(step) else math.nan


def value_range(steps, values, first, last) -> Tuple[float, float]:
    """Smallest and largest of the finite ``values`` tracked at steps in ``[first, last]``."""
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    inside = values[(steps >= first) & (steps <= last) & np.isfinite(values)]
    return (float(inside.min()), float(inside.max())) if inside.size else (math.nan, math.nan)


def agreement_factor(b_crit, b_simple) -> float:
    """How far apart two batch sizes are, as a factor ``>= 1``: ``max(a/b, b/a)``."""
    if not (b_crit > 0 and b_simple > 0) or math.isinf(b_crit) or math.isinf(b_simple):
        return math.nan
    return max(b_crit / b_simple, b_simple / b_crit)


# ----------------------------------------------------------------------------
# The tasks
# ----------------------------------------------------------------------------


@dataclass
class Task:
    """One training problem: model, data, optimizer, learning-rate grid and target.

    ``sample(batch_size, generator)`` draws a batch of i.i.d. training
    examples; ``validation_loss(model)`` is the mean loss on a fixed
    validation set; ``losses()`` is ``(mean loss, per-example loss)``.
    """

    name: str
    title: str
    unit: str
    make_model: Callable[[], nn.Module]
    losses: Callable[[], Tuple[nn.Module, nn.Module]]
    sample: Callable[[int, torch.Generator], Tuple[torch.Tensor, torch.Tensor]]
    validation_loss: Callable[[nn.Module], float]
    optimizer: str  # "sgd" (plain) or "adam"
    learning_rates: Sequence[float]
    target: float
    max_steps: int
    eval_examples: int  # evaluate every max(1, eval_examples // B) steps
    gns_batch: int
    description: str = ""
    data_note: str = ""

    def eval_every(self, batch_size):
        return max(1, self.eval_examples // batch_size)

    def make_optimizer(self, params, lr):
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr)
        return torch.optim.Adam(params, lr=lr)


def digits_task(learning_rates, target, max_steps, gns_batch, seed=0) -> Task:
    """The digits CNN of ``experiments.train_digits`` with plain SGD; its 1500/297 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, val = order[:1500], order[1500:]

    def sample(batch_size, generator):
        index = train[torch.randint(len(train), (batch_size,), generator=generator)]
        return images[index], labels[index]

    def validation_loss(model):
        with torch.no_grad():
            return nn.functional.cross_entropy(model(images[val]), labels[val]).item()

    return Task(
        name="digits", title="digits CNN (scikit-learn's 8x8 digits)", unit="images",
        make_model=digits_cnn,
        losses=lambda: (nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="none")),
        sample=sample, validation_loss=validation_loss, optimizer="sgd",
        learning_rates=learning_rates, target=target, max_steps=max_steps,
        eval_examples=64, gns_batch=gns_batch,
        description="`experiments.train_digits.digits_cnn` (2 convolutions, 2 linear layers, "
                    "6,922 parameters), cross-entropy, plain SGD (no momentum, constant "
                    "learning rate)",
        data_note="1,500 training images (batches drawn uniformly with replacement), the "
                  "other 297 for validation (the split of `experiments.train_digits`)",
    )


#: Standard-library files read for the character-level model, in this order.
STDLIB_FILES = (
    "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "csv.py",
    "dataclasses.py", "difflib.py", "enum.py", "fractions.py", "functools.py", "heapq.py",
    "inspect.py", "os.py", "random.py", "shutil.py", "string.py", "textwrap.py",
    "threading.py", "tokenize.py", "typing.py", "weakref.py", "json/decoder.py",
    "json/encoder.py", "logging/__init__.py", "collections/__init__.py",
    "email/message.py", "http/client.py", "unittest/case.py",
)
#: Newline and printable ASCII: 96 characters.
VOCABULARY = "\n" + "".join(chr(c) for c in range(32, 127))
#: Tabs and every other character outside the vocabulary become this one.
REPLACEMENT = "?"


def encode_text(text) -> torch.Tensor:
    """Indices into :data:`VOCABULARY`; characters outside it map to :data:`REPLACEMENT`."""
    index = {c: i for i, c in enumerate(VOCABULARY)}
    other = index[REPLACEMENT]
    return torch.tensor([index.get(c, other) for c in text], dtype=torch.long)


def stdlib_text(files=STDLIB_FILES, validation_fraction=0.1):
    """Train and validation characters from the standard library's own sources.

    Each file's last ``validation_fraction`` goes to validation, the rest to
    training (so both see every file's style). Files this Python lacks are
    left out, with a warning.

    Returns:
        ``(train, validation, files used)``: two 1-d index tensors and the
        list of the files read.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, used = [], [], []
    for name in files:
        path = root / name
        if not path.is_file():
            warnings.warn(f"{path} does not exist in this Python; left out", stacklevel=2)
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        cut = int(len(text) * (1 - validation_fraction))
        train.append(text[:cut])
        val.append(text[cut:])
        used.append(name)
    if not used:
        raise FileNotFoundError(f"none of the standard-library files exist under {root}")
    return encode_text("\n".join(train)), encode_text("\n".join(val)), used


def gpt_task(learning_rates, target, max_steps, gns_batch, seed=0, context=32,
             validation_windows=256) -> Task:
    """A 2-layer character-level GPT (width 64, context ``context``) with Adam."""
    train, val, used = stdlib_text()
    # Fixed validation windows, the same for every run.
    starts = torch.randint(len(val) - context - 1, (validation_windows,),
                           generator=torch.Generator().manual_seed(seed + 1))
    val_x = torch.stack([val[s:s + context] for s in starts])
    val_y = torch.stack([val[s + 1:s + context + 1] for s in starts])

    def sample(batch_size, generator):
        s = torch.randint(len(train) - context - 1, (batch_size,), generator=generator)
        window = s[:, None] + torch.arange(context + 1)
        chunk = train[window]
        return chunk[:, :-1], chunk[:, 1:]

    def validation_loss(model):
        with torch.no_grad():
            return TokenCrossEntropy()(model(val_x), val_y).item()

    return Task(
        name="gpt", title=f"character-level GPT (Python's standard library, context {context})",
        unit=f"sequences of {context} characters",
        make_model=lambda: GPT(len(VOCABULARY), context, width=64, heads=4, layers=2),
        losses=lambda: (TokenCrossEntropy(), TokenCrossEntropy("none")),
        sample=sample, validation_loss=validation_loss, optimizer="adam",
        learning_rates=learning_rates, target=target, max_steps=max_steps,
        eval_examples=512, gns_batch=gns_batch,
        description=f"`experiments.models.GPT` (2 pre-norm blocks, width 64, 4 heads, "
                    f"context {context}, vocabulary {len(VOCABULARY)}, untied head, 114,048 "
                    f"parameters), mean per-token cross-entropy, Adam (constant learning rate)",
        data_note=f"{len(used)} files of the standard library of Python "
                  f"{platform.python_version()} ({', '.join(used)}); each file's first 90% "
                  f"for training ({len(train):,} characters, windows drawn uniformly), its "
                  f"last 10% for validation ({len(val):,} characters, {validation_windows} "
                  f"fixed windows); newline and printable ASCII, every other character "
                  f"(tabs included) read as `{REPLACEMENT}`",
    )


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


@dataclass
class Run:
    """One training run: its validation curve and when it reached the target."""

    batch_size: int
    lr: float
    eval_steps: List[int] = field(default_factory=list)
    eval_losses: List[float] = field(default_factory=list)
    steps: float = math.inf  # to the target; inf if not reached
    pruned: bool = False  # stopped once it could no longer beat the best run
    diverged: bool = False  # stopped at a validation loss that is not finite
    cockpit: object = None  # the Cockpit, when quantities were tracked

    def outcome(self) -> str:
        """The steps to the target, or why there are none."""
        if math.isfinite(self.steps):
            return f"{self.steps:.1f}"
        return "pruned" if self.pruned else "diverged" if self.diverged else "not reached"


def train(task, batch_size, lr, seed, *, max_steps, stop_after=math.inf, quantities=None,
          continue_after_target=1.0) -> Run:
    """Train from the seed's initialization until the validation loss reaches the target.

    Args:
        task: The :class:`Task`.
        batch_size: Examples per step.
        lr: Learning rate.
        seed: Seeds the initialization and the batches: every run of a task
            starts from the same weights.
        max_steps: Give up after this many steps.
        stop_after: Stop (``pruned``) once past this many steps without
            reaching the target: the best run so far took that many.
        quantities: Cockpit quantities to track (the model is then extended
            with BackPACK); the Cockpit that holds their results is
            ``run.cockpit``.
        continue_after_target: With quantities, train on to this many times
            the steps the target took (to see the noise scale beyond it).
    """
    torch.manual_seed(seed)
    model = task.make_model()
    loss_fn, per_example = task.losses()
    run, cockpit = Run(batch_size, lr), None
    if quantities is not None:
        model, loss_fn = cgn.prepare_model(model), backpack.extend(loss_fn)
        cockpit = run.cockpit = cgn.Cockpit(model.parameters(), quantities=quantities)
    opt = task.make_optimizer(model.parameters(), lr)
    generator = torch.Generator().manual_seed(seed)
    every, end = task.eval_every(batch_size), max_steps
    for step in range(max_steps + 1):
        if step % every == 0 or step == end:
            run.eval_steps.append(step)
            run.eval_losses.append(task.validation_loss(model))
            if not math.isfinite(run.eval_losses[-1]):
                run.diverged = True
                break
            if math.isinf(run.steps):
                run.steps = steps_to_target(run.eval_steps, run.eval_losses, task.target)
                if math.isfinite(run.steps):
                    if cockpit is None:
                        break
                    end = min(max_steps, math.ceil(run.steps * continue_after_target))
            if math.isinf(run.steps) and step > stop_after:
                run.pruned = True
                break
        if step >= end:
            break
        x, y = task.sample(batch_size, generator)
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        if cockpit is None:
            loss.backward()
        else:
            info = {"batch_size": len(x), "individual_losses": per_example(out, y),
                    "loss": loss, "optimizer": opt}
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()
    return run


def sweep(task, batch_sizes, seed, log=print) -> Dict[int, List[Run]]:
    """Every learning rate of the task's grid at every batch size; ``{B: runs}``.

    The learning rate that was best at the previous batch size runs first;
    the others stop as soon as they cannot beat the best run of their batch
    size (only the minimum number of steps over the grid is used).
    """
    runs, previous = {}, task.learning_rates[len(task.learning_rates) // 2]
    for b in batch_sizes:
        order = sorted(task.learning_rates, key=lambda lr: (abs(math.log(lr / previous)), lr))
        runs[b], best = [], math.inf
        for lr in order:
            start = time.perf_counter()
            run = train(task, b, lr, seed, max_steps=task.max_steps, stop_after=best)
            runs[b].append(run)
            best = min(best, run.steps)
            log(f"  {task.name} B={b} lr={lr:g}: {run.outcome()} "
                f"({time.perf_counter() - start:.1f} s)")
        runs[b].sort(key=lambda r: r.lr)
        best_run = best_of(runs[b])
        if best_run is not None:
            previous = best_run.lr
    return runs


def best_of(runs) -> Optional[Run]:
    """The run that reached the target in the fewest steps (None if none did)."""
    reached = [r for r in runs if math.isfinite(r.steps)]
    return min(reached, key=lambda r: r.steps) if reached else None


def noise_scale_run(task, lr, seed, max_steps, continue_after_target=2.0):
    """One run at ``task.gns_batch`` with a Cockpit tracking GradientNoiseScale every step.

    Returns:
        The run and ``{statistic: (steps, values)}`` of the network (``"all"``)
        for ``b_simple`` and ``b_simple_smoothed``.
    """
    names = [n for n, _ in task.make_model().named_parameters()]
    quantities = [cgn.GradientNoiseScale(linear(1), param_names=names)]
    run = train(task, task.gns_batch, lr, seed, max_steps=max_steps, quantities=quantities,
                continue_after_target=continue_after_target)
    frame = cgn.to_frame(run.cockpit)
    frame = frame[(frame.quantity == "GradientNoiseScale") & (frame.param == "all")]
    series = {}
    for statistic in ("b_simple", "b_simple_smoothed"):
        rows = frame[frame.statistic == statistic]
        series[statistic] = (rows.step.tolist(), rows.value.tolist())
    return run, series


# ----------------------------------------------------------------------------
# Results, figures, the page
# ----------------------------------------------------------------------------


@dataclass
class Result:
    """What one task measured."""

    task: Task
    runs: Dict[int, List[Run]]
    s_min: float
    e_min: float
    b_crit: float
    gns_run: Optional[Run]
    gns_series: Dict[str, Tuple[list, list]]  # {statistic: (steps, values)}, "all"
    b_simple: float  # smoothed B_simple at the step the GNS run reached the target
    seconds: float

    def best(self):
        """``(batch size, best run)`` for every batch size, the run None if none reached."""
        return [(b, best_of(runs)) for b, runs in self.runs.items()]

    def measured(self):
        """Batch sizes and steps of the batch sizes that reached the target."""
        pairs = [(b, r.steps) for b, r in self.best() if r is not None]
        return np.array([p[0] for p in pairs], float), np.array([p[1] for p in pairs], float)

    def series(self, statistic):
        """Steps and values of one tracked statistic of the network."""
        steps, values = self.gns_series[statistic]
        return np.asarray(steps, float), np.asarray(values, float)

    def to_json(self) -> dict:
        """The measured numbers (not the task's code), for :func:`result_from_json`."""
        gns = None if self.gns_run is None else {
            "lr": self.gns_run.lr, "steps": self.gns_run.steps, "series": self.gns_series}
        return {
            "task": self.task.name, "target": self.task.target,
            "runs": {str(b): [run_summary(r) for r in runs] for b, runs in self.runs.items()},
            "s_min": self.s_min, "e_min": self.e_min, "b_crit": self.b_crit,
            "b_simple": self.b_simple, "gns": gns, "seconds": self.seconds,
        }


def run_summary(run) -> dict:
    """A run without its validation curve and Cockpit."""
    return {"batch_size": run.batch_size, "lr": run.lr, "steps": run.steps,
            "pruned": run.pruned, "diverged": run.diverged}


def result_from_json(task, data) -> Result:
    """The :class:`Result` that :meth:`Result.to_json` stored, with its task."""
    if data["task"] != task.name or data["target"] != task.target:
        raise ValueError(f"the stored results are of {data['task']} at target "
                         f"{data['target']}, not {task.name} at {task.target}: rerun "
                         f"without --replot")
    runs = {int(b): [Run(**r) for r in rs] for b, rs in data["runs"].items()}
    gns = data["gns"]
    gns_run = None if gns is None else Run(task.gns_batch, gns["lr"], steps=gns["steps"])
    return Result(task, runs, data["s_min"], data["e_min"], data["b_crit"], gns_run,
                  None if gns is None else gns["series"], data["b_simple"], data["seconds"])


def run_task(task, batch_sizes, seed, log=print) -> Result:
    """The sweep, the fit and the noise-scale run of one task."""
    start = time.perf_counter()
    runs = sweep(task, batch_sizes, seed, log)
    result = Result(task, runs, math.nan, math.nan, math.nan, None, None, math.nan, 0.0)
    result.s_min, result.e_min = fit_steps_examples(*result.measured())
    result.b_crit = critical_batch(result.s_min, result.e_min)
    best = dict(result.best()).get(task.gns_batch)
    if best is None:
        warnings.warn(f"{task.name}: batch {task.gns_batch} never reached the target; "
                      f"no noise-scale run", stacklevel=2)
    else:
        result.gns_run, result.gns_series = noise_scale_run(task, best.lr, seed, task.max_steps)
        steps, values = result.series("b_simple_smoothed")
        result.b_simple = value_at_step(steps, values, result.gns_run.steps)
        log(f"  {task.name}: B_simple {result.b_simple:.3g} at step "
            f"{result.gns_run.steps:.0f} (batch {task.gns_batch}, lr {best.lr:g})")
    result.seconds = time.perf_counter() - start
    log(f"  {task.name}: S_min {result.s_min:.4g}, E_min {result.e_min:.4g}, "
        f"B_crit {result.b_crit:.3g} ({result.seconds:.0f} s)")
    return result


def plot_task(result, path):
    """Steps against examples with the fitted hyperbola, and B_simple over training."""
    import matplotlib.pyplot as plt

    task = result.task
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=90)
    b, s = result.measured()
    left.loglog(b * s, s, "o", color="C0", label="measured (best learning rate)")
    for bi, si in zip(b, s):
        left.annotate(f"{bi:.0f}", (bi * si, si), textcoords="offset points", xytext=(4, 4),
                      fontsize=8)
    if math.isfinite(result.s_min) and math.isfinite(result.e_min):
        # From well below to well above the measured batches and B_crit: the whole knee.
        knee = [result.b_crit] if 0 < result.b_crit < math.inf else []
        grid = np.geomspace(min([b.min()] + knee) / 4, max([b.max()] + knee) * 4, 200)
        fitted = predicted_steps(grid, result.s_min, result.e_min)
        left.loglog(grid * fitted, fitted, "-", color="C1",
                    label=f"fit: S_min={result.s_min:.3g}, E_min={result.e_min:.3g}")
        left.axhline(result.s_min, color="0.6", ls=":", lw=1)
        left.axvline(result.e_min, color="0.6", ls=":", lw=1)
        if 0 < result.b_crit < math.inf:
            left.plot(2 * result.e_min, 2 * result.s_min, "s", color="C3",
                      label=f"B_crit = {result.b_crit:.3g}")
        if result.b_simple > 0 and math.isfinite(result.b_simple):
            s_pred = predicted_steps(result.b_simple, result.s_min, result.e_min)
            left.plot(result.b_simple * s_pred, s_pred, "D", color="C2",
                      label=f"B = B_simple = {result.b_simple:.3g}")
    for axis in (left.xaxis, left.yaxis):  # decade labels only: the minor ones collide
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel(f"examples to reach loss {task.target:g} ({task.unit})")
    left.set_ylabel("steps to reach it")
    left.set_title(f"{task.name}: (S/S_min - 1)(E/E_min - 1) = 1", fontsize=10)
    left.legend(fontsize=7)

    if result.gns_series is not None:
        steps, raw = result.series("b_simple")
        finite = np.isfinite(raw) & (raw > 0)
        right.semilogy(steps[finite], raw[finite], ".", color="C0", alpha=0.2, ms=3,
                       label="B_simple of each batch")
        steps, smoothed = result.series("b_simple_smoothed")
        finite = np.isfinite(smoothed) & (smoothed > 0)
        right.semilogy(steps[finite], smoothed[finite], "-", color="C0",
                       label="B_simple smoothed")
        right.axvline(result.gns_run.steps, color="0.4", ls="--", lw=1,
                      label=f"loss {task.target:g} reached")
        right.axhline(task.gns_batch, color="C1", ls=":", lw=1,
                      label=f"batch size {task.gns_batch}")
    if 0 < result.b_crit < math.inf:
        right.axhline(result.b_crit, color="C3", lw=1.5, label=f"B_crit (fit) {result.b_crit:.3g}")
        right.axhspan(result.b_crit / PAPER_FACTOR, result.b_crit * PAPER_FACTOR, color="C3",
                      alpha=0.07, label=f"B_crit x/÷ {PAPER_FACTOR:g}")
    right.set_xlabel(f"step (batch {task.gns_batch})")
    right.set_ylabel(f"noise scale ({task.unit.split(' ')[0]})")
    right.set_title("GradientNoiseScale over training", fontsize=10)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def verdict(result) -> str:
    """One plain sentence: do B_simple and B_crit agree within the paper's factor?"""
    factor = agreement_factor(result.b_crit, result.b_simple)
    if math.isnan(factor):
        return (f"B_crit ({result.b_crit:.3g}) and B_simple ({result.b_simple:.3g}) cannot be "
                f"compared here: one of them is not a finite positive number.")
    if factor <= PAPER_FACTOR:
        return (f"**They agree within the paper's factor:** B_simple = {result.b_simple:.3g} "
                f"and B_crit = {result.b_crit:.3g} are a factor {factor:.2g} apart "
                f"(at most {PAPER_FACTOR:g}).")
    return (f"**They do not agree within the paper's factor:** B_simple = "
            f"{result.b_simple:.3g} and B_crit = {result.b_crit:.3g} are a factor "
            f"{factor:.2g} apart (more than {PAPER_FACTOR:g}).")


def _number(value, digits=3):
    return f"{value:.{digits}g}" if math.isfinite(value) else str(value)


def task_section(result, figure) -> List[str]:
    """The page's section of one task."""
    task = result.task
    lrs = ", ".join(f"{lr:g}" for lr in task.learning_rates)
    lines = [
        f"## {task.title}", "",
        f"- Model and optimizer: {task.description}.",
        f"- Data: {task.data_note}.",
        f"- Target: validation loss {task.target:g}; learning rates {lrs}; at most "
        f"{task.max_steps:,} steps; validation loss every max(1, {task.eval_examples} // B) "
        f"steps, the crossing interpolated linearly between evaluations.",
        "",
        "| batch B | best lr | steps S | examples E = B S | steps per learning rate |",
        "|---|---|---|---|---|",
    ]
    for b, runs in result.runs.items():
        best = best_of(runs)
        per_lr = ", ".join(f"{r.lr:g}: {r.outcome()}" for r in runs)
        if best is None:
            lines.append(f"| {b} | – | not reached | – | {per_lr} |")
            continue
        edge = " (grid edge)" if best.lr in (min(task.learning_rates),
                                             max(task.learning_rates)) else ""
        lines.append(f"| {b} | {best.lr:g}{edge} | {best.steps:.1f} | {b * best.steps:,.0f} "
                     f"| {per_lr} |")
    b, s = result.measured()
    residual = (np.log(s) - np.log(predicted_steps(b, result.s_min, result.e_min))
                if len(b) >= 2 else np.array([math.nan]))
    rms = float(np.sqrt(np.mean(residual ** 2)))
    lines += [
        "",
        f"Fit (least squares of log S against log(S_min + E_min / B), {len(b)} batch sizes): "
        f"S_min = {_number(result.s_min, 4)} steps, E_min = {_number(result.e_min, 4)} "
        f"{task.unit}, **B_crit = E_min / S_min = {_number(result.b_crit)}**; root-mean-square "
        f"residual {_number(rms, 2)} in log S (a factor {_number(math.exp(rms), 3)}).",
        "",
    ]
    if result.gns_run is not None:
        low, high = value_range(*result.series("b_simple_smoothed"),
                                0.75 * result.gns_run.steps, 1.25 * result.gns_run.steps)
        lines += [
            f"Noise scale: the run at batch {task.gns_batch} with its best learning rate "
            f"({result.gns_run.lr:g}) again, a Cockpit tracking `GradientNoiseScale` "
            f"(smoothing 0.9) every step; it reached the target at step "
            f"{result.gns_run.steps:.1f}, where the smoothed **B_simple = "
            f"{_number(result.b_simple)}** {task.unit} (the network's, `\"all\"`). Over the "
            f"steps within 25% of that one it ranges from {_number(low)} to {_number(high)}: "
            f"how much the comparison hinges on where the value is read.",
            "",
        ]
    lines += [verdict(result), "", f"![{task.name}: steps against examples, and B_simple]"
              f"({figure})", ""]
    return lines


def versions() -> Dict[str, str]:
    """Versions of Python and the libraries the numbers came from."""
    import subprocess
    from importlib import metadata

    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(git + ["status", "--porcelain", "experiments", "cockpit_gradnoise"],
                           capture_output=True, text=True).stdout.strip()
    return {
        "this repository (commit)": commit + (" with uncommitted changes" if dirty else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backpack-for-pytorch": metadata.version("backpack-for-pytorch"),
        "cockpit-for-pytorch": metadata.version("cockpit-for-pytorch"),
        "cockpit-gradnoise": metadata.version("cockpit-gradnoise"),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "matplotlib": matplotlib.__version__,
    }


def write_page(results, out, run_info) -> Path:
    """The markdown summary, with the numbers of ``results``; returns its path.

    ``run_info``: the run's ``command``, ``seed``, ``seconds`` and ``versions``
    (and ``"replotted with"``: the commit that redrew them).
    """
    replotted = ""
    if "replotted with" in run_info:
        replotted = (f" The figures and this page were last redrawn with `--replot` at "
                     f"commit {run_info['replotted with']}.")
    lines = [
        "# Does the gradient noise scale predict the critical batch size?", "",
        "<!-- Generated by experiments/critical_batch_size.py; do not edit by hand. -->", "",
        "McCandlish, Kaplan, Amodei et al. 2018, \"An Empirical Model of Large-Batch "
        "Training\" (arXiv:1812.06162), model the steps $S$ and examples $E = BS$ that "
        "batch size $B$ needs to reach a given loss, with the learning rate tuned for each "
        "batch size, as", "",
        "$$", r"\left(\frac{S}{S_{\min}} - 1\right)\left(\frac{E}{E_{\min}} - 1\right) = 1,"
        r"\qquad B_{\text{crit}} = \frac{E_{\min}}{S_{\min}},", "$$", "",
        "and find the critical batch size close to the noise scale, which "
        "[GradientNoiseScale](../gradient-noise-scale.md)'s $B_{\\text{simple}}$ estimates. "
        "Their Figure 4 compares the two on tasks whose critical batch sizes span six "
        "orders of magnitude: the points scatter about equality by up to about an order of "
        "magnitude (OpenAI's blog post on the paper, \"How AI training scales\": the noise "
        "scale explains R² = 80% of the variation of the critical batch size). The check "
        f"here is therefore agreement within a factor {PAPER_FACTOR:g}; the factor itself "
        "is in the table. This page "
        "tests it on two small tasks that train on a CPU.", "",
        "| task | target loss | B_crit (fit) | B_simple at the target | factor apart | "
        f"within {PAPER_FACTOR:g}? |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        factor = agreement_factor(r.b_crit, r.b_simple)
        within = "–" if math.isnan(factor) else ("yes" if factor <= PAPER_FACTOR else "no")
        lines.append(f"| {r.task.name} | {r.task.target:g} | {_number(r.b_crit)} | "
                     f"{_number(r.b_simple)} | {_number(factor, 2)} | {within} |")
    lines.append("")
    for r in results:
        lines += task_section(r, f"critical-batch-size-{r.task.name}.png")
    lines += [
        "## How it is measured", "",
        "- Every run of a task starts from the same initialization (the seed) and draws "
        "its batches from a generator with the same seed. The learning rate is constant.",
        "- Steps to the target: the first crossing of the validation loss, interpolated "
        "between evaluations. At each batch size the learning rate that was best at the "
        "previous one runs first; a run stops (\"pruned\") once it is past the best "
        "run's steps without reaching the target, since only the minimum over the grid "
        "counts. A best learning rate at an edge of the grid is marked: there the "
        "minimum may lie outside it, and the steps are an upper bound.",
        "- The fit: $S = S_{\\min} + E_{\\min}/B$ is the hyperbola with $E = BS$; its "
        "parameters minimize the squared differences of $\\log S$ (relative errors; the "
        "steps span orders of magnitude) under $S_{\\min}, E_{\\min} \\ge 0$. On the "
        "figures' left, the square is the hyperbola's knee $(2E_{\\min}, 2S_{\\min})$, "
        "where $B = B_{\\text{crit}}$; the diamond is the point where $B = B_{\\text{simple}}$.",
        "- $B_{\\text{simple}}$ is measured the way the paper compares it: at the point "
        "of training where the target loss is reached, from the ratio of separately "
        "smoothed estimates of $\\operatorname{tr}(\\Sigma)$ and $|G|^2$, all parameters "
        "together. It ignores curvature ($B_{\\text{noise}}$ weights the covariance by the "
        "Hessian), and under Adam the relevant noise scale is the preconditioned one: "
        "the paper's caveats, which apply here too.",
        "- The digits training set has 1,500 images: at large batches a run sees it "
        "many times over, unlike the paper's large data sets.",
        "",
        "## Reproduce", "",
        "```bash", run_info["command"], "```", "",
        f"Seed {run_info['seed']}; total wall time {run_info['seconds']:.0f} s on one CPU "
        "thread (`torch.set_num_threads(1)`), on a machine shared with other jobs. The "
        f"measured numbers are also in `{RESULTS}`; `--replot` redraws the figures and "
        "rewrites this page from them without training." + replotted, "",
        "| package | version |", "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in run_info["versions"].items()]
    lines.append("")
    path = Path(out) / PAGE
    path.write_text("\n".join(lines))
    return path


# ----------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------


def make_tasks(quick, seed) -> Dict[str, Task]:
    """The two tasks: tuned grids and targets, or the tiny ``--quick`` versions."""
    if quick:
        return {
            "digits": digits_task((0.2,), target=2.25, max_steps=80, gns_batch=32, seed=seed),
            "gpt": gpt_task((1e-2,), target=3.6, max_steps=60, gns_batch=32, seed=seed),
        }
    return {
        "digits": digits_task((0.1, 0.2, 0.4, 0.8), target=0.15, max_steps=2000,
                              gns_batch=64, seed=seed),
        "gpt": gpt_task((4e-3, 8e-3, 1.6e-2, 3.2e-2), target=2.3, max_steps=1500,
                        gns_batch=64, seed=seed),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/experiments",
                        help="folder for the page and figures (default: docs/experiments)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny: batch sizes 8 and 32, one learning rate, few steps")
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument("--tasks", default="digits,gpt",
                        help="comma-separated tasks (default: digits,gpt)")
    parser.add_argument("--replot", action="store_true",
                        help=f"no training: redraw and rewrite the page from <out>/{RESULTS}")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny models; and the machine is shared
    matplotlib.use("Agg")
    # torch warns on every step that BackPACK's hooks see no input gradient at the
    # first layer; that is expected here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        stored = json.loads((out / RESULTS).read_text())
        tasks = make_tasks(stored["quick"], stored["seed"])
        results = [result_from_json(tasks[r["task"]], r) for r in stored["results"]]
        run_info = stored
        # The numbers are the stored run's; say which code drew them.
        run_info["replotted with"] = versions()["this repository (commit)"]
    else:
        results, run_info = measure(args, parser, argv)
        run_info["results"] = [r.to_json() for r in results]
        (out / RESULTS).write_text(json.dumps(run_info, indent=1))
    for result in results:
        plot_task(result, out / f"critical-batch-size-{result.task.name}.png")
    page = write_page(results, out, run_info)
    print(f"page: {page}")
    return results, page


def measure(args, parser, argv):
    """Every task of ``args``: the results and what the page records about the run."""
    command = "python -m experiments.critical_batch_size " + " ".join(
        sys.argv[1:] if argv is None else argv)
    run_info = {"command": command.strip(), "seed": args.seed, "quick": args.quick,
                "versions": versions()}  # before training: the code that trains
    tasks = make_tasks(args.quick, args.seed)
    batch_sizes = (8, 32) if args.quick else BATCH_SIZES
    start = time.perf_counter()
    results = []
    for name in args.tasks.split(","):
        if name not in tasks:
            parser.error(f"unknown task {name!r}; choose from {', '.join(tasks)}")
        print(f"{name}:", flush=True)
        results.append(run_task(tasks[name], batch_sizes, args.seed,
                                log=lambda m: print(m, flush=True)))
    run_info["seconds"] = time.perf_counter() - start
    return results, run_info


if __name__ == "__main__":
    main()
