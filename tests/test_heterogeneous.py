"""Mixed hardware on one host: ranks computing with different CPU kernel sets (the ``cpu@R:capability=...`` drill
sets ``ATEN_CPU_CAPABILITY`` in a rank before its first kernel, as a node of other hardware would have it). The
canary must find the numeric classes and measure the drift (checked against logits computed in separate processes
at each kernel set, numpy for the differences); ``dist.heterogeneous`` = warn records, refuse stops before the
loop, pin gives metrics ``==`` to a homogeneous run; a homogeneous fleet raises no alarm."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, load_results, rank_status, run_disteval
from recorded_runs import diagnostics_cli

HERE = torch.backends.cpu.get_cpu_capability()  # the test process ran kernels already: what this CPU offers
FASHION_ROOT = "/usr/share/datasets/fashion-mnist"
pytestmark = pytest.mark.skipif(HERE == "DEFAULT", reason="this CPU offers no vectorised kernel set beyond DEFAULT: "
                                "every rank computes with the same kernels")
FIRST_2000 = "data.limit=2000"  # Fashion-MNIST's first 2,000 test images (CI time; the checks are the same)
needs_fashion = pytest.mark.skipif(not os.path.isdir(FASHION_ROOT),
                                   reason="Debian package dataset-fashion-mnist not installed (.ci/run installs it)")

# the fashion-mnist job's first 32 test images (the canary's probe; idx file read with numpy) through the shipped
# checkpoint, one thread, in a fresh process whose kernel set is chosen by its environment; independent of
# disteval's data and canary code
PROBE_SCRIPT = """
import gzip, sys, numpy as np, torch
from disteval.models.reference_cnn import FashionCNN
torch.set_num_threads(1)
raw = gzip.open(sys.argv[1] + "/t10k-images-idx3-ubyte.gz").read()
images = np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(-1, 1, 28, 28)[:32]
model = FashionCNN()
model.load_state_dict(torch.load(sys.argv[2], weights_only=True))
with torch.inference_mode():
    out = model.eval()(torch.from_numpy(images.astype(np.float32) / 255.0)).float()
assert torch.backends.cpu.get_cpu_capability() == sys.argv[4], torch.backends.cpu.get_cpu_capability()
np.save(sys.argv[3], out.numpy())
"""


def _probe_logits(tmp_path, capability: str) -> np.ndarray:
    out = tmp_path / f"probe_{capability}.npy"
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.lower())
    subprocess.run([sys.executable, "-c", PROBE_SCRIPT, FASHION_ROOT, str(REPO / "disteval/models/checkpoints/fashion_cnn.pt"),
                    str(out), capability], env=env, check=True, timeout=120)
    return np.load(out)


def _drill(run_dir, *overrides, faults: str | None = None, env: dict | None = None):
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    if env is None and not any(k in os.environ for k in ("DISTEVAL_FAULTS", "ATEN_CPU_CAPABILITY")):
        # only the drill added: at world size 2 or more it runs in this process (tests/inline_run.py)
        return run_disteval(*overrides, run_dir=run_dir, env={"DISTEVAL_FAULTS": faults} if faults else None)
    full = {k: v for k, v in os.environ.items() if k not in ("DISTEVAL_FAULTS", "ATEN_CPU_CAPABILITY")}
    full.update(env or {})
    if faults:
        full["DISTEVAL_FAULTS"] = faults
    return run_disteval(*overrides, run_dir=run_dir, env=full)


@needs_fashion
def test_two_ranks_on_different_kernels_warn_refuse_pin(tmp_path):
    """Fashion-MNIST at W=2, rank 1 on DEFAULT kernels, rank 0 on this CPU's best: warn runs and records two classes,
    the differing setting and the drift numpy measures on the probe; refuse stops before the loop naming rank 1
    and the setting; pin runs both on DEFAULT with metrics == a one-rank run on DEFAULT kernels."""
    job = ("+experiment=fashion_mnist", FIRST_2000, "dist.world_size=2")
    warn = _drill(tmp_path / "warn" / "run", *job, faults="cpu@1:capability=default")
    assert warn.returncode == 0, warn.stderr[-3000:]
    res = load_results(tmp_path / "warn" / "run")
    canary = res["canary"]
    assert canary["policy"] == "warn" and canary["homogeneous"] is False and canary["samples"] == 32
    assert [c["ranks"] for c in canary["classes"]] == [[0], [1]]
    assert canary["classes"][1]["differs"] == {"cpu_capability": [HERE, "DEFAULT"]}
    fast, slow = _probe_logits(tmp_path, HERE), _probe_logits(tmp_path, "DEFAULT")
    d = canary["classes"][1]["drift"]
    diff = np.abs(fast.astype(np.float64) - slow.astype(np.float64))
    assert d["max_abs_diff"] == float(diff.max()) and d["max_abs_diff"] > 0
    assert d["max_rel_diff"] == float((diff / np.maximum(np.abs(fast.astype(np.float64)), np.finfo(np.float64).tiny)).max())
    assert d["argmax_flips"] == int((fast.argmax(1) != slow.argmax(1)).sum())
    assert [p["fingerprint"]["cpu_capability"] for p in res["per_rank"]] == [HERE, "DEFAULT"]
    assert any(w.startswith("the metrics depend on the placement of samples") and "cpu_capability" in w
               for w in res["warnings"]), res["warnings"]
    assert "numeric classes" in " ".join(warn.stdout.split() + warn.stderr.split())

    refuse = _drill(tmp_path / "refuse" / "run", *job, "dist.heterogeneous=refuse", faults="cpu@1:capability=default")
    assert refuse.returncode == 1
    assert not (tmp_path / "refuse" / "run" / "results.json").exists()
    for r in range(2):
        st = rank_status(tmp_path / "refuse" / "run", r)
        assert st["error"]["type"] == "NumericDriftError" and st.get("batches_done", 0) == 0, st
        assert "ranks [1]" in st["error"]["message"] and f"cpu_capability {HERE} vs DEFAULT" in st["error"]["message"]
    assert "NumericDriftError" in refuse.stderr and "dist.heterogeneous=refuse" in refuse.stderr

    pin = _drill(tmp_path / "pin" / "run", *job, "dist.heterogeneous=pin", faults="cpu@1:capability=default")
    assert pin.returncode == 0, pin.stderr[-3000:]
    pinned = load_results(tmp_path / "pin" / "run")
    assert pinned["canary"]["homogeneous"] and pinned["canary"]["cpu_kernels"] == {
        "capabilities": [HERE, "DEFAULT"], "pinned": "DEFAULT"}
    assert [p["fingerprint"]["cpu_capability"] for p in pinned["per_rank"]] == ["DEFAULT", "DEFAULT"]
    ref = _drill(tmp_path / "ref" / "run", "+experiment=fashion_mnist", FIRST_2000, "dist.world_size=1",
                 env={"ATEN_CPU_CAPABILITY": "default"})
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert pinned["metrics"] == load_results(tmp_path / "ref" / "run")["metrics"]
    assert not pinned["warnings"]

    # the doctor: CONVERGENCE/hardware names the classes and the setting, remedy pin; --apply on the refused run
    # reruns with it (the drill still in the environment: the hardware is still mixed) and measures the effect
    drill_env = {**os.environ, "DISTEVAL_FAULTS": "cpu@1:capability=default"}
    doctor = diagnostics_cli(["doctor", "--json", str(tmp_path / "warn" / "run")], cwd=REPO)
    report = json.loads(doctor.stdout)["runs"][0]
    verdict = report["verdict"]
    assert (verdict["state"], verdict["check"], verdict["status"]) == ("CONVERGENCE", "hardware", "fail"), verdict
    assert "cpu_capability" in verdict["finding"] and verdict["culprit_rank"] == 1, verdict
    assert report["remedy"]["overrides"] == ["dist.heterogeneous=pin"] and doctor.returncode == 1
    doctor = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", "--apply", "--json",
                             str(tmp_path / "refuse" / "run")], capture_output=True, text=True, timeout=300,
                            cwd=REPO, env=drill_env)
    report = json.loads(doctor.stdout)["runs"][0]
    assert (report["verdict"]["state"], report["verdict"]["check"]) == ("CONVERGENCE", "hardware"), report["verdict"]
    attempt = report["attempts"][0]
    assert attempt["fixed"] and attempt["exit_code"] == 0 and "dist.heterogeneous=pin" in attempt["overrides"]
    assert attempt["effect"]["canary"] == {"classes_before": [[0], [1]], "classes_after": [[0, 1]],
                                           "homogeneous_after": True, "pinned": "DEFAULT", "pinned_cuda": None}
    retried = load_results(Path(attempt["run_dir"]))
    assert retried["metrics"] == pinned["metrics"]
    # compare names the kernel difference first when the forward differs
    cmp = diagnostics_cli(["compare", "--json", str(tmp_path / "warn" / "run"), str(tmp_path / "pin" / "run")], cwd=REPO)
    result = json.loads(cmp.stdout)
    assert cmp.returncode == 1 and result["first_suspect"].startswith("the ranks computed with other kernels")
    assert {"field": "cpu_capability", "a": [HERE, "DEFAULT"], "b": ["DEFAULT"]} in result["fingerprint_differs"]


@needs_fashion
def test_three_ranks_three_kernel_sets_on_fashion_mnist(tmp_path):
    """Fashion-MNIST at W=3: rank 0 on this CPU's best kernels, rank 1 on AVX2, rank 2 on DEFAULT (three numeric
    classes where the CPU has AVX512). warn records every class and its drift; pin brings all three to the lowest
    common set, DEFAULT, with metrics == a one-rank run on DEFAULT kernels, whose nll differs from this CPU's."""
    job = ("+experiment=fashion_mnist", FIRST_2000, "dist.world_size=3")
    drill = "cpu@1:capability=avx2;cpu@2:capability=default"
    warn = _drill(tmp_path / "warn" / "run", *job, faults=drill)
    assert warn.returncode == 0, warn.stderr[-3000:]
    canary = load_results(tmp_path / "warn" / "run")["canary"]
    # the classes the probe's logits form, each kernel set's computed in its own process (AVX2 and AVX512 may
    # well give the same bits for this model: then ranks 0 and 1 are one class though their fingerprints differ)
    logits = [_probe_logits(tmp_path, cap) for cap in (HERE, "AVX2", "DEFAULT")]
    want: list[list[int]] = []
    for r in range(3):
        same = next((c for c in want if np.array_equal(logits[c[0]], logits[r])), None)
        (same.append(r) if same is not None else want.append([r]))
    assert [c["ranks"] for c in canary["classes"]] == want and len(want) > 1
    for c in canary["classes"][1:]:
        assert c["drift"]["comparable"] and c["drift"]["max_abs_diff"] > 0 and "cpu_capability" in c["differs"]

    pin = _drill(tmp_path / "pin" / "run", *job, "dist.heterogeneous=pin", faults=drill)
    assert pin.returncode == 0, pin.stderr[-3000:]
    pinned = load_results(tmp_path / "pin" / "run")
    assert pinned["canary"]["cpu_kernels"] == {"capabilities": [HERE, "AVX2", "DEFAULT"], "pinned": "DEFAULT"}
    ref = _drill(tmp_path / "ref" / "run", "+experiment=fashion_mnist", FIRST_2000, "dist.world_size=1",
                 env={"ATEN_CPU_CAPABILITY": "default"})
    native = _drill(tmp_path / "native" / "run", "+experiment=fashion_mnist", FIRST_2000, "dist.world_size=1")
    assert ref.returncode == 0 and native.returncode == 0, ref.stderr[-3000:] + native.stderr[-3000:]
    want_metrics = load_results(tmp_path / "ref" / "run")["metrics"]
    assert pinned["metrics"] == want_metrics
    assert load_results(tmp_path / "native" / "run")["metrics"]["nll"] != want_metrics["nll"]  # pinning mattered


def test_same_bits_on_the_probe_but_different_kernels(tmp_path):
    """Digits' small CNN gives the same bits on the probe at DEFAULT and this CPU's kernels: the canary finds one
    class (no drift to report, refuse lets it run), the fingerprints still differ and the warning says both."""
    proc = _drill(tmp_path / "d" / "run", "+experiment=digits", "dist.world_size=2", "dist.heterogeneous=refuse",
                  faults="cpu@1:capability=default")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = load_results(tmp_path / "d" / "run")
    assert res["canary"]["homogeneous"] and [c["ranks"] for c in res["numeric_classes"]] == [[0], [1]]
    assert any("the ranks ran different kernels" in w and "the canary's probe batch gave the same bits" in w
               for w in res["warnings"]), res["warnings"]


def test_homogeneous_fleet_raises_no_alarm(tmp_path):
    """W=3 in fast mode (sample-even shards: every rank's batches start at other positions) with the same kernels:
    one class, no warning, under refuse too; dist.canary_samples=0 switches the canary off (no collective)."""
    proc = _drill(tmp_path / "fast" / "run", "+experiment=digits", "dist.world_size=3", "eval.mode=fast",
                  "dist.heterogeneous=refuse", "data.batch_size=50")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = load_results(tmp_path / "fast" / "run")
    assert res["canary"]["homogeneous"] and [c["ranks"] for c in res["canary"]["classes"]] == [[0, 1, 2]]
    assert not res["warnings"] and res["canary"]["samples"] == 32
    off = _drill(tmp_path / "off" / "run", "+experiment=digits", "dist.world_size=2", "dist.canary_samples=0")
    assert off.returncode == 0, off.stderr[-3000:]
    res = load_results(tmp_path / "off" / "run")
    assert res["canary"] == {"skipped": "dist.canary_samples=0"} and res["comm"]["collectives"] == 2
