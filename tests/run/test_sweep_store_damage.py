"""Every field of every file of a stored sweep point, damaged in turn: the point runs again, named.

A point counts as done only when nothing in its folder has changed since it ran. Here each
file of a finished point is damaged field by field (point.json: each field removed, given a
value of another kind, given another value of the right kind, with the record's checksum
left as it was and recomputed as another writer would; each value of each results file;
the executed notebook and the log; a file added), and the store must refuse the point with
a message that names the point, never hand back its results.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from graphborrow.run.sweep.execute import Execution
from graphborrow.run.sweep.points import CHECKSUM, PointStore, _record_checksum, point_identity

DIGEST = "5" * 64
PARAMS = {"BATCH_SIZE": 8, "LADDER": [16, 8], "MODE": "standard", "TOP_P": 0.9}
RESULTS = {"device_work": 3, "results": {"largest": 123456, "fits": True, "rows": [1, 2], "name": "x"}}
WRONG_KINDS = [None, "text", 1.5, -1, True, [], {}, float("nan")]


def results_json(record=RESULTS) -> bytes:
    return json.dumps(record).encode()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One finished point, stored once; each case damages its own copy."""
    root = tmp_path_factory.mktemp("store")
    run = Execution(0, None, 12.5, b'{"cells": [{"cell_type": "code", "source": "x = 1"}]}',
                    {"results/nb.json": results_json(), "results/extra.json": b'{"more": [1, {"deep": 2}]}'},
                    "papermill log\n", "tcp://127.0.0.1:9", "hostA")
    PointStore(root).save("p", point_identity(PARAMS, DIGEST), PARAMS, run, notebook_name="nb.ipynb",
                          notebook_digest=DIGEST)
    loaded, why = load(root)
    assert why is None and loaded.status == "done", "the undamaged point is reused"
    return root


def load(root):
    return PointStore(root).load("p", point_identity(PARAMS, DIGEST), PARAMS, "nb.ipynb")


def leaves(value, path=()):
    """(path, value) of every scalar inside a JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, path + (i,))
    else:
        yield path, value


def replaced(value, path, new):
    out = copy.deepcopy(value)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return out


def removed(value, path):
    out = copy.deepcopy(value)
    target = out
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return out


def other_of_the_same_kind(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return "0" * 64 if len(value) == 64 else value + "x"
    return value


def record_damages(record):
    """(label, damaged record text, checksum recomputed) for every field of point.json."""
    for path, value in leaves(record):
        if path == (CHECKSUM,):
            continue
        variants = [("removed", removed(record, path))]
        variants += [(f"set to {bad!r}", replaced(record, path, bad)) for bad in WRONG_KINDS]
        variants.append(("changed", replaced(record, path, other_of_the_same_kind(value))))
        for what, damaged in variants:
            if damaged == record:
                continue  # e.g. error set to None where it was None: no damage
            name = "/".join(map(str, path))
            yield f"point.json {name} {what}", damaged, False
            damaged = dict(damaged)
            damaged[CHECKSUM] = _record_checksum(damaged)
            yield f"point.json {name} {what}, checksum recomputed", damaged, True
    yield "point.json checksum changed", replaced(record, (CHECKSUM,), "0" * 64), False
    yield "point.json checksum removed", removed(record, (CHECKSUM,)), False
    yield "point.json with an unknown field", dict(record, added=1), False


# Fields that describe the run rather than decide what it computed: a writer that recomputes
# the checksum may give them another value of their kind, and the point then reports it as written.
DESCRIPTIVE = {
    "seconds": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf"),
    "worker": lambda v: isinstance(v, str),
    "host": lambda v: isinstance(v, str),
    "finished_at": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < float("inf"),
}


def assert_refused(root, label):
    loaded, why = load(root)
    assert loaded is None, f"{label}: the damaged point was trusted"
    assert why and ("/p" in why or " p " in why or why.startswith("p ")), f"{label}: {why!r} does not name the point"


def copy_of(pristine, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    return root


def test_every_field_of_the_record_damaged_in_turn(pristine, tmp_path):
    record = json.loads((pristine / "p" / "point.json").read_text())
    cases = 0
    for label, damaged, recomputed in record_damages(record):
        root = copy_of(pristine, tmp_path / str(cases))
        (root / "p" / "point.json").write_text(json.dumps(damaged))
        field = label.split()[1].split("/")[0]
        loaded, _ = load(root)
        if recomputed and field in DESCRIPTIVE and loaded is not None:
            assert DESCRIPTIVE[field](damaged[field]), f"{label}: a value of the wrong kind was trusted"
            if field != "finished_at":
                assert getattr(loaded, field) == damaged[field], label
        else:
            assert_refused(root, label)
        cases += 1
    assert cases > 300


@pytest.mark.parametrize("text", ["", "{", "[]", "null", "\"point\"", "{\"schema\": 3}"])
def test_a_record_that_is_not_one_is_refused(pristine, tmp_path, text):
    root = copy_of(pristine, tmp_path)
    (root / "p" / "point.json").write_text(text)
    assert_refused(root, text)
    (root / "p" / "point.json").write_bytes(b"\xff\xfe{")
    assert_refused(root, "not UTF-8")


def test_every_value_of_every_results_file_damaged_in_turn(pristine, tmp_path):
    cases = 0
    for name in ("nb.json", "extra.json"):
        original = json.loads((pristine / "p" / "results" / name).read_text())
        damages = [removed(original, path) for path, _ in leaves(original)]
        damages += [replaced(original, path, other_of_the_same_kind(v)) for path, v in leaves(original)]
        damages += [replaced(original, path, None) for path, _ in leaves(original)]
        for damaged in damages:
            root = copy_of(pristine, tmp_path / str(cases))
            (root / "p" / "results" / name).write_text(json.dumps(damaged))
            assert_refused(root, f"{name} -> {damaged}")
            cases += 1
    assert cases >= 20


@pytest.mark.parametrize("damage", ["truncated", "emptied", "one byte changed", "deleted", "appended to"])
@pytest.mark.parametrize("name", ["nb.ipynb", "papermill.log", "results/nb.json", "results/extra.json"])
def test_every_file_damaged_whole(pristine, tmp_path, name, damage):
    root = copy_of(pristine, tmp_path)
    path = root / "p" / name
    data = path.read_bytes()
    if damage == "deleted":
        path.unlink()
    else:
        path.write_bytes({"truncated": data[: len(data) // 2], "emptied": b"",
                          "one byte changed": bytes([data[0] ^ 1]) + data[1:], "appended to": data + b" "}[damage])
    assert_refused(root, f"{name} {damage}")


@pytest.mark.parametrize("added", ["results/new.json", "stray.txt", "results/sub/x.json"])
def test_a_file_the_record_does_not_list_is_named(pristine, tmp_path, added):
    root = copy_of(pristine, tmp_path)
    (root / "p" / added).parent.mkdir(parents=True, exist_ok=True)
    (root / "p" / added).write_text('{"results": {"largest": 1}}')
    loaded, why = load(root)
    assert loaded is None and f"holds {added}, which its record does not list" in why


def test_jupyter_checkpoints_beside_the_notebook_are_not_damage(pristine, tmp_path):
    root = copy_of(pristine, tmp_path)
    (root / "p" / ".ipynb_checkpoints").mkdir()
    (root / "p" / ".ipynb_checkpoints" / "nb-checkpoint.ipynb").write_text("{}")
    assert load(root)[0] is not None


def test_edited_parameters_are_not_reported_next_to_the_old_result(pristine, tmp_path):
    """Issue 24, bad case 5: the edited record with its checksum recomputed still fails, because the
    identity is recomputed from the parameters it lists."""
    root = copy_of(pristine, tmp_path)
    record = json.loads((root / "p" / "point.json").read_text())
    record["params"]["BATCH_SIZE"] = 64
    record[CHECKSUM] = _record_checksum(record)
    (root / "p" / "point.json").write_text(json.dumps(record))
    loaded, why = load(root)
    assert loaded is None and "lists parameters its identity was not computed from" in why


def test_a_seconds_value_that_is_not_a_number_is_named(pristine, tmp_path):
    """Issue 24, bad case 6: it crashed every rerun in the CSV writer."""
    root = copy_of(pristine, tmp_path)
    for seconds in ("12.5", None, float("inf"), -3):
        record = json.loads((pristine / "p" / "point.json").read_text())
        record["seconds"] = seconds
        record[CHECKSUM] = _record_checksum(record)
        (root / "p" / "point.json").write_text(json.dumps(record))
        loaded, why = load(root)
        assert loaded is None and "holds values of the wrong kind in seconds" in why
