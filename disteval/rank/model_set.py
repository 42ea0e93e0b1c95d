"""A job of several checkpoints (``model.checkpoints``) on the engine's side: each network built by the task
from its own file, one step per network on the same batch, one metric per network, and at the end one
results block per checkpoint (``RUN_DIR/checkpoints/<name>/results.json``) and a table.

The metrics of each checkpoint are the bits its own job gives: the loop, the shards, the batches and the
synchronisation are those of a one-checkpoint job, and each network's states are its own
(``disteval.metrics.collection.PerModelMetrics``)."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable

import torch

from disteval.errors import ConfigError
from disteval.rank.loop import LoopHook
from disteval.metrics.collection import PerModelMetrics
from disteval.models.checkpoint_set import Member, ModelSet, expand_checkpoints, with_checkpoint
from disteval.job.records import atomic_write_json
from disteval.tasks.base import Task

RESULTS_DIR = "checkpoints"


def members_of(cfg: Any, comm: Any = None) -> list[Member]:
    """The checkpoint set of the job (``model.checkpoints`` expanded), [] for a one-model job. With ``comm`` (a
    ``disteval.comm.Communicator`` of W > 1 ranks) every rank takes rank 0's expansion (one broadcast): ranks on
    nodes whose filesystems differ evaluate the same files in the same order, and a rank that cannot see one of
    them raises ConfigError naming it, its rank and host (no rank globs a set of its own)."""
    if not cfg.model.checkpoints:
        return []
    if comm is None or comm.world_size == 1:
        return expand_checkpoints(cfg.model.checkpoints)
    mine = expand_checkpoints(cfg.model.checkpoints) if comm.rank == 0 else None
    agreed = comm.broadcast_json({"members": [[m.name, m.path] for m in mine]} if mine is not None else None)
    members = [Member(name, path) for name, path in agreed["members"]]
    missing = [m.path for m in members if not os.path.isfile(m.path)]
    if missing:
        raise ConfigError("model.checkpoints", f"rank {comm.rank} on host {socket.gethostname()} cannot see "
                          f"{len(missing)} of rank 0's {len(members)} checkpoint files: {missing[:3]} (nodes must "
                          "share the files, at the same paths)")
    return members


def build_models(task: Task, members: list[Member], device: torch.device,
                 prepare: Callable[[torch.nn.Module], torch.nn.Module]) -> ModelSet:
    """Each member's network as the task builds it from the job config with ``model.checkpoint`` set to the
    member's file, passed through ``prepare`` (channels-last, compile), in a ``ModelSet``. Raises ConfigError
    for a task without a model (replayed predictions) and what ``Task.model`` raises (CheckpointError naming
    the file)."""
    base, models = task.cfg, {}
    for m in members:
        task.cfg = with_checkpoint(base, m.path)
        try:
            net = task.model(device)
        finally:
            task.cfg = base
        if net is None:
            raise ConfigError("model.checkpoints", f"task {task.name} evaluates saved predictions, not a model")
        models[m.name] = prepare(net)
    return ModelSet(models)


def member_step(step: Callable[[Any, Any], Any]) -> Callable[[ModelSet, Any], tuple]:
    """The engine's per-batch ``step(model, inputs)`` applied to each network of the set, in order: a tuple
    of outputs for ``PerModelMetrics``."""
    return lambda models, inputs: tuple(step(net, inputs) for net in models.members.values())


class MemberHooks(LoopHook):
    """One loop hook per member (the prediction store, the per-sample rows of the intervals), each given its
    member's outputs of the batch (``member_step``'s tuple, in order); ``hooks`` {name: hook}."""

    def __init__(self, hooks: dict[str, LoopHook]):
        self.hooks = hooks

    def after_outputs(self, outputs: Any, targets: Any, ids: torch.Tensor) -> None:
        for hook, out in zip(self.hooks.values(), outputs):
            hook.after_outputs(out, targets, ids)

    def after_loop(self, progress: Any) -> None:
        for hook in self.hooks.values():
            hook.after_loop(progress)

    @property
    def entry(self) -> dict:
        """{name: the member's store entry} (``PredictionHook.entry``) for the synchronised rows."""
        return {name: hook.entry for name, hook in self.hooks.items()}


def member_dir(run_dir: str | Path, member: Member) -> Path:
    """``RUN_DIR/checkpoints/<name>``: where a member's results.json and prediction store go."""
    return Path(run_dir) / RESULTS_DIR / member.name


def member_metrics(task: Task, members: list[Member]) -> PerModelMetrics:
    """A fresh metric of the task for each member, by member name."""
    return PerModelMetrics({m.name: task.metric() for m in members})


def write_member_results(results: dict, members: list[Member], digests: dict[str, str | None]) -> list[dict]:
    """One results.json per member under ``RUN_DIR/checkpoints/<name>/`` (atomic): the job's record with that
    member's metrics and checkpoint, so that ``diagnostics compare`` and ``sweep`` read it as a one-checkpoint
    run (``checkpoint_set`` names the job it shared). Returns the job's ``checkpoints`` blocks [{name, path,
    weights_digest, metrics, results}] in the order listed, each with its record under ``own`` (for the
    console; drop it before writing the job's results.json, whose ``metrics`` stay ``{name: metrics}``)."""
    run_dir, blocks = Path(results["run_dir"]), []
    for m in members:
        rel = Path(RESULTS_DIR) / m.name / "results.json"
        per = {k: results[k][m.name] for k in ("predictions", "confidence_intervals") if results.get(k)}
        own = dict(results, metrics=results["metrics"][m.name], **per,
                   model=dict(results["model"], checkpoint=m.path, member=m.name, weights_digest=digests.get(m.name)),
                   checkpoint_set={"job": "../../results.json", "members": [x.name for x in members]})
        atomic_write_json(run_dir / rel, own)
        blocks.append({"name": m.name, "path": m.path, "weights_digest": digests.get(m.name),
                       "metrics": results["metrics"][m.name], "results": str(rel), "own": own, **per})
    return blocks
