"""The architecture sweep's --quick mode: a few models per library, none silently inexact."""

import math
import os
import time
import types

import pandas
import pytest
import torch

from experiments import architecture_sweep as sweep


def frame(errors, scales, notes=None):
    """A ``check_model`` table: one parameter per error (NaN: no rows)."""
    notes = notes or [""] * len(errors)
    return pandas.DataFrame.from_records([
        {"param": f"model.p{i}", "elements": 4, "rows": not note, "how": "native (Linear)",
         "max_rel_error": error, "reference_scale": scale, "note": note}
        for i, (error, scale, note) in enumerate(zip(errors, scales, notes, strict=True))])


def test_a_structural_zero_is_compared_with_the_networks_scale_and_a_wrong_row_is_not_hidden():
    # key bias: reference rounding noise (1e-17), rows another noise: relative error 1
    assert sweep.classify(frame([1e-15, 1.0], [1.0, 1e-17]), set())["status"] == "exact"
    # Funnel's k_head.bias: noise at 2e-9 of the network's scale, 1.5e-8 of its own
    assert sweep.classify(frame([1e-15, 1.5e-8], [1.0, 2e-9]), set())["status"] == "exact"
    assert sweep.classify(frame([1e-15, 1.5e-8], [1.0, 1e-7]), set())["status"] == "inexact"
    # rows of 1e-3 where the reference is zero to rounding: 1e14 times its scale
    record = sweep.classify(frame([1e-15, 1e14], [1.0, 1e-17]), set())
    assert record["status"] == "inexact" and record["worst_param"] == "p1"


def test_the_float32_tolerance_is_for_the_parameters_of_modules_computing_in_float32_only():
    errors = frame([1e-15, 1e-6], [1.0, 1.0])
    assert sweep.classify(errors, set())["status"] == "inexact"
    assert sweep.classify(errors, {"model.p1"})["status"] == "exact to float32"
    assert sweep.classify(errors, {"model.p0"})["status"] == "inexact"
    assert sweep.classify(frame([1e-3, 1e-15], [1.0, 1.0]), {"model.p0"})["status"] == "inexact"


def test_left_out_and_unused_parameters_are_told_apart():
    notes = ["", "fallback refused: called twice", "no gradient (unused in the forward pass)"]
    record = sweep.classify(frame([1e-15, math.nan, math.nan], [1.0, 1.0, math.nan], notes), set())
    assert record["status"] == "exact, left out" and record["coverage"] == 0.5
    assert record["left_out"] == [{"param": "p1", "elements": 4, "reason": notes[1]}]
    assert record["unused"] == ["p2"]


def test_the_page_is_written_between_the_markers_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# kept\n{sweep.BEGIN}\nold table\n{sweep.END}\nkept too\n")
    record = {"library": "timm", "name": "a|b", "status": "error", "message": "x\ny", "seconds": 1}
    sweep.write_page({"versions": {"torch": "2"}, "tolerance": 1e-10, "float32_tolerance": 1e-4,
                      "results": {"timm/a": record}}, str(page))
    text = page.read_text()
    assert text.startswith("# kept\n") and text.endswith(f"{sweep.END}\nkept too\n")
    assert "old table" not in text and "| `a\\|b` | error |  |  | not measured |  | x y |" in text


def test_quick_sweep_tracks_each_model_exactly():
    """Two to five models per library, each in the spawned worker: exact, none inexact."""
    jobs = sweep.jobs_of(quick=True, only=[])
    assert {library for library, _ in jobs} == {"transformers", "timm", "torchvision"}
    results = sweep.sweep(jobs, timeout=200, log=lambda line: None)
    statuses = {key: record["status"] for key, record in results.items()}
    assert len(statuses) == len(jobs)
    assert not [key for key, status in statuses.items() if status == "inexact"], results
    assert set(statuses.values()) == {"exact"}, results
    # BERT's key biases: a gradient zero by structure, checked against the network's scale
    assert {"bert.encoder.layer.0.attention.self.key.bias",
            "bert.encoder.layer.1.attention.self.key.bias"} == set(
        results["transformers/bert"]["zero_by_structure"])


class MoeBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.experts = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)


def test_a_blocks_parameters_get_the_float32_tolerance_where_a_module_inside_computes_in_float32():
    """Rows from a block run on each example follow its float32 routing's rounding, one
    example alone against the batch: every parameter of that block, not only the router's."""
    model = torch.nn.Module()
    model.first, model.second, model.head = MoeBlock(), MoeBlock(), torch.nn.Linear(2, 2)
    names = [name for name, _ in model.named_parameters()]
    how = {name: "per example (its block MoeBlock run on each example)" for name in names
           if not name.startswith("head")}
    table = pandas.DataFrame({"param": names, "how": [how.get(n, "native (Linear)") for n in names]})
    found = sweep.float32_parameters(model, table, {"first.router", "head"})
    assert found == {"first.router.weight", "first.router.bias", "first.experts.weight",
                     "first.experts.bias", "head.weight", "head.bias"}
    assert sweep.float32_parameters(model, table, set()) == set()


def test_a_layer_computed_by_its_parents_replay_follows_the_parents_precision():
    """Mamba's ``conv1d`` is not run by the fallback: its mixer (which computes ``A`` in
    float32) replays it per example, so its rows carry the mixer's rounding; a layer with
    its own rule under that mixer keeps the float64 tolerance."""
    model = torch.nn.Module()
    model.mixer = torch.nn.Module()
    model.mixer.conv, model.mixer.proj = torch.nn.Conv1d(2, 2, 1), torch.nn.Linear(2, 2)
    names = [name for name, _ in model.named_parameters()]
    how = {"mixer.conv.weight": "fallback (torch.func: Conv1d not run, its parameters used by its parent)",
           "mixer.conv.bias": "fallback (torch.func: Conv1d not run, its parameters used by its parent)"}
    table = pandas.DataFrame({"param": names, "how": [how.get(n, "native (Linear)") for n in names]})
    assert sweep.float32_parameters(model, table, {"mixer"}) == {"mixer.conv.weight", "mixer.conv.bias"}
    assert sweep.float32_parameters(model, table, {"mixer.proj"}) == {"mixer.proj.weight", "mixer.proj.bias"}


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="CPU time read from /proc")
def test_the_time_limit_reads_the_workers_cpu_time_not_the_clock():
    """A worker starved by other processes is not timed out: its CPU time is what counts."""
    worker = sweep.Worker()
    worker.process = types.SimpleNamespace(pid=os.getpid())
    before, process_before = worker.cpu_seconds(), time.process_time()
    time.sleep(0.3)  # the clock runs, the CPU time does not
    while time.process_time() - process_before < 0.3:
        pass
    used, process_used = worker.cpu_seconds() - before, time.process_time() - process_before
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert abs(used - process_used) <= 3 * tick, (used, process_used)


def _bert():
    from experiments import sweep_models

    return sweep_models.build("transformers", "bert")


def test_the_behaviour_pass_keeps_berts_eval_outputs_and_dropout(one_thread):
    """BERT's tiny configuration has dropout: random in training mode, plain and tracked."""
    from experiments import sweep_behaviour

    behaviour = sweep_behaviour.behaviour_one(_bert())
    assert behaviour["verdict"] == "kept", behaviour
    assert behaviour["eval"]["outside"]["identical"] and behaviour["eval"]["inside"]["identical"]
    assert behaviour["train"]["random"] and behaviour["train"]["tracked_random"]
    assert behaviour["time"]["plain_ms"] > 0 and behaviour["time"]["tracked_ms"] > 0


def _tracked_then(change):
    """``cgn.track``, then ``change(model)``: a package that would alter the model."""
    import cockpit_gradnoise as cgn

    def track(model, **kwargs):
        model, tracker = cgn.track(model, **kwargs)
        change(model)
        return model, tracker

    return track


def test_the_behaviour_pass_sees_an_eval_output_changed_by_tracking(one_thread):
    """A forward hook adding 1e-9 (far above the 2e-13 rounding bound) to the output."""
    from experiments import sweep_behaviour

    def perturb(model):
        model.register_forward_hook(lambda module, args, output: output + 1e-9)

    behaviour = sweep_behaviour.behaviour_one(_bert(), track=_tracked_then(perturb))
    assert not behaviour["eval"]["outside"]["identical"]
    assert behaviour["eval"]["outside"]["max_abs_diff"] > behaviour["eval"]["outside"]["bound"]
    assert behaviour["verdict"].startswith("eval output outside the step differs by 1.0e-09"), behaviour


def test_the_behaviour_pass_sees_dropout_switched_off_by_tracking(one_thread):
    from experiments import sweep_behaviour

    def no_dropout(model):
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0

    behaviour = sweep_behaviour.behaviour_one(_bert(), track=_tracked_then(no_dropout))
    assert behaviour["train"]["random"] and not behaviour["train"]["tracked_random"]
    assert behaviour["verdict"] == "training mode no longer random", behaviour


def test_the_behaviour_fields_merge_into_a_sweep_record_and_its_page_row(tmp_path):
    check = {"library": "timm", "name": "a", "status": "exact", "coverage": 1.0, "seconds": 1}
    second = {"library": "timm", "name": "a", "behaviour": {
        "verdict": "kept", "train": {"random": False}, "time": {"plain_ms": 2.0, "tracked_ms": 5.0, "ratio": 2.5}}}
    record = sweep.merged(check, second)
    assert record == {**check, "behaviour": second["behaviour"]}
    assert sweep.merged(record, check) == record  # the check run again keeps the second pass
    page = tmp_path / "page.md"
    page.write_text(f"{sweep.BEGIN}\n{sweep.END}\n")
    sweep.write_page({"versions": {}, "tolerance": 1e-10, "float32_tolerance": 1e-4,
                      "results": {"timm/a": record, "timm/b": {**check, "name": "b"}}}, str(page))
    text = page.read_text()
    assert "| `a` | exact | 100.0% |  | kept | 2.5 (2 ms) |" in text
    assert "| `b` | exact | 100.0% |  | not measured |  |" in text
    assert "of 1 measured: kept by 1, in evaluation mode by 0 more" in text
    assert "not kept by 0; 1 of the 2 that built not measured (0 past" in text


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="memory read from /proc")
def test_the_worker_is_worn_after_its_models_or_above_its_memory():
    """Read on this process (resident well above 0.01 GiB, well below 1000 GiB)."""
    worker = sweep.Worker(max_models=3, max_rss_gib=1000.0)
    assert worker.worn() == ""  # not started
    worker.process = types.SimpleNamespace(pid=os.getpid())
    assert 0.01 < worker.rss_gib() < 1000.0
    worker.models = 2
    assert worker.worn() == ""
    worker.models = 3
    assert worker.worn() == "3 models run"
    worker.models, worker.max_rss_gib = 0, 0.01
    assert worker.worn().endswith("GiB resident")
    assert sweep.Worker(max_models=None, max_rss_gib=None).worn() == ""


class CountingWorker:
    """A worker that runs nothing: records its runs and stops, worn after every ``every`` models."""

    def __init__(self, every):
        self.every, self.models, self.stops, self.runs = every, 0, 0, []

    def run(self, library, name, timeout, kind):
        self.models += 1
        self.runs.append((name, self.stops))
        return {"library": library, "name": name, "status": "exact", "seconds": 0.0}

    def worn(self):
        return "worn" if self.models >= self.every else ""

    def stop(self):
        self.stops, self.models = self.stops + 1, 0


def test_the_sweep_starts_a_fresh_worker_when_the_last_one_is_worn():
    worker, lines = CountingWorker(every=2), []
    jobs = [("timm", name) for name in "abcde"]
    results = sweep.sweep(jobs, timeout=1, log=lines.append, worker=worker)
    assert list(results) == [f"timm/{name}" for name in "abcde"]
    # models a, b in the first process; c, d in the second; e in the third (stopped at the end too)
    assert worker.runs == [("a", 0), ("b", 0), ("c", 1), ("d", 1), ("e", 2)]
    assert worker.stops == 3 and lines.count("(a fresh worker: worn)") == 2
