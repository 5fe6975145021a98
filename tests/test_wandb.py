"""Weights & Biases: a real offline run gets every number of every tracked step.

The run is read back from the file W&B writes (``run-<id>.wandb``): records
in LevelDB's log format (32 KiB blocks, each record a 7-byte header ``crc32,
length, type`` then its bytes, split across blocks as FIRST/MIDDLE/LAST), after
W&B's own 7-byte file header; each record a protobuf ``Record`` of
``wandb.proto``. Nothing goes over the network (``mode="offline"``).
"""

import json
import struct

import cockpit_gradnoise as cgn

import numpy
import pytest

from tests.test_integrations import EVERY, batches, mlp, train

BLOCK, HEADER, FILE_HEADER = 32768, 7, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path):
    """The bytes of every record of a W&B transaction log, in order."""
    raw, position, part = path.read_bytes(), FILE_HEADER, b""
    assert raw[:4] == b":W&B", "not a W&B transaction log"
    while position + HEADER <= len(raw):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", raw[position:position + HEADER])
        if left < HEADER or (kind == 0 and length == 0):  # the block's zero padding
            position += left
            continue
        assert kind in (FULL, FIRST, MIDDLE, LAST), f"bad record type {kind}"
        part += raw[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, LAST):
            yield part
            part = b""


def history(path):
    """``{(step, key): value}`` of every ``run.log`` call in the run's file."""
    from wandb.proto import wandb_internal_pb2

    logged = {}
    for data in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                 for item in record.history.item}
        step = items.pop("_step")
        logged.update({(step, key): value for key, value in items.items()
                       if not key.startswith("_")})
    return logged


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B's files, caches and settings all under ``tmp_path``."""
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def test_a_wandb_run_gets_every_number_of_every_tracked_step_under_stable_keys(offline):
    import wandb

    run = wandb.init(project="cgn-test", dir=str(offline))
    model, tracker = cgn.track(mlp(), every=EVERY)
    tracker.log_to(run)
    train(model, tracker, batches())
    run.finish()
    wandb.teardown()  # stops W&B's service process, which writes the file's last records
    (path,) = offline.glob("wandb/offline-run-*/run-*.wandb")
    logged = history(path)

    frame = tracker.frame()
    keys = ("cgn/" + frame["quantity"].astype(str) + "/" + frame["param"].astype(str) + "/"
            + frame["statistic"].astype(str))
    expected = dict(zip(zip(frame["step"], keys), frame["value"]))
    assert set(logged) == set(expected)  # every number, nothing else
    assert {step for step, _ in logged} == {0, 2}
    assert (0, "cgn/GradientNoiseScale/all/b_simple") in logged
    # W&B's JSON keeps float64 exactly (shortest round-trip repr; inf as Infinity).
    keys = sorted(expected)
    assert numpy.isinf([expected[key] for key in keys]).any()  # b_simple with grad_sq < 0
    assert numpy.array_equal([logged[key] for key in keys], [expected[key] for key in keys],
                             equal_nan=True)
