"""`extract.sweep.manifest`: a manifest that is valid JSON but no manifest is refused when read, with one line
naming the file and the first thing wrong, by every command that reads it (issue 35 item 4)."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from extract.run.options import ExecOptions, RunOptions
from extract.sweep import cli as sweep_cli
from extract.sweep.manifest import MANIFEST_VERSION, Manifest, manifest_path
from extract.sweep.runspec import RunSpec


def _valid(tmp_path) -> dict:
    """A manifest as `zaec-sweep` writes it: one submitted run."""
    m = Manifest(tmp_path)
    run = RunSpec(RunOptions("tda", "dtd", backbone="RN50"), ExecOptions(out=tmp_path), "single")
    m.record_submission(run, job_id="123", token="t")
    m.save()
    return json.loads(manifest_path(tmp_path).read_text())


def _row(change):
    def edit(doc):
        change(doc["runs"][0])
        return doc
    return edit


def _set(key, value):
    return _row(lambda r: r.__setitem__(key, value))


def _drop(key):
    return _row(lambda r: r.pop(key))


CASES = {
    "a list": (lambda d: [], "is not a sweep manifest: expected a JSON object, got a list"),
    "a string": (lambda d: "hello", "expected a JSON object, got a string"),
    "a number": (lambda d: 42, "expected a JSON object, got an integer"),
    "null": (lambda d: None, "expected a JSON object, got null"),
    "no version": (lambda d: {"runs": []}, "has version None, expected 2"),
    "version as text": (lambda d: {**d, "version": "2"}, "has version '2', expected 2"),
    "version true": (lambda d: {**d, "version": True}, "has version True, expected 2"),
    "older version": (lambda d: {**d, "version": 1}, "was made by an older zaec-sweep"),
    "runs missing": (lambda d: {"version": 2}, "'runs' must be a list, got null"),
    "runs a string": (lambda d: {"version": 2, "runs": "x"}, "'runs' must be a list, got a string"),
    "runs an object": (lambda d: {"version": 2, "runs": {}}, "'runs' must be a list, got an object"),
    "executor a list": (lambda d: {**d, "executor": []}, "'executor' must be an object, got a list"),
    "an empty row": (lambda d: {"version": 2, "runs": [{}]}, "runs[0] lacks 'run_id', 'backbone', 'dataset'"),
    "a row not an object": (lambda d: {"version": 2, "runs": [1]}, "runs[0] must be an object, got an integer"),
    "a row without spec": (_drop("spec"), "runs[0] lacks 'spec'"),
    "a row without state": (_drop("state"), "runs[0] lacks 'state'"),
    "run id a number": (_set("run_id", 5), "'run_id' must be a string, got an integer 5"),
    "seed as text": (_set("seed", "1"), "'seed' must be an integer, got a string '1'"),
    "seed a boolean": (_set("seed", True), "'seed' must be an integer, got a boolean True"),
    "attempts as text": (_set("attempts", "x"), "'attempts' must be an integer, got a string 'x'"),
    "job id a number": (_set("job_id", 7), "'job_id' must be a string, got an integer 7"),
    "spec a list": (_set("spec", []), "'spec' must be an object, got a list"),
    "unknown state": (_set("state", "weird"), "unknown state 'weird'; states: pending, running, done"),
    "spec empty": (_set("spec", {}), "its spec was made by an older zaec-sweep"),
    "spec without method": (_row(lambda r: r["spec"]["options"].pop("method")),
                            "'spec' is not a run's spec (RunError: run options lack method)"),
    "spec unknown option": (_row(lambda r: r["spec"]["options"].__setitem__("colour", 1)),
                            "'spec' is not a run's spec (RunError: unknown run option(s) colour"),
    "spec bad execution": (_row(lambda r: r["spec"]["execution"].__setitem__("bogus", 1)),
                           "its spec was made by an older zaec-sweep"),
    "a repeated run": (lambda d: {**d, "runs": d["runs"] * 2}, "runs[1] repeats run id"),
}


@pytest.mark.parametrize("command", ["status", "retry"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_manifest_that_is_not_one_is_one_line_naming_the_file(case, command, tmp_path):
    make, message = CASES[case]
    doc = make(copy.deepcopy(_valid(tmp_path)))
    path = manifest_path(tmp_path)
    path.write_text(json.dumps(doc))
    res = CliRunner().invoke(sweep_cli.app, [command, "--out", str(tmp_path)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"zaec-sweep: error: sweep manifest {path} "), res.stderr
    assert message in err[0], err[0]


def test_a_valid_manifest_reads_back(tmp_path):
    doc = _valid(tmp_path)
    assert doc["version"] == MANIFEST_VERSION
    m = Manifest.load(tmp_path)
    assert list(m.rows) == [doc["runs"][0]["run_id"]] and m.spec(doc["runs"][0]["run_id"]).method == "tda"
