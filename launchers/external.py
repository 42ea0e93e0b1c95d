"""This process is one rank of a launcher outside disteval: torchrun, srun, or a task of a scheduler's job
that a launcher of ours submitted (its ``export_rank_env`` set the rank variables). The ranks already exist,
with their allocator; rank 0's run directory is agreed on by all."""
from __future__ import annotations

import logging
from typing import Any, Callable

from disteval.errors import DistevalError
from launchers.local import LocalLauncher
from launchers.protocol import Launcher, ProbeRequest


class ExternalLauncher(Launcher):
    """The ranks were started outside disteval (RANK/WORLD_SIZE/MASTER_ADDR in the environment): this process
    runs as its rank (``disteval.comm.external_launch_detected``)."""

    name = "external"

    def start_ranks(self, cfg: Any, job: Any, container: dict, run_dir: str, choice: Any,
                    on_agent_stuck: Callable[[BaseException], None] | None = None) -> None:
        """Run this process's rank (``choice`` is ignored: the rank was started with its allocator). Raises
        DistevalError naming the rank and its error in one line (the traceback is in its status.json)."""
        from disteval.comm import RankEnv
        from disteval.rank.engine import run_rank

        env = RankEnv.from_env()
        if env.world_size != cfg.dist.world_size and env.rank == 0:
            logging.getLogger("disteval").warning("running under an external launcher with WORLD_SIZE=%d "
                                                  "(dist.world_size=%d ignored)", env.world_size, cfg.dist.world_size)
        try:
            run_rank(job, run_dir, env, agree_run_dir=True)
        except Exception as exc:  # noqa: BLE001 - one line per rank; the traceback is in status.json
            raise DistevalError(f"rank {env.rank} failed: {type(exc).__name__}: {exc}") from exc

    def run_probe(self, request: ProbeRequest) -> None:
        """Probes of a run whose ranks an outside launcher started run as local processes on this machine."""
        LocalLauncher().run_probe(request)
