"""``logger=wandb`` (``pip install disteval[wandb]``): one Weights & Biases run per job, **offline** unless
configured otherwise (``hydra.callbacks.wandb.mode``, else $WANDB_MODE, else ``offline``): nothing leaves the
machine; ``wandb sync DIR/wandb/offline-run-*`` uploads a run later. The run's config is the resolved job config
(dotted keys), its summary results.json's scalars and per-class lists, its tags mode / world size / task, and
results.json (and report.html when present) are saved with it. A sweep's jobs share the group ``<sweep dir>``.
The runs go to DIR/wandb/ (``hydra.callbacks.wandb.dir``, else the run directory, or the sweep directory)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from disteval.driver.loggers.base import JobView, TrackerCallback, per_class, scalar_metrics


class WandbLogger(TrackerCallback):
    """Hydra callback (conf/logger/wandb.yaml): ``mode`` (offline | online | disabled; null: $WANDB_MODE or
    offline), ``project``, ``entity``, ``dir`` (see the module docstring)."""

    name = "wandb"

    def __init__(self, mode: str | None = None, project: str = "disteval", entity: str | None = None,
                 dir: str | None = None) -> None:  # noqa: A002 - wandb.init's own name for it
        super().__init__()
        self.mode, self.project, self.entity, self.dir = mode, project, entity, dir

    def log_job(self, job: JobView) -> str | None:
        """One run: config, summary, tags, files; nothing for a job without results.json."""
        if not job.ok:
            return None
        import wandb

        mode = self.mode or os.environ.get("WANDB_MODE") or "offline"
        base = Path(self.dir) if self.dir else job.base_dir
        base.mkdir(parents=True, exist_ok=True)
        tags = job.tags()
        run = wandb.init(mode=mode, project=self.project, entity=self.entity, dir=str(base), name=job.name,
                         group=str(job.sweep_dir) if job.sweep_dir is not None else None, job_type="eval",
                         config=job.params, tags=[f"{k}={tags[k]}" for k in ("mode", "world_size", "task") if k in tags],
                         reinit="create_new", settings=wandb.Settings(silent=True, console="off"))
        try:
            run.summary.update({**scalar_metrics(job.results), **per_class(job.results)})
            for name in ("results.json", "report.html"):
                if (job.run_dir / name).is_file():
                    shutil.copy2(job.run_dir / name, Path(run.dir) / name)  # the run's files, synced with it
        finally:
            run.finish()
        return str(Path(run.dir).parent)
