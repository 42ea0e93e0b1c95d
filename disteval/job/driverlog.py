"""The driver's account of a run: each start-up step, the launch and the outcome as one line on stderr
(``disteval: [T s] ...``, T = seconds since the job's start) and in the driver's log, RUN_DIR/disteval.log
(the file of Hydra's job logging, where the ``disteval`` logger propagates). Hydra's console handler is
kept from printing these records a second time."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from disteval.common import startup

log = logging.getLogger("disteval")
_FILE_ONLY = "disteval_file_only"  # a log record attribute: the line is already on the console


class _NotFileOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, _FILE_ONLY, False)


_FILTER = _NotFileOnly()


def _keep_off_console() -> None:
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                and _FILTER not in handler.filters:
            handler.addFilter(_FILTER)


def to_file(logger: logging.Logger, level: int, message: str) -> None:
    """Write ``message`` to the driver's log only: the console shows it once, printed by whoever reports the
    outcome (a refused scheduler job: its launcher's final line)."""
    _keep_off_console()
    logger.log(level, message, extra={_FILE_ONLY: True})


def step(message: str, level: int = logging.INFO) -> None:
    """Print ``message`` as a progress line on stderr and write it to the driver's log (file handlers only);
    only on the reporting process (not on ranks other than 0 under an external launcher)."""
    if not startup.reporting():
        return
    startup.progress(message)
    _keep_off_console()
    log.log(level, message, extra={_FILE_ONLY: True})


def composed(cfg: Any, external: bool) -> str:
    """The step after composing: what the job evaluates, at which world size, and what is checked next."""
    world = int(os.environ.get("WORLD_SIZE", cfg.dist.world_size)) if external else int(cfg.dist.world_size)
    return (f"config composed: {cfg.model.name} on {cfg.data.name}, world size {world}; checking data, model "
            "and settings")


def launching(external: bool, world_size: int, allocator: Any = None, nnodes: int = 1) -> str:
    """The step before the ranks run: how they start (``allocator``: the ranks' ``AllocatorChoice``; at world
    size 1 one that changes the environment needs a rank process of its own; ``nnodes`` > 1: this node's share
    of a multi-node launch)."""
    if nnodes > 1:
        malloc = f", malloc {allocator.name}" if allocator is not None and allocator.changes_env else ""
        return (f"checks passed; starting this node's {world_size // nnodes} of {world_size} ranks ({nnodes} nodes"
                f"{malloc}); they join once every node has reached the rendezvous")
    if external:
        return "checks passed; joining the external launcher's process group"
    if world_size == 1 and not (allocator is not None and allocator.changes_env):
        return "checks passed; evaluating in this process (world size 1)"
    malloc = f", malloc {allocator.name}" if allocator is not None and allocator.changes_env else ""
    return (f"checks passed; starting {world_size} local rank{'s' if world_size > 1 else ''}{malloc} (forks of "
            "one process that imports torch once; then they join the process group)")


def _timings(run_dir: str) -> dict:
    try:
        return json.loads((Path(run_dir) / "results.json").read_text()).get("timings") or {}
    except (OSError, ValueError):
        return {}


def finished(run_dir: str, code: int) -> None:
    """The outcome line: exit code, the whole run's seconds so far and the evaluation's (results.json
    ``timings.evaluation_s``), and where the results and the driver's log are."""
    took = startup.seconds_since_start()
    took_text = "" if took is None else f" in {took:.1f} s"
    driver_log = next((h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)),
                      Path(run_dir) / "disteval.log")  # a node that does not lead: RUN_DIR/nodes/<host>/
    if code == 0:
        evaluation = _timings(run_dir).get("evaluation_s")
        ev_text = "" if evaluation is None else f" (evaluation {evaluation:.2f} s)"
        step(f"done{took_text}{ev_text}; results: {Path(run_dir) / 'results.json'}; driver log: {driver_log}")
        return
    what = {2: "stopped before any rank started (configuration error)", 130: "interrupted", 143: "interrupted"}.get(
        code, "run failed")
    step(f"{what}{took_text}, exit code {code}; records: {run_dir}; driver log: {driver_log}", logging.ERROR)
