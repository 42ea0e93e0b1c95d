"""Local launcher: ``dist.world_size`` ranks on this machine through torch.distributed.elastic's launch API
(torchrun's engine, c10d rendezvous on a free port). When a rank raises or dies the agent stops every rank;
the driver then names the culprit from the status records (see launchers.culprit) and raises
RankFailedError. No process outlives ``launch_local``.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, Callable

from disteval.errors import RankFailedError, RunInterrupted
from launchers.culprit import find_culprit


def _death(failure) -> str:
    code = getattr(failure, "exitcode", None)
    try:
        name = failure.signal_name()
    except Exception:  # noqa: BLE001 - defensive across torch versions
        name = None
    if code is not None and code < 0 and name and name != "<N/A>":
        return f"was killed by {name}"
    message = str(getattr(failure, "message", "") or "")
    if message and not message.startswith(("<", "To enable traceback")):
        return f"exited with code {code} ({message.strip().splitlines()[-1][:300]})"
    return f"exited with code {code}"


def launch(entry: Callable[..., Any], args: tuple, world_size: int, run_dir: str,
           master_addr: str = "127.0.0.1", master_port: int = 0) -> dict[int, Any]:
    """Run ``entry(*args)`` in ``world_size`` local ranks (env:// variables set) and wait for all of them.

    ``entry`` must be importable (spawn start method) and should record its errors in
    RUN_DIR/ranks/rank{r}/status.json (as ``disteval.engine.run_rank`` does). Returns {rank: return value}.
    Raises RankFailedError naming the culprit rank and its own error when any rank fails.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=f"disteval-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d", rdzv_endpoint=f"{master_addr}:{master_port}", max_restarts=0,
        monitor_interval=0.1, start_method="spawn", shutdown_timeout=10)
    try:
        return elastic_launch(config, entry)(*args)
    except ChildFailedError as exc:
        deaths = {int(rank): _death(f) for rank, f in exc.failures.items()}
        culprit = find_culprit(run_dir, world_size, deaths)
        raise RankFailedError(culprit.rank, culprit.message, deaths) from None
    except SignalException as exc:  # the agent stopped every worker before re-raising
        raise RunInterrupted(getattr(exc.sigval, "name", str(exc.sigval))) from None


def launch_local(cfg_container: dict, run_dir: str, world_size: int, master_addr: str = "127.0.0.1",
                 master_port: int = 0) -> None:
    """Start ``world_size`` ranks of ``python -m disteval``'s job (``disteval.engine.worker_entry``) and wait.

    Raises RankFailedError naming the first failing rank and its own error when any rank fails.
    """
    from disteval.engine import worker_entry

    launch(worker_entry, (cfg_container, run_dir), world_size, run_dir, master_addr, master_port)
