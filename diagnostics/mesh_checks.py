"""Checks of a run under a device mesh (``dist.parallel``: dp_replicate x dp_shard x tp), from the ranks'
``parallel`` status records (``disteval.rank.parallel.MeshRun.status_record``), results.json ``parallel`` and the
ranks' errors:

- SHARDS/mesh: the exact shard of every data-parallel rank (batches, samples; TP peers share theirs), and the
  dummy steps each rank ran against the lockstep plan (``disteval.data.sharding.lockstep_plan``);
- COMM/tp_peers: a TP group whose sample-id or metric-state digests differed (the TP check's error);
- COMM/mesh_hang: where unfinished ranks wait: in a model collective (a forward of an FSDP/TP-sharded model,
  which needs every rank of its dp_shard / tp group) or in the metric sync over the data-parallel group, named
  as such; ranks in a forward while their peers already synchronise mean the forwards fell out of lockstep.
"""
from __future__ import annotations

from disteval.data.sharding import lockstep_plan, shard_batches
from disteval.config import ParallelConfig

from diagnostics.evidence import Evidence, Run
from diagnostics.findings import Finding, status_ev
from diagnostics.liveness import examine

__all__ = ["comm_mesh_hang", "comm_tp_peers", "mesh_of", "shards_mesh"]

_TP_ERROR = "tensor-parallel peers"


def mesh_of(run: Run) -> dict | None:
    """The mesh degrees {dp_replicate, dp_shard, tp} from results.json ``parallel``, any rank's status record
    or the config; None for a run without a mesh."""
    par = (run.results or {}).get("parallel")
    if not par:
        par = next((s["parallel"] for s in run.statuses.values() if s and s.get("parallel")), None)
    if not par:
        node = run.cfg("dist.parallel") or {}
        if not any(node.get(k) is not None for k in ("dp_replicate", "dp_shard", "tp")):
            return None
        config = ParallelConfig(**{k: node.get(k) for k in ("dp_replicate", "dp_shard", "tp")})
        return dict(zip(("dp_replicate", "dp_shard", "tp"), config.degrees(int(run.world_size or 1))))
    return {k: int(par.get(k) or 1) for k in ("dp_replicate", "dp_shard", "tp")}


def _dp_rank(rank: int, mesh: dict) -> int:
    return rank // mesh["tp"]  # tp innermost (disteval.comm.mesh)


def shards_mesh(run: Run, probes: dict | None) -> Finding:
    """Shard balance per data-parallel rank and the dummy steps each rank ran against the plan."""
    mesh = mesh_of(run)
    if mesh is None:
        return Finding("SHARDS", "mesh", "skipped", "no device mesh (dist.parallel not set)")
    n = (run.results or {}).get("dataset", {}).get("num_samples")
    bs = run.cfg("data.batch_size")
    if n is None or not bs:
        return Finding("SHARDS", "mesh", "skipped", "the dataset length or batch size is unknown")
    aligned = run.cfg("eval.mode", "bitwise") == "bitwise"
    dp = mesh["dp_replicate"] * mesh["dp_shard"]
    plan = lockstep_plan(n, int(bs), mesh["dp_replicate"], mesh["dp_shard"], aligned)
    desc = (f"dp_replicate={mesh['dp_replicate']} x dp_shard={mesh['dp_shard']} x tp={mesh['tp']}: N={n} over "
            f"{dp} data-parallel rank(s), batches per dp rank {plan['batches']}, planned dummy steps "
            f"{plan['dummy_steps']}")
    ev = [Evidence("results.json", str(mesh), field="parallel")]
    for r, s in sorted(run.statuses.items()):
        if not s or not s.get("parallel"):
            continue
        d = _dp_rank(r, mesh)
        want = plan["dummy_steps"][d]
        recorded = s["parallel"].get("dummy_steps_planned")
        if recorded is not None and recorded != want:
            return Finding("SHARDS", "mesh", "fail", f"rank {r} (dp rank {d}) planned {recorded} dummy steps but the "
                           f"plan gives {want}: {desc}", ev + [status_ev(run, r, "parallel.dummy_steps_planned")],
                           culprit=r, phase="forward")
        done = s.get("dummy_steps_done")
        finished = s.get("phase") in ("sync", "done")
        if finished and want and done != want:
            return Finding("SHARDS", "mesh", "fail", f"rank {r} (dp rank {d}) ran {done or 0} of its {want} planned "
                           f"dummy steps: its FSDP peers' forwards were left unmatched. {desc}",
                           ev + [status_ev(run, r, "dummy_steps_done")], culprit=r, phase="forward")
    rows = (run.results or {}).get("per_rank") or []
    for row in rows:
        if "dummy_steps" in row and row["dummy_steps"] != plan["dummy_steps"][row["dp_rank"]]:
            r = row["rank"]
            return Finding("SHARDS", "mesh", "fail", f"rank {r} (dp rank {row['dp_rank']}) ran {row['dummy_steps']} "
                           f"dummy steps, the plan gives {plan['dummy_steps'][row['dp_rank']]}: {desc}",
                           ev + [Evidence("results.json", str(row["dummy_steps"]), field="per_rank[].dummy_steps")],
                           culprit=r, phase="forward")
    counts = [shard_batches(n, int(bs), dp, d, aligned) for d in range(dp)]
    empty = [d for d, c in enumerate(counts) if c == 0]
    if empty:
        return Finding("SHARDS", "mesh", "warn", f"{desc}; dp rank(s) {empty} hold no batch (they only run dummy "
                       "steps and the sync): fewer data-parallel ranks would do", ev)
    return Finding("SHARDS", "mesh", "pass", desc + ("; every rank ran its planned dummy steps" if any(plan["dummy_steps"])
                                                     else ""), ev)


def comm_tp_peers(run: Run, probes: dict | None) -> Finding:
    """A tensor-parallel group whose ranks' sample-id or metric-state digests differed at the TP check."""
    if mesh_of(run) is None:
        return Finding("COMM", "tp_peers", "skipped", "no device mesh (dist.parallel not set)")
    for r, s in sorted(run.statuses.items()):
        message = str(((s or {}).get("error") or {}).get("message") or "")
        if _TP_ERROR in message:
            what = ("the data was split by global rank, not by data-parallel rank" if "different samples" in message
                    else "their model outputs differed")
            return Finding("COMM", "tp_peers", "fail", f"rank {r}: {message[:400]} ({what})",
                           [status_ev(run, r, "error.message")], culprit=r, phase="sync")
    check = ((run.results or {}).get("parallel") or {}).get("tp_check")
    if check:
        return Finding("COMM", "tp_peers", "pass", "every TP group's ranks evaluated the same samples into the same "
                       f"metric states (rank 0's digests {check})",
                       [Evidence("results.json", str(check), field="parallel.tp_check")])
    return Finding("COMM", "tp_peers", "skipped", "no TP check recorded (the run did not reach the sync)")


def _where(s: dict) -> str | None:
    """"model" (in a forward of a sharded model), "tp_check", "metric_sync" or None (elsewhere / finished)."""
    op = (s.get("in_collective") or {}).get("op")
    if op == "tp_check":
        return "tp_check"
    if op == "synchronise" or s.get("phase") == "sync":
        return "metric_sync"
    if s.get("phase") == "forward" and (s.get("parallel") or {}).get("model_collectives"):
        return "model"
    return None


def comm_mesh_hang(run: Run, probes: dict | None) -> Finding:
    """Unfinished ranks of a mesh run: stuck in a model collective (FSDP all-gather / TP all-reduce inside a
    forward) or in the metric sync, named as such; a mix means the forwards fell out of lockstep."""
    if mesh_of(run) is None:
        return Finding("COMM", "mesh_hang", "skipped", "no device mesh (dist.parallel not set)")
    if run.results:
        return Finding("COMM", "mesh_hang", "pass", "the run finished (results.json)")
    open_ = {r: s for r, s in run.statuses.items() if s and s.get("phase") not in ("done", "failed")}
    if not open_:
        return Finding("COMM", "mesh_hang", "skipped", "no unfinished rank")
    where = {r: _where(s) for r, s in open_.items()}
    model = sorted(r for r, w in where.items() if w == "model")
    sync = sorted(r for r, w in where.items() if w in ("metric_sync", "tp_check"))
    ev = [status_ev(run, r, f) for r in (model[:2] + sync[:2]) for f in ("phase", "in_collective")]
    stalled = [r for r in model if examine(open_[r], f"ranks/rank{r}/status.json", 1.0).state != "alive"
               or not open_[r].get("t_update")]
    if model and sync:
        r = model[0]
        p = open_[r]
        plan = (p.get("parallel") or {}).get("dummy_steps_planned")
        return Finding("COMM", "mesh_hang", "fail", f"rank(s) {model} wait in a model collective (a forward of the "
                       f"FSDP/TP-sharded model, batch {p.get('batches_done')}, dummy steps {p.get('dummy_steps_done', 0)}"
                       f" of {plan} planned) while rank(s) {sync} are already in the metric sync: the forwards are "
                       "not in lockstep (a rank ran fewer forwards than its dp_shard/tp peers)", ev, culprit=sync[0],
                       phase="forward")
    if sync and not model:
        return Finding("COMM", "mesh_hang", "warn" if len(sync) < len(open_) else "fail",
                       f"rank(s) {sync} wait in the metric sync over the data-parallel group (not in a model "
                       "collective)", ev, phase="sync")
    if model:
        return Finding("COMM", "mesh_hang", "warn" if not stalled else "fail",
                       f"rank(s) {model} are in forwards of the sharded model (model collectives)"
                       + (f"; rank(s) {stalled} stopped updating their records there" if stalled else ""), ev,
                       phase="forward")
    return Finding("COMM", "mesh_hang", "skipped", "no unfinished rank in a forward or the sync")
