"""``python -m diagnostics compare RUN_A RUN_B [--json]``: when two runs disagree, name where.

Reads each run's ``results.json`` and, when ``eval.record_batches`` was on, ``ranks/rank{r}/batches.json``
(per batch ``[global index, first sample id, size]``, one output digest per sample, the batch's float64
partial sums in bitwise mode). Reports, in this order:

1. metrics: the first one that differs (keys in run A's order, recursing into dicts and lists; relative
   difference for numbers) and how many differ;
2. forward: digests joined by sample id: the first batch of run A and the first sample ids whose outputs
   differ; with identical outputs but other metrics, only the reduction differs, and the per-batch
   partials say whether the batches' sums or only their order/grouping differ;
3. settings: mode, threads, determinism, device, precision, versions, world size, batch size, model,
   config digest, fault injection.

JSON (``--json``)::

    {"run_a": str, "run_b": str, "exit_code": 0 | 1 | 2, "identical": bool,
     "first_metric": null | {"key", "a", "b", "rel_diff": float | null},
     "metrics_differing": int, "metrics_compared": int, "differing_keys": [str],
     "forward": {"identical": bool | null (not recorded), "first_batch": int | null, "first_batch_rank",
                 "sample_ids": [int], "count": int | null, "ranks": [int], "batch_composition_differs",
                 "note": str},
     "reduction": null | {"only_reduction": true, "partials": "equal" | "differ" | "unavailable",
                          "first_batch": int | null, "why": str},
     "settings_differ": [{"setting", "a", "b", "note"}],
     "fingerprint_differs": [{"field", "a", "b"}], "first_suspect": null | str}

``fingerprint_differs``: the ranks' numeric fingerprints (kernel set, GPU, TF32, versions ...) and the canary's
probe digest, compared between the runs (``diagnostics.hardware``); when the metrics differ and the forward is
not known to be identical, such a difference is named first (``first_suspect``): other kernels compute other bits.

On an error (exit code 2): ``{"exit_code": 2, "error": str}``. Exit codes: 0 the metrics are identical,
1 they differ, 2 the runs cannot be compared (a directory or results.json missing or unreadable).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from disteval.errors import DataError

from diagnostics.hardware import fingerprint_differences
from diagnostics.significance import describe as describe_significance, paired_test

SHOW_IDS = 8  # sample ids named in the report
SETTINGS = ("mode", "compute.threads", "compute.deterministic", "device", "precision.model_dtype", "precision.tf32",
            "precision.deterministic", "precision.cudnn_benchmark", "world_size", "dataset.name",
            "dataset.num_samples", "dataset.batch_size", "model.name", "model.weights", "model.checkpoint",
            "config_digest", "compute.compile", "compute.compile_backend", "compute.channels_last")
NOTES = {
    "mode": "fast mode sums floats in arrival order over shards not aligned to batches: last bits can differ",
    "compute.threads": "intra-op threads change the order of float sums inside kernels",
    "compute.deterministic": "nondeterministic algorithms can change outputs (GPU)",
    "precision.deterministic": "nondeterministic algorithms can change outputs (GPU)",
    "precision.tf32": "TF32 matmuls round differently (GPU)",
    "precision.model_dtype": "another dtype computes other outputs",
    "precision.cudnn_benchmark": "cuDNN autotuning can pick other kernels (GPU)",
    "device": "other hardware can compute other bits",
    "dataset.batch_size": "another batch composition: batched kernels may compute other bits",
    "faults": "fault injection (DISTEVAL_FAULTS) perturbed one run",
    "compute.compile": "compiled kernels fuse and reorder float operations: other last bits than eager",
    "compute.compile_backend": "another torch.compile backend generates other kernels",
    "compute.channels_last": "channels_last convolutions use other kernels: other last bits",
}


@dataclass
class RunRecords:
    """What compare reads of one run: results.json, launch.json (may be None) and each rank's batches.json
    (``batches`` None when not recorded; ``batches_note`` says why)."""

    path: Path
    results: dict
    launch: dict | None
    batches: dict[int, dict] | None
    batches_note: str | None = None


def _read_json(path: Path) -> dict:
    """The JSON object in ``path``; FileNotFoundError / ValueError naming the file otherwise."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is unreadable: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object ({type(value).__name__})")
    return value


def _check_batches(path: Path, rec: dict) -> None:
    """ValueError naming ``path`` when a batches.json is inconsistent."""
    batches, digests = rec.get("batches"), rec.get("digests")
    if not isinstance(batches, list) or not isinstance(digests, list):
        raise ValueError(f"{path}: 'batches' and 'digests' must be lists")
    if any(not isinstance(b, list) or len(b) != 3 for b in batches):
        raise ValueError(f"{path}: every batch must be [global_batch_index, first_sample_id, size]")
    if sum(int(b[2]) for b in batches) != len(digests):
        raise ValueError(f"{path}: {len(digests)} digests but the batches hold {sum(int(b[2]) for b in batches)} samples")
    partials = rec.get("partials") or []
    if partials and len(partials) != len(batches):
        raise ValueError(f"{path}: {len(partials)} partials for {len(batches)} batches")


def _load_batches(path: Path, world_size: int) -> tuple[dict[int, dict] | None, str | None]:
    """Every rank's batches.json, or (None, why) when a rank has none."""
    files = {r: path / "ranks" / f"rank{r}" / "batches.json" for r in range(world_size)}
    missing = [r for r, f in files.items() if not f.exists()]
    if len(missing) == world_size and (path / "results.json").exists() and \
            (_read_json(path / "results.json").get("checkpoint_set")):
        return None, (f"{path} is one checkpoint of a model.checkpoints job: the job's ranks/ hold the batches of "
                      "all its checkpoints together, so the forward is not compared per checkpoint")
    if len(missing) == world_size:
        return None, f"{path} has no ranks/rank*/batches.json: eval.record_batches was off"
    if missing:
        return None, f"{files[missing[0]]} is missing (rank {missing[0]} recorded no batches)"
    out = {}
    for r, f in files.items():
        out[r] = _read_json(f)
        _check_batches(f, out[r])
    return out, None


def load_records(path: str | Path) -> RunRecords:
    """Read a run directory. FileNotFoundError when it or its results.json is missing; ValueError when a record
    is unreadable. A run without batches.json loads (``batches`` None)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a run directory (no such directory)")
    results_path = path / "results.json"
    if not results_path.exists():
        raise FileNotFoundError(f"{results_path} is missing: the run did not finish, or {path} is not a run directory")
    results = _read_json(results_path)
    if results.get("checkpoints"):
        raise ValueError(f"{path} is a job of several checkpoints ({', '.join(b['name'] for b in results['checkpoints'])}): "
                         f"compare one checkpoint's run directory, {path}/checkpoints/<name>")
    if not isinstance(results.get("metrics"), dict):
        raise ValueError(f"{results_path}: field 'metrics' is missing or not an object")
    size = results.get("world_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{results_path}: field 'world_size' is missing or not a positive integer")
    launch = _read_json(path / "launch.json") if (path / "launch.json").exists() else None
    batches, note = _load_batches(path, size)
    return RunRecords(path, results, launch, batches, note)


# ------------------------------------------------------------------------------------------------- metrics
def _number(v: Any) -> bool:
    """An int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same(a: Any, b: Any) -> bool:
    """Exact equality (numbers by value, 1 == 1.0); NaN equals NaN (the same record twice is identical)."""
    if _number(a) and _number(b):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def _rel_diff(a: Any, b: Any) -> float | None:
    """|a - b| / max(|a|, |b|) for two finite numbers, else None."""
    if not (_number(a) and _number(b)) or not (math.isfinite(a) and math.isfinite(b)):
        return None
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def diff_metrics(a: Any, b: Any, key: str = "") -> tuple[list[dict], int]:
    """Leaves of ``a`` and ``b`` that differ, in walk order (dict keys in a's order, then b's extra keys;
    list items by index), and the number of leaves compared. Each: {key, a, b, rel_diff}."""
    if isinstance(a, dict) and isinstance(b, dict):
        out, n = [], 0
        for k in list(a) + [k for k in b if k not in a]:
            sub = f"{key}.{k}" if key else str(k)
            if k not in a or k not in b:
                out.append({"key": sub, "a": a.get(k, "(missing)"), "b": b.get(k, "(missing)"), "rel_diff": None})
                n += 1
                continue
            d, m = diff_metrics(a[k], b[k], sub)
            out += d
            n += m
        return out, n
    if isinstance(a, list) and isinstance(b, list):
        out, n = [], 0
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b):
                out.append({"key": f"{key}[{i}]", "a": a[i] if i < len(a) else "(missing)",
                            "b": b[i] if i < len(b) else "(missing)", "rel_diff": None})
                n += 1
                continue
            d, m = diff_metrics(a[i], b[i], f"{key}[{i}]")
            out += d
            n += m
        return out, n
    if _same(a, b):
        return [], 1
    return [{"key": key, "a": a, "b": b, "rel_diff": _rel_diff(a, b)}], 1


# ------------------------------------------------------------------------------------------------- forward
def _sample_index(batches: dict[int, dict]) -> tuple[dict[int, int], dict[int, tuple[int, int, int, int]]]:
    """(sample id -> digest, sample id -> (rank, global batch index, first sample id, size))."""
    digests, where = {}, {}
    for r, rec in sorted(batches.items()):
        pos = 0
        for index, first, size in rec["batches"]:
            for k in range(int(size)):
                digests[int(first) + k] = rec["digests"][pos + k]
                where[int(first) + k] = (r, int(index), int(first), int(size))
            pos += int(size)
    return digests, where


def _batch_keys(batches: dict[int, dict]) -> set[tuple[int, int, int]]:
    """Every rank's batches as (global index, first sample id, size)."""
    return {(int(i), int(f), int(s)) for rec in batches.values() for i, f, s in rec["batches"]}


def compare_forward(a: RunRecords, b: RunRecords) -> dict:
    """Join the per-sample output digests of both runs by sample id (see the module's JSON schema)."""
    out = {"identical": None, "first_batch": None, "first_batch_rank": None, "sample_ids": [], "count": None,
           "ranks": [], "batch_composition_differs": None, "note": ""}
    if a.batches is None or b.batches is None:
        out["note"] = "; ".join(n for n in (a.batches_note, b.batches_note) if n) + ": the forward cannot be compared"
        return out
    da, wa = _sample_index(a.batches)
    db, _ = _sample_index(b.batches)
    differ = sorted(s for s in da.keys() & db.keys() if da[s] != db[s])
    only = len(da.keys() ^ db.keys())
    sizes = (a.results.get("dataset", {}).get("batch_size"), b.results.get("dataset", {}).get("batch_size"))
    composition = _batch_keys(a.batches) != _batch_keys(b.batches)
    out.update(identical=not differ and not only, count=len(differ), sample_ids=differ[:SHOW_IDS],
               ranks=sorted({wa[s][0] for s in differ}), batch_composition_differs=composition)
    if differ:
        rank, index, first, size = wa[differ[0]]
        out.update(first_batch=index, first_batch_rank=rank)
        out["note"] = (f"outputs differ for {len(differ)} of {len(da.keys() & db.keys())} samples, first in global "
                       f"batch {index} of run A (rank {rank}, samples {first}..{first + size - 1})")
    else:
        out["note"] = f"outputs identical for all {len(da.keys() & db.keys())} samples"
    if only:
        out["note"] += f"; {only} sample id(s) are in one run only"
    if composition and differ:
        why = f"batch sizes differ ({sizes[0]} vs {sizes[1]})" if sizes[0] != sizes[1] else \
            "the runs grouped samples into other batches (shard boundaries)"
        out["note"] += f"; {why}: batch composition differs, so outputs can legitimately differ"
    return out


def compare_reduction(a: RunRecords, b: RunRecords) -> dict:
    """With identical outputs but other metrics: are the per-batch float partials equal (only the order or
    grouping of the reduction differs) or not (the per-batch arithmetic differs)?"""
    out = {"only_reduction": True, "partials": "unavailable", "first_batch": None}
    fast = [n for n, r in (("A", a), ("B", b))
            if any(rec["batches"] and not rec.get("partials") for rec in r.batches.values())]
    if fast:
        out["why"] = (f"run {' and '.join(fast)} recorded no per-batch partials (fast mode records none); the float "
                      "reduction's order/grouping differs between the runs")
        return out
    pa = {(int(i), int(f), int(s)): p for rec in a.batches.values() for (i, f, s), p in zip(rec["batches"], rec["partials"])}
    pb = {(int(i), int(f), int(s)): p for rec in b.batches.values() for (i, f, s), p in zip(rec["batches"], rec["partials"])}
    states = [rec.get("float_states") for rec in (*a.batches.values(), *b.batches.values())]
    if pa.keys() != pb.keys() or any(s != states[0] for s in states):
        out["why"] = "the runs' batches (or float states) differ, so their per-batch partials cannot be matched"
        return out
    bad = sorted(k for k in pa if len(pa[k]) != len(pb[k]) or not all(map(_same, pa[k], pb[k])))
    if not bad:
        out.update(partials="equal", why="every batch's float partials are equal: the order/grouping of the float "
                   "reduction across batches and ranks differs (e.g. fast mode)")
    else:
        out.update(partials="differ", first_batch=bad[0][0],
                   why=f"{len(bad)} batch(es)' float partials differ although their outputs are identical, first "
                       f"batch {bad[0][0]}: the per-batch metric arithmetic differs (versions, threads, precision)")
    return out


# ------------------------------------------------------------------------------------------------ settings
def _get(d: Any, dotted: str) -> Any:
    """The value at a dotted key of nested dicts, or None."""
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def compare_settings(a: RunRecords, b: RunRecords) -> list[dict]:
    """The recorded settings that differ: [{setting, a, b, note}]."""
    versions = list((a.results.get("versions") or {})) + [k for k in (b.results.get("versions") or {})
                                                          if k not in (a.results.get("versions") or {})]
    keys = list(SETTINGS) + [f"versions.{k}" for k in versions]
    out = []
    for key in keys:
        va, vb = _get(a.results, key), _get(b.results, key)
        if va != vb:
            out.append({"setting": key, "a": va, "b": vb, "note": NOTES.get(key, "")})
    fa, fb = (a.launch or {}).get("faults"), (b.launch or {}).get("faults")
    if fa != fb:
        out.append({"setting": "faults", "a": fa, "b": fb, "note": NOTES["faults"]})
    names = {s["setting"] for s in out}
    bitwise = a.results.get("mode") == b.results.get("mode") == "bitwise"
    for s in out:
        if s["setting"] == "world_size":
            s["note"] = ("harmless: bitwise mode gives bit-identical metrics at every world size" if bitwise else
                         "in fast mode the world size changes the shards and the reduction order")
        elif s["setting"] == "config_digest":
            shown = sorted(names - {"config_digest", "world_size"})
            s["note"] = "the resolved configurations differ" + (
                f" (in {', '.join(shown)} listed here" + (" and dist.world_size" if "world_size" in names else "")
                + "; compare the runs' .hydra/config.yaml for the rest)" if shown else
                " (dist.world_size differs; if that is all, the digest differs for it alone)" if "world_size" in names
                else " (compare the runs' .hydra/config.yaml)")
        elif s["setting"].startswith(("versions.", "model.")) and not s["note"]:
            s["note"] = "other library versions can change the arithmetic" if s["setting"].startswith("versions.") \
                else "another model or weights"
    return out


def compare_runs(path_a: str | Path, path_b: str | Path) -> dict:
    """Compare two run directories; the JSON dict of the module docstring. Raises FileNotFoundError or
    ValueError (naming the file) when a run cannot be read."""
    a, b = load_records(path_a), load_records(path_b)
    diffs, compared = diff_metrics(a.results["metrics"], b.results["metrics"])
    forward = compare_forward(a, b)
    reduction = compare_reduction(a, b) if diffs and forward["identical"] else None
    prints = fingerprint_differences(a.results, b.results)
    suspect = None
    if diffs and prints and forward["identical"] is not True:
        suspect = "the ranks computed with other kernels: " + "; ".join(
            f"{d['field']} A={d['a']} B={d['b']}" if d["field"] != "canary" else
            "the canary's probe outputs differ (the same samples through the same model gave other bits)" for d in prints)
    return {"run_a": str(a.path), "run_b": str(b.path), "exit_code": 1 if diffs else 0, "identical": not diffs,
            "first_metric": diffs[0] if diffs else None, "metrics_differing": len(diffs),
            "metrics_compared": compared, "differing_keys": [d["key"] for d in diffs[:50]], "forward": forward,
            "reduction": reduction, "settings_differ": compare_settings(a, b), "fingerprint_differs": prints,
            "first_suspect": suspect}


# ------------------------------------------------------------------------------------------------- output
def _metric_text(m: dict) -> str:
    """``key: A=.. B=.. (relative difference ..)``."""
    rel = f" (relative difference {m['rel_diff']:.3g})" if m.get("rel_diff") is not None else ""
    return f"{m['key']}: A={m['a']!r} B={m['b']!r}{rel}"


def summary(result: dict) -> str:
    """One paragraph: the first differing metric, where the forward differs, the settings that differ."""
    if result["identical"]:
        text = f"metrics identical ({result['metrics_compared']} values)"
    else:
        text = (f"{result['metrics_differing']} of {result['metrics_compared']} metric values differ, first "
                + _metric_text(result["first_metric"]))
    fwd, red = result["forward"], result["reduction"]
    if result.get("first_suspect"):
        text += f"; first suspect: {result['first_suspect']}"
    text += f"; forward: {fwd['note']}"
    if red:
        text += f"; only the reduction differs: {red['why']}"
    if result["settings_differ"]:
        text += "; settings that differ: " + ", ".join(s["setting"] for s in result["settings_differ"])
    return text


def _short(value: Any) -> str:
    """A setting's value for the table: long ones (config digests) cut to 24 characters."""
    text = str(value)
    return text if len(text) <= 24 else text[:23] + "…"


def print_comparison(result: dict, console: Console) -> None:
    """Rich text: metrics, forward, reduction, a table of the settings that differ, a closing verdict."""
    p = lambda s: console.print(s, soft_wrap=True, highlight=False)  # noqa: E731
    p(f"[bold]compare[/] A={escape(result['run_a'])}  B={escape(result['run_b'])}")
    if result["identical"]:
        p(f"[green]metrics:[/] all {result['metrics_compared']} values identical")
    else:
        p(f"[red]metrics:[/] {result['metrics_differing']} of {result['metrics_compared']} values differ; first "
          f"{escape(_metric_text(result['first_metric']))}")
    if result.get("first_suspect"):
        p(f"[red]first suspect:[/] {escape(result['first_suspect'])}")
    fwd = result["forward"]
    color = {True: "green", False: "red", None: "yellow"}[fwd["identical"]]
    ids = f" (sample ids {fwd['sample_ids']}{'...' if fwd['count'] > len(fwd['sample_ids']) else ''})" \
        if fwd["sample_ids"] else ""
    p(f"[{color}]forward:[/] {escape(fwd['note'])}{ids}")
    if result["reduction"]:
        p(f"[yellow]reduction:[/] only the reduction differs: {escape(result['reduction']['why'])}")
    if result["settings_differ"]:
        table = Table(title="settings that differ", expand=True)
        for col in ("setting", "A", "B", "note"):
            table.add_column(col, overflow="fold")
        for s in result["settings_differ"]:
            table.add_row(s["setting"], escape(_short(s["a"])), escape(_short(s["b"])), escape(s["note"]))
        console.print(table)
    else:
        p("settings: none of the recorded settings differ")
    if result.get("significance"):
        p(f"[bold]paired tests[/] on the same {result['significance']['samples']} samples (prediction stores):")
        for line in describe_significance(result["significance"]):
            p(f"  {escape(line)}")
    p("[bold green]verdict: identical metrics[/]" if result["identical"] else "[bold red]verdict: the metrics differ[/]")


def run_compare(run_a: Path, run_b: Path, as_json: bool, console: Console, paired: dict | None = None) -> int:
    """The ``compare`` subcommand: print the comparison; returns the exit code (0, 1 or 2). ``paired``
    {resamples, level, seed}: add the paired tests of ``diagnostics.significance`` (``significance`` in the JSON);
    exit 2 when the runs' samples differ or a store is missing."""
    try:
        result = compare_runs(run_a, run_b)
        if paired is not None:
            result["significance"] = paired_test(run_a, run_b, **paired)
    except (FileNotFoundError, ValueError, DataError) as exc:
        if as_json:
            print(json.dumps({"exit_code": 2, "error": str(exc)}))
        else:
            Console(stderr=True).print(f"[bold red]compare: cannot compare:[/] {escape(str(exc))}", soft_wrap=True,
                                       highlight=False)
        return 2
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print_comparison(result, console)
    return result["exit_code"]
