"""``python -m diagnostics compare RUN_A RUN_B`` and ``doctor --reference`` on real runs of the digits job: the
same job at W=1 and W=2 in bitwise mode is identical; fast mode at W=3 differs in the metrics and names mode and
threads; a noise fault on rank 1 is found in the forward at rank 1's first sample; a run without batches.json
still compares metrics; a missing run directory cannot be compared (exit 2). Four runs, shared by the tests and
started only when a test first needs them; the partials cases edit copies of those runs."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import load_results, run_disteval
from recorded_runs import diagnostics_cli
from diagnostics.compare import compare_runs, diff_metrics

RUNS = {  # name: (overrides, env)
    "w1": (["dist.world_size=1"], None),
    "w2": (["dist.world_size=2"], None),
    "fast3": (["dist.world_size=3", "eval.mode=fast", "dist.threads=2"], None),  # threads: differ on any machine
    "noise": (["dist.world_size=2"], {"DISTEVAL_FAULTS": "noise@1:std=0.5"}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name)`` -> the run directory of RUNS[name], run once per module on first use."""
    base, done = tmp_path_factory.mktemp("compare"), {}

    def get(name: str) -> Path:
        if name not in done:
            overrides, env = RUNS[name]
            proc = run_disteval("eval.progress=false", *overrides, run_dir=base / name, env=env)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[name] = base / name
        return done[name]

    return get


def compare(a: Path, b: Path, *flags: str) -> subprocess.CompletedProcess:
    """``python -m diagnostics compare A B [flags]`` as a user would run it, in this process (it only reads
    records: ``recorded_runs.diagnostics_cli``)."""
    return diagnostics_cli(["compare", str(a), str(b), *flags], cwd=a.parent, env={"COLUMNS": "160"})


def compare_json(a: Path, b: Path) -> tuple[int, dict]:
    proc = compare(a, b, "--json")
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def settings(result: dict) -> dict[str, dict]:
    return {s["setting"]: s for s in result["settings_differ"]}


def test_diff_metrics_walks_in_key_order_and_recurses():
    a = {"top1": 0.5, "per_class": [1.0, 2.0], "nested": {"x": 1, "y": float("nan")}, "n": 3}
    b = {"top1": 0.5, "per_class": [1.0, 2.5], "nested": {"x": 2, "y": float("nan")}, "n": 3, "extra": None}
    diffs, compared = diff_metrics(a, b)
    assert [d["key"] for d in diffs] == ["per_class[1]", "nested.x", "extra"]
    assert diffs[0]["rel_diff"] == pytest.approx(0.2) and diffs[2]["a"] == "(missing)"
    assert compared == 7  # NaN equals NaN: the same record twice is identical


@pytest.mark.slow
def test_bitwise_w1_and_w2_are_identical(runs):
    w1, w2 = runs("w1"), runs("w2")
    code, result = compare_json(w1, w2)
    assert code == 0 and result["identical"] and result["first_metric"] is None and result["metrics_differing"] == 0
    assert result["forward"]["identical"] is True and result["forward"]["count"] == 0
    assert result["reduction"] is None
    ws = settings(result)["world_size"]
    assert (ws["a"], ws["b"]) == (1, 2) and "harmless" in ws["note"]
    assert not {"mode", "compute.threads", "faults"} & settings(result).keys()
    text = compare(w1, w2)
    assert text.returncode == 0 and "identical metrics" in text.stdout and "harmless" in text.stdout


@pytest.mark.slow
def test_fast_mode_differs_and_names_mode_and_threads(runs):
    w1, fast = runs("w1"), runs("fast3")
    code, result = compare_json(w1, fast)
    metrics_a, metrics_b = load_results(w1)["metrics"], load_results(fast)["metrics"]
    first = result["first_metric"]
    assert code == 1 and not result["identical"] and result["metrics_differing"] >= 1
    assert first["key"] in metrics_a and metrics_a[first["key"]] == first["a"] != first["b"] == metrics_b[first["key"]]
    assert first["rel_diff"] is not None and first["rel_diff"] > 0
    s = settings(result)
    assert (s["mode"]["a"], s["mode"]["b"]) == ("bitwise", "fast")
    assert (s["compute.threads"]["a"], s["compute.threads"]["b"]) == (1, 2)
    assert "harmless" not in s["world_size"]["note"]  # in fast mode the world size matters
    if result["forward"]["identical"]:  # the usual case on a CPU: same outputs, other float reduction
        assert result["reduction"]["only_reduction"] and result["reduction"]["partials"] == "unavailable"
        assert "fast mode" in result["reduction"]["why"]
    text = compare(w1, fast)
    assert text.returncode == 1 and first["key"] in text.stdout and "compute.threads" in text.stdout


@pytest.mark.slow
def test_noise_on_rank1_is_found_in_the_forward_at_its_first_sample(runs):
    w1, noisy = runs("w1"), runs("noise")
    res = load_results(noisy)
    first_of_rank1 = res["per_rank"][1]["shard"][0]
    code, result = compare_json(noisy, w1)
    fwd = result["forward"]
    assert code == 1 and result["first_metric"] is not None
    assert fwd["identical"] is False and fwd["sample_ids"][0] == first_of_rank1
    assert fwd["first_batch_rank"] == 1 and fwd["ranks"] == [1]
    assert fwd["first_batch"] == first_of_rank1 // res["dataset"]["batch_size"]  # bitwise: batch-aligned shards
    assert fwd["count"] == res["per_rank"][1]["samples"] and result["reduction"] is None
    assert settings(result)["faults"]["a"] == "noise@1:std=0.5"
    # the doctor, given the clean run as its reference, fails CONVERGENCE/reference and names rank 1
    proc = diagnostics_cli(["doctor", str(noisy), "--reference", str(w1), "--json"], cwd=noisy.parent)
    report = json.loads(proc.stdout)["runs"][0]
    assert proc.returncode == 1 and report["verdict"]["state"] == "CONVERGENCE"
    assert report["verdict"]["check"] == "reference" and report["culprit_rank"] == 1
    assert result["first_metric"]["key"] in report["verdict"]["finding"] and str(first_of_rank1) in report["verdict"]["finding"]


@pytest.mark.slow
def test_doctor_reference_passes_on_identical_runs_and_is_skipped_without(runs):
    w1, w2 = runs("w1"), runs("w2")
    for flags, status in ((["--reference", str(w1)], "pass"), ([], "skipped")):
        proc = diagnostics_cli(["doctor", str(w2), "--json", *flags], cwd=w2.parent)
        checks = {c["check"]: c for c in json.loads(proc.stdout)["runs"][0]["checks"]}
        assert proc.returncode == 0 and checks["reference"]["status"] == status, checks["reference"]


@pytest.mark.slow
def test_run_without_batches_json_still_compares_metrics(runs, tmp_path):
    """What eval.record_batches=false leaves: no ranks/rank*/batches.json."""
    bare = tmp_path / "bare"
    shutil.copytree(runs("fast3"), bare)
    for f in bare.glob("ranks/rank*/batches.json"):
        f.unlink()
    code, result = compare_json(runs("w1"), bare)
    assert code == 1 and result["first_metric"] is not None and "mode" in settings(result)
    assert result["forward"]["identical"] is None and "eval.record_batches was off" in result["forward"]["note"]


@pytest.mark.slow
def test_per_batch_partials_tell_grouping_from_arithmetic(runs, tmp_path):
    """Both bitwise, same batches: a metric edited by one ulp with equal partials is the reduction's order or
    grouping; an edited partial is named by its batch."""
    edited = tmp_path / "edited"
    shutil.copytree(runs("w2"), edited)
    res = json.loads((edited / "results.json").read_text())
    res["metrics"]["nll"] = math.nextafter(res["metrics"]["nll"], 1.0)
    (edited / "results.json").write_text(json.dumps(res))
    result = compare_runs(runs("w1"), edited)
    assert result["first_metric"]["key"] == "nll" and result["forward"]["identical"]
    assert result["reduction"]["partials"] == "equal" and "order/grouping" in result["reduction"]["why"]
    path = edited / "ranks" / "rank1" / "batches.json"
    rec = json.loads(path.read_text())
    rec["partials"][0][0] += 1e-9
    path.write_text(json.dumps(rec))
    result = compare_runs(runs("w1"), edited)
    assert result["reduction"]["partials"] == "differ" and result["reduction"]["first_batch"] == rec["batches"][0][0]


@pytest.mark.slow
def test_missing_or_unreadable_run_cannot_be_compared(runs, tmp_path):
    w1, missing = runs("w1"), tmp_path / "nope"
    proc = compare(w1, missing)
    assert proc.returncode == 2 and str(missing) in proc.stderr
    code, result = compare_json(missing, w1)
    assert code == 2 and str(missing) in result["error"]
    broken = tmp_path / "broken"
    shutil.copytree(w1, broken)
    (broken / "ranks" / "rank0" / "batches.json").write_text("{not json")
    with pytest.raises(ValueError, match="rank0/batches.json is unreadable"):
        compare_runs(w1, broken)
    (broken / "results.json").unlink()
    with pytest.raises(FileNotFoundError, match="results.json is missing"):
        compare_runs(w1, broken)
