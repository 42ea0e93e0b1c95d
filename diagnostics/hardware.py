"""Mixed hardware (CONVERGENCE/hardware): did every rank compute the same bits? From the canary's record
(results.json ``canary``, or rank 0's status.json ``canary`` when ``dist.heterogeneous=refuse`` stopped the run
before the loop) and the ranks' numeric fingerprints (results.json ``numeric_classes``): the ranks and nodes of
each numeric class, the settings that differ, the drift measured on the probe, and the remedy
``dist.heterogeneous=pin`` (every rank on the lowest common kernel set), whose effect ``doctor --apply``
measures (``canary_effect``)."""
from __future__ import annotations

from disteval.rank.canary import describe

from diagnostics.evidence import Evidence, Run
from diagnostics.findings import Finding
from diagnostics.remedies import Remedy

PIN = Remedy(["dist.heterogeneous=pin"], "every rank on the lowest common kernel set (CPU: ATEN_CPU_CAPABILITY; "
             "CUDA: TF32 off, highest matmul precision, deterministic algorithms), checked by the canary")


def canary_record(run: Run) -> tuple[dict | None, str]:
    """(the canary's record, the file it came from): results.json's, else rank 0's status record's."""
    rec = (run.results or {}).get("canary")
    if rec:
        return rec, "results.json"
    rec = (run.statuses.get(0) or {}).get("canary")
    return (rec, "ranks/rank0/status.json") if rec else (None, "")


def convergence_hardware(run: Run, probes: dict | None) -> Finding:
    """Every rank computed the same bits on the canary's probe batch and ran the same kernels. A fail names
    the classes (ranks, nodes), what differs and the drift, with the remedy ``dist.heterogeneous=pin``; a warn
    when the fingerprints differ but the probe gave the same bits."""
    rec, src = canary_record(run)
    classes = (run.results or {}).get("numeric_classes") or []
    if not rec and len(classes) < 2:
        return Finding("CONVERGENCE", "hardware", "skipped", "no canary record and no numeric classes "
                       "(dist.canary_samples=0, or the run ended before its canary)")
    if rec and rec.get("homogeneous") is False:
        others = rec["classes"][1:]
        culprit = others[0]["ranks"][0] if len(others) == 1 and len(others[0]["ranks"]) == 1 else None
        ev = [Evidence(src, str([c["ranks"] for c in rec["classes"]]), field="canary.classes")]
        ev += [Evidence(src, str(c.get("differs") or "same fingerprint"), field=f"canary.classes[{i}].differs")
               for i, c in enumerate(rec["classes"]) if i]
        refused = rec.get("policy") in ("refuse", "pin") and not run.results
        what = ("dist.heterogeneous=" + rec.get("policy", "") + " stopped the run before the loop" if refused else
                "the metrics depend on which samples landed on which class")
        if not any(c.get("differs") for c in others):  # same kernels, other bits: not the hardware
            return Finding("CONVERGENCE", "hardware", "warn", f"{describe(rec)}; the ranks ran the same kernels, so "
                           "the weights or the model differ between ranks (a stale checkpoint, a nondeterministic "
                           "layer): see RESULT/outliers", ev, culprit=culprit)
        return Finding("CONVERGENCE", "hardware", "fail", f"hardware drift: {describe(rec)}; {what}", ev, PIN,
                       culprit=culprit, phase="forward")
    if len(classes) > 1:
        differs = sorted({k for c in classes[1:] for k in c.get("differs") or []})
        return Finding("CONVERGENCE", "hardware", "warn", f"the ranks ran different kernels ({len(classes)} numeric "
                       f"classes: {[c['ranks'] for c in classes]}, differing in {', '.join(differs)})" +
                       ("; the canary's probe gave the same bits on every rank"
                        if rec and rec.get("homogeneous") else ""),
                       [Evidence("results.json", str([c["ranks"] for c in classes]), field="numeric_classes")], PIN)
    pinned = (rec or {}).get("cpu_kernels")
    return Finding("CONVERGENCE", "hardware", "pass", "every rank computed the same bits on the canary's probe "
                   f"({rec.get('samples')} samples)" + (f", pinned to {pinned['pinned']} kernels from "
                                                        f"{pinned['capabilities']}" if pinned else "")
                   if rec and "samples" in rec else "one numeric class", [Evidence(src or "results.json", "one class",
                                                                                   field="canary.homogeneous")])


def canary_effect(before: Run, after: Run) -> dict:
    """What ``dist.heterogeneous=pin`` changed (for ``doctor --apply``'s attempts.json): the numeric classes the
    canary found before and after, and the kernel set the ranks were pinned to. {} when the failed run has no
    canary that found a difference."""
    rec, _ = canary_record(before)
    if not rec or rec.get("homogeneous") is not False:
        return {}
    now, _ = canary_record(after)
    now = now or {}
    return {"classes_before": [c["ranks"] for c in rec["classes"]],
            "classes_after": [c["ranks"] for c in now.get("classes") or []],
            "homogeneous_after": now.get("homogeneous"), "pinned": (now.get("cpu_kernels") or {}).get("pinned"),
            "pinned_cuda": now.get("pinned_cuda")}


KERNEL_FIELDS = ("cpu_capability", "cpu_flags", "gpu", "torch", "cuda", "cudnn", "blas", "tf32", "matmul_precision",
                 "deterministic", "cudnn_flags", "threads", "dtype")  # the fingerprint's kernel-deciding fields


def fingerprint_differences(results_a: dict, results_b: dict) -> list[dict]:
    """The kernel-deciding fingerprint fields whose values differ between two runs (``diagnostics compare``):
    [{field, a, b}] with each run's distinct values over its ranks (results.json ``per_rank[].fingerprint``),
    plus ``canary`` {a, b} when both ran the canary on the same probe size and rank 0's output digests differ
    (the same samples through the same model gave other bits). [] when either run recorded no fingerprint."""
    def values(res: dict, key: str) -> list:
        seen: list = []
        for p in res.get("per_rank") or []:
            v = (p.get("fingerprint") or {}).get(key)
            if v not in seen:
                seen.append(v)
        return seen

    if not any(p.get("fingerprint") for p in results_a.get("per_rank") or []) or \
            not any(p.get("fingerprint") for p in results_b.get("per_rank") or []):
        return []
    out = [{"field": k, "a": values(results_a, k), "b": values(results_b, k)} for k in KERNEL_FIELDS
           if values(results_a, k) != values(results_b, k)]
    ca, cb = results_a.get("canary") or {}, results_b.get("canary") or {}
    if ca.get("digest") and cb.get("digest") and ca.get("samples") == cb.get("samples") and \
            ca["digest"] != cb["digest"]:
        out.append({"field": "canary", "a": ca["digest"], "b": cb["digest"]})
    return out
