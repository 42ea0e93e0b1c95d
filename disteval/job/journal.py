"""The journal's records (``eval.journal``, ``eval.resume``): what a run directory holds of a run's durable
progress and how another run finds and checks it. The ranks write them (``disteval.rank.journal``); the driver
checks a resume against them before any rank starts (``check_resume``).

``RUN_DIR/journal.json`` (every recording rank, the same content, before its first window): what the numbers
depend on (``identity``: model, data, precision and evaluation settings, the tensor-parallel degree; not the
world size, launcher, loader workers or timeouts), the prediction store's settings, the sample count, and the
run resumed from, if any. ``RUN_DIR/ranks/rank{r}/journal/{start}-{end}.pt``: one window (``disteval.metrics.window``)
per file, named by its first and end sample ids (12 digits), written atomically. A window on another node's
local disk is not seen by a resume: its batches are evaluated again (never wrong, only slower).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from disteval.errors import ConfigError
from disteval.job.records import atomic_write_json, plain

log = logging.getLogger("disteval.rank")

MANIFEST = "journal.json"
SCHEMA = 1
# settings that do not change any number of a run (how and where it runs): left out of the identity
NOT_IDENTITY = ("dist", "communication", "hydra", "eval.resume", "eval.journal", "eval.progress",
                "eval.status_interval_s", "eval.overwrite", "eval.save_predictions", "eval.predictions",
                "eval.trials", "eval.trial_aggregate", "eval.clip_sigma", "eval.outlier_z",
                "eval.exclude_outlier_ranks", "data.num_workers", "data.prefetch_factor",
                "data.persistent_workers", "data.loader_timeout_s", "data.cache", "data.cache_dir",
                "data.cache_verify", "experiment_name", "communication_profile", "preflight_notes")


AUTO = "auto"


def resume_dir(cfg: Any) -> str | None:
    """The run directory ``eval.resume`` names, None for ``null`` and for an unresolved ``auto``."""
    value = cfg.eval.resume
    return None if value in (None, "", AUTO) else str(value)


def resolve_auto(cfg: Any, previous: str | Path) -> tuple[str | None, str | None]:
    """``eval.resume=auto`` (the default) for a run directory given again: the newest earlier run moved to
    ``previous`` (``RUN_DIR/previous/``, ``disteval.job.rundir``) that recorded progress, when it did not finish
    (no results.json). Returns ``(its path, a note)`` when its identity equals ``cfg``'s, ``(None, a note naming the
    settings that differ)`` when not, ``(None, None)`` when there is none."""
    earlier = sorted((p for p in Path(previous).glob("*/") if (p / MANIFEST).is_file()), key=lambda p: p.name)
    if not earlier or (earlier[-1] / "results.json").exists():  # none, or the newest finished: nothing to resume
        return None, None
    last = earlier[-1]
    try:
        manifest = json.loads((last / MANIFEST).read_text())
    except (OSError, ValueError):
        return None, f"the unfinished earlier run in {last} has an unreadable {MANIFEST}: not resumed"
    differ = _differing(identity(cfg), manifest.get("identity") or {})
    if not differ and store_mismatch(cfg, manifest, last):
        differ = ["eval.save_predictions/eval.predictions"]
    if differ:
        return None, (f"the unfinished earlier run in {last} had other settings ({', '.join(differ[:5])}): "
                      "not resumed, evaluating everything")
    return str(last), (f"resuming the unfinished earlier run in {last} (eval.resume=auto): only what it did not "
                       "record is evaluated; eval.resume=null evaluates everything")


def _differing(want: dict, got: dict) -> list[str]:
    """The keys whose values differ between two identities (missing on one side counts), sorted."""
    return sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))


def identity(cfg: Any) -> dict[str, Any]:
    """``{dotted key: value}`` of every setting a run's numbers depend on (all of the resolved config but
    ``NOT_IDENTITY``): two runs with equal identities evaluate the same samples into the same states."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif not any(prefix == x or prefix.startswith(x + ".") for x in NOT_IDENTITY):
            flat[prefix] = node

    walk(plain(cfg), "")
    parallel = (plain(cfg).get("dist") or {}).get("parallel") or {}
    flat["dist.parallel.tp"] = int(parallel.get("tp") or 1)  # TP splits the matmuls: other float bits
    return flat


def resume_problem(cfg: Any) -> str | None:
    """Why a run cannot record its progress for an exact resume (the setting to change), None when it can: a
    sampler that pads or drops (map-style data; streamed shards are always exact)."""
    sampler = str(cfg.data.sampler)
    if sampler != "exact":
        return (f"data.sampler={sampler} (it pads or drops samples by the world size, so no result is the same at "
                "every world size)")
    return None


def store_settings(cfg: Any) -> dict | None:
    """The prediction store's settings when the run writes one (its windows carry the store's rows), else None:
    {eval.predictions: ...}. Not part of ``identity`` (the store does not change the metrics), but a run that
    writes a store resumes only from records that carry its rows in the same settings (``store_mismatch``)."""
    return {"eval.predictions": plain(cfg.eval.predictions)} if cfg.eval.save_predictions else None


def store_mismatch(cfg: Any, manifest: dict, at: Path) -> str | None:
    """Why the records of ``manifest`` (in ``at``) cannot fill this run's prediction store, None when they can
    (the run writes no store, or the records carry its rows in the same settings)."""
    want = store_settings(cfg)
    if want is None or manifest.get("store") == want:
        return None
    got = manifest.get("store")
    if got is None:
        return (f"the run in {at} wrote no prediction store, so its records hold no predictions for "
                "eval.save_predictions=true; resume with eval.save_predictions=false, or evaluate anew")
    return f"the prediction store in {at} was recorded with {got}, this run asks for {want}"


def journal_dir(run_dir: Path, rank: int) -> Path:
    """``RUN_DIR/ranks/rank{rank}/journal``."""
    return Path(run_dir) / "ranks" / f"rank{rank}" / "journal"


def write_manifest(run_dir: Path, cfg: Any, num_samples: int, job_id: str | None, resumed_from: Path | None) -> None:
    """Every recording rank (the same content; node-local run directories get one each): ``RUN_DIR/journal.json``
    {schema, identity, store, num_samples, job (the scheduler's job id, kept by a requeued job), resumed_from},
    atomically."""
    atomic_write_json(Path(run_dir) / MANIFEST, {
        "schema": SCHEMA, "identity": identity(cfg), "store": store_settings(cfg), "num_samples": int(num_samples),
        "job": job_id or None,
        "resumed_from": str(Path(resumed_from).resolve()) if resumed_from else None})


def requeue_chain(run_dir: Path, cfg: Any, job_id: str | None, num_samples: int) -> list[Path]:
    """``eval.resume=auto`` in a job the scheduler requeued (the same job id: a requeue by hand, after a node
    failure, a time limit without the checkpoint signal): the run directory itself and the runs it resumed from,
    when its ``journal.json`` is of this job with the same identity; else [] (a new job starts afresh)."""
    path = Path(run_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not job_id or manifest.get("job") != job_id or manifest.get("identity") != identity(cfg) or \
            int(manifest.get("num_samples", -1)) != int(num_samples) or store_mismatch(cfg, manifest, run_dir):
        return []
    earlier = manifest.get("resumed_from")
    return [Path(run_dir).resolve(), *(_chain(Path(earlier), cfg, num_samples) if earlier else [])]


def _manifest(run_dir: Path) -> dict:
    path = Path(run_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("eval.resume", f"{run_dir} holds no {MANIFEST}: not the run directory of a run that "
                          "recorded its progress (eval.journal.enabled)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError("eval.resume", f"{path} cannot be read: {exc}") from None


def check_resume(cfg: Any, num_samples: int | None = None) -> list[Path]:
    """Before any rank starts (and again on each rank with the dataset's size): the run directories whose
    records ``eval.resume`` will use (the one named and those it resumed from), after checking that each
    recorded the same ``identity`` as ``cfg``. Raises ConfigError naming ``eval.resume`` and each setting that
    differs (old and new value), a missing directory or manifest, another sample count, or a cycle."""
    return _chain(Path(str(resume_dir(cfg))).expanduser(), cfg, num_samples)


def _chain(at: Path | None, cfg: Any, num_samples: int | None) -> list[Path]:
    chain: list[Path] = []
    want = identity(cfg)
    while at is not None:
        if not at.is_dir():
            raise ConfigError("eval.resume", f"no run directory {at}")
        if at.resolve() in chain:
            raise ConfigError("eval.resume", f"{at} resumes from itself (a cycle of resumed runs)")
        manifest = _manifest(at)
        got = manifest.get("identity") or {}
        differ = _differing(want, got)
        if differ:
            shown = "; ".join(f"{k}: recorded {got.get(k)!r}, now {want.get(k)!r}" for k in differ[:8])
            raise ConfigError("eval.resume", f"the records in {at} are of another run: {shown}"
                              f"{' (and more)' if len(differ) > 8 else ''}; resume with the settings the run had")
        store = store_mismatch(cfg, manifest, at)
        if store:
            raise ConfigError("eval.resume", store)
        if num_samples is not None and int(manifest.get("num_samples", -1)) != int(num_samples):
            raise ConfigError("eval.resume", f"the records in {at} cover {manifest.get('num_samples')} samples; the "
                              f"dataset now has {num_samples} (its files changed?)")
        chain.append(at.resolve())
        nxt = manifest.get("resumed_from")
        at = Path(nxt) if nxt else None
    return chain
