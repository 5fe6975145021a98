"""The report: a per-layer table at one step, and findings in plain language.

Every threshold that turns a number into a finding is a field of
:data:`THRESHOLDS`, a :class:`Thresholds` (documented in ``docs/dashboard.md``).
Both live in :mod:`cockpit_gradnoise.views.common`, the helpers the views share:
the dashboard's reference band for update sizes reads the same values. Like
the panels, the report reads only the tidy frame of
:func:`cockpit_gradnoise.to_frame`, and it ranks the noisiest layers as the
dashboard does (:func:`cockpit_gradnoise.views.common.noise_ranking`); the sentences
are :mod:`cockpit_gradnoise.views.findings`'.

Importing this module imports no pandas (only building a table does), so the
command line's ``--help`` starts fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

from cockpit_gradnoise.logs.schema import (
    BATCH_SCHEDULE,
    BATCH_SIZE,
    COVERAGE_STATISTICS,
    GRADIENT_VARIANCE,
    NETWORK,
    PARAMS_COVERED,
    PARAMS_TOTAL,
    PER_EXAMPLE_NORM,
    QUANTITIES,
    RANKINGS,
    encode_float,
)
from cockpit_gradnoise.views.advice import Advice, advice_json, advice_of
from cockpit_gradnoise.views.common import (
    THRESHOLDS,
    Coverage,
    NonFinite,
    Ranking,
    Thresholds,
    coverage_note,
    equals,
    layer_order,
    median_note,
    network_coverage,
    noise_ranking,
    non_finite_summary,
    recorded_batch_size,
    run_heads,
    select,
    tracked_steps,
    unique_in_order,
)
from cockpit_gradnoise.views.findings import (
    COLUMNS,
    HISTORY,
    findings,
    non_finite_finding,
    run_findings,
    run_history,
    skipped_finding,
)

import numpy

if TYPE_CHECKING:
    import pandas


#: The formats of :func:`format_report`.
FORMATS = ("text", "csv", "json")


def _steps_text(steps: List[int]) -> str:
    """``"26 tracked steps: 0, 2, 4, ..., 48, 50"``: the first three and the last two."""
    shown = [str(s) for s in steps]
    if len(shown) > 6:
        shown = shown[:3] + ["..."] + shown[-2:]
    counted = "1 tracked step" if len(steps) == 1 else f"{len(steps)} tracked steps"
    return f"{counted}: {', '.join(shown)}"


def _step_blocks(frame: pandas.DataFrame) -> pandas.DataFrame:
    """``step, quantity`` of the first row of each run of rows of one step and quantity.

    A tidy frame is sorted by step and quantity: a few thousand runs stand
    for millions of rows (any order is right, just slower).
    """
    return frame.iloc[run_heads(frame.step, frame.quantity)][["step", "quantity"]]


def holdings(frame: pandas.DataFrame) -> str:
    """``"Custom (3 tracked steps: 0, 1, 2)"``: the frame's quantities and their steps."""
    blocks = _step_blocks(frame)
    return "; ".join(
        f"{quantity} ({_steps_text(tracked_steps(blocks[equals(blocks.quantity, quantity)]))})"
        for quantity in unique_in_order(blocks.quantity)
    )


def quantity_steps(frame: pandas.DataFrame, step: Optional[int] = None) -> Dict[str, int]:
    """For each quantity, its latest tracked step at or before ``step`` (default: the last).

    Raises:
        ValueError: If the frame holds none of this package's quantities
            (naming those it holds and their steps), or ``step`` is before the
            first or after the last tracked step (naming them).
    """
    if frame.empty:
        raise ValueError("the log holds none of cockpit-gradnoise's quantities")
    blocks = _step_blocks(frame)
    if not any(equals(blocks.quantity, quantity).any() for quantity in QUANTITIES):
        raise ValueError(
            f"the log holds none of cockpit-gradnoise's quantities ({', '.join(QUANTITIES)}), "
            f"only {holdings(frame)}: its numbers are in cockpit_gradnoise.to_frame"
        )
    tracked = tracked_steps(blocks)
    if step is not None and step < tracked[0]:
        raise ValueError(
            f"no tracked step at or before step {step}: the first is {tracked[0]} "
            f"({_steps_text(tracked)})"
        )
    if step is not None and step > tracked[-1]:
        raise ValueError(
            f"no tracked step {step}: the log ends at step {tracked[-1]} "
            f"({_steps_text(tracked)})"
        )
    last = tracked[-1] if step is None else int(step)
    blocks = blocks[~equals(blocks.quantity, BATCH_SCHEDULE)]  # a schedule's changes: not a quantity
    steps = blocks[blocks.step <= last].groupby("quantity", observed=True).step.max()
    return {str(quantity): int(s) for quantity, s in steps.items()}


def layer_table(frame: pandas.DataFrame, steps: Dict[str, int]) -> pandas.DataFrame:
    """One row per layer (model order, :func:`~cockpit_gradnoise.views.common.layer_order`),
    the network last; one column per :data:`COLUMNS` entry.

    Each quantity's numbers come from its step in ``steps``; NaN where absent.
    """
    import pandas  # here, not at the top: see the module's docstring

    at_steps = frame[frame.step.isin(set(steps.values()))]
    chosen = numpy.zeros(len(at_steps), dtype=bool)
    for quantity, step in steps.items():
        chosen |= (at_steps.step.to_numpy() == step) & equals(at_steps.quantity, quantity)
    chosen = at_steps[chosen]
    params = layer_order(chosen) + ([NETWORK] if equals(chosen.param, NETWORK).any() else [])
    table = pandas.DataFrame(index=pandas.Index(params, name="param"))
    for column, (quantity, statistic) in COLUMNS.items():
        rows = select(chosen, quantity, statistic=statistic)
        values = rows.drop_duplicates("param", keep="last").set_index("param").value
        table[column] = values.reindex(table.index).astype(float)
    return table


#: The quantities whose median a report reads, and what the median is of.
MEDIANS = {GRADIENT_VARIANCE: "sd", PER_EXAMPLE_NORM: "per-example gradient norm"}


def median_notes(frame: pandas.DataFrame, steps: Dict[str, int]) -> List[str]:
    """``"median sd not logged (quantiles asked: 0.1, 0.9)"`` for each quantity of
    :data:`MEDIANS` whose statistics at its step in ``steps`` hold no median
    (:func:`~cockpit_gradnoise.views.common.median_note`)."""
    notes = []
    for quantity, what in MEDIANS.items():
        if quantity in steps:
            rows = select(frame[frame.step.to_numpy() == steps[quantity]], quantity)
            notes.append(median_note(what, unique_in_order(rows.statistic)))
    return [note for note in notes if note]


def coverages(frame: pandas.DataFrame, steps: Dict[str, int]) -> Dict[str, Coverage]:
    """``{quantity: coverage}`` of the quantities whose network row, at their step in
    ``steps``, leaves parameters out (:func:`~cockpit_gradnoise.views.common.network_coverage`)."""
    found = {q: network_coverage(frame[frame.step.to_numpy() == s], q) for q, s in steps.items()}
    return {quantity: coverage for quantity, coverage in found.items() if coverage}


@dataclass
class Report:
    """A report: the table, the steps it was read at, the batch size and the findings.

    ``ranking`` ranks the layers noisiest first over the tracked steps up to
    ``step``, as the dashboard does; ``coverage`` names the quantities whose
    ``"all"`` row covers only some of the parameters. ``non_finite`` says
    where the run went NaN or inf (its finding is the first); ``finite_step``:
    the report's step was moved back to the last step without NaN or inf,
    the last tracked step being non-finite. ``notes``: what the log lacks that
    the report would show (a median not logged, :func:`median_notes`).
    ``advice``: the batch size and learning rate the noise scale advises
    (:func:`~cockpit_gradnoise.views.advice.advice_of`), the report's first block.
    """

    source: str
    step: int
    steps: Dict[str, int]
    batch_size: Optional[int]
    table: pandas.DataFrame
    findings: List[str]
    ranking: Optional[Ranking] = None
    coverage: Dict[str, Coverage] = field(default_factory=dict)
    non_finite: Optional[NonFinite] = None
    finite_step: bool = False
    notes: List[str] = field(default_factory=list)
    advice: Optional[Advice] = None


#: Every statistic a report reads: its columns, the ranking, the run's history,
#: coverage and the batch size. The rest of a large frame is left out at once.
READ = sorted(
    {statistic for _, statistic in COLUMNS.values()}
    | {statistic for _, statistic, _ in RANKINGS}
    | {*HISTORY, BATCH_SIZE, *COVERAGE_STATISTICS}
)


def finite_report_step(summary: Optional[NonFinite], step: Optional[int] = None) -> Optional[int]:
    """The step to report: ``step``; by default the last tracked one, unless the run
    diverged: then the last without NaN or inf (``None``: the last tracked step)."""
    if step is None and summary is not None and summary.since is not None \
            and summary.last_finite is not None:
        return summary.last_finite
    return step


def build_report(frame, *, source="", step=None, batch_size=None, thresholds: Thresholds = THRESHOLDS,
                 ranking: Optional[Ranking] = None):
    """Build the :class:`Report` of ``frame`` at ``step``.

    Args:
        frame: Tidy frame from :func:`cockpit_gradnoise.to_frame`.
        source: Name of the log, for the header.
        step: Step to report; each quantity is read at its latest step at or
            before it. Default: the last tracked step; if it holds NaN or inf
            (:func:`~cockpit_gradnoise.views.common.non_finite`), the last one that
            does not.
        batch_size: The batch size used, to compare with the noise scale;
            default :func:`recorded_batch_size`.
        thresholds: A :class:`Thresholds`.
        ranking: ``noise_ranking`` of the frame up to the reported step, if
            known (:func:`cockpit_gradnoise.views.reads.report_frame` reads it
            from a streamed log's summary); default: ranked from ``frame``.

    Raises:
        ValueError: If ``frame`` holds none of this package's quantities or
            ``step`` is outside its tracked steps.
    """
    summary = non_finite_summary(frame)
    reported = finite_report_step(summary, step)
    finite_step = reported != step
    steps = quantity_steps(frame, reported)
    last = max(steps.values())
    # Before the rows below are copied: a long run's ranking reads millions of rows.
    if ranking is None:
        ranking = noise_ranking(frame, until=last)
    # One pass over the whole frame; everything after reads the rows it needs of these.
    read = frame[(frame.step.to_numpy() <= last) & frame.statistic.isin(READ).to_numpy()]
    table = layer_table(read, steps)
    # The batch given, else the one the advice's noise scale recorded.
    advice_batch = batch_size
    if batch_size is None:
        batch_size = recorded_batch_size(read)
    history = run_history(select(read, param=NETWORK), thresholds)
    advice = advice_of(frame, batch_size=advice_batch, until=last,
                       stopped=history.stopped_at is not None,
                       factor=thresholds.noise_scale_factor)
    return Report(
        source=str(source),
        step=last,
        steps=steps,
        batch_size=batch_size,
        table=table,
        findings=non_finite_finding(summary)
        + skipped_finding(frame)
        + run_findings(history, batch_size, thresholds)
        + findings(table, batch_size, thresholds, ranking=ranking,
                   stopped=history.stopped_at is not None),
        ranking=ranking,
        coverage=coverages(read, steps),
        notes=median_notes(frame, steps),
        non_finite=summary,
        finite_step=finite_step,
        advice=advice,
    )


# Formats --------------------------------------------------------------------------


def format_report(report: Report, fmt: str = "text") -> str:
    """The report as ``"text"`` (table and findings), ``"csv"`` or ``"json"`` (table only)."""
    if fmt == "csv":
        table = report.table.copy()
        table.insert(0, "step", report.step)
        return table.to_csv(na_rep="nan")
    if fmt == "json":
        rows = [
            {"param": param, **{c: encode_float(v) for c, v in row.items()}}
            for param, row in report.table.iterrows()
        ]
        return json.dumps(
            {
                "log": report.source,
                "step": report.step,
                "quantity_steps": report.steps,
                "batch_size": report.batch_size,
                "columns": {c: list(qs) for c, qs in COLUMNS.items()},
                "layers": rows,
                # Only quantities whose "all" row leaves parameters out.
                "network_coverage": {
                    q: {PARAMS_COVERED: c.fewest, PARAMS_TOTAL: c.total}
                    for q, c in report.coverage.items()
                },
                "non_finite": _non_finite_json(report.non_finite),
                "advice": None if report.advice is None else advice_json(report.advice),
            },
            indent=2,
        ) + "\n"
    if fmt != "text":
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return _text(report)


def _non_finite_json(summary: Optional[NonFinite]):
    """Where the run went NaN or inf, for the JSON format (``None``: it never did)."""
    if summary is None:
        return None
    return {
        "first_step": summary.first,
        "params": summary.params,
        "quantities": summary.quantities,
        "steps": summary.steps,
        "tracked_steps": len(summary.tracked),
        "diverged_from": summary.since,
        "last_finite_step": summary.last_finite,
    }


def _coverage_lines(coverage: Dict[str, Coverage]) -> List[str]:
    """``"all: 7 of 15 parameters in A, B (...)"``, one line per distinct coverage."""
    quantities: Dict[str, List[str]] = {}
    for quantity, covered in sorted(coverage.items()):
        quantities.setdefault(coverage_note(covered), []).append(quantity)
    return [
        f"{note} in {', '.join(names)} (the {NETWORK} row leaves the other parameters out)"
        for note, names in quantities.items()
    ]


def _text(report: Report) -> str:
    other = ", ".join(
        f"{q} from step {s}" for q, s in sorted(report.steps.items()) if s != report.step
    )
    if report.finite_step:
        other = "the last tracked step without NaN or inf" + (f"; {other}" if other else "")
    batch = "unknown (pass --batch-size)" if report.batch_size is None else report.batch_size
    shown = report.table.dropna(axis=1, how="all")
    # A run that went NaN or inf says so first; its finding is not repeated below.
    first = report.findings[:1] if report.non_finite is not None else []
    lines = [
        f"cockpit-gradnoise report: {report.source}",
        *[f"NON-FINITE: {line}" for line in first],
        f"step {report.step}" + (f" ({other})" if other else "") + f", batch size {batch}",
        *_coverage_lines(report.coverage),
        *report.notes,
        *(["", str(report.advice).rstrip("\n")] if report.advice is not None else []),
        "",
        shown.to_string(float_format=lambda v: f"{v:.3g}", na_rep="-") if len(shown.columns)
        else f"(no finite number at step {report.step})",
        "",
        "findings:",
    ]
    lines += [f"- {line}" for line in report.findings[len(first):]] or ["- none"]
    return "\n".join(lines) + "\n"
