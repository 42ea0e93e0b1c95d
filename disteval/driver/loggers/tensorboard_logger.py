"""``logger=tensorboard`` (``pip install disteval[tensorboard]``): results.json's scalars as TensorBoard scalar
events (step 0) with tensorboardX's SummaryWriter, or torch.utils.tensorboard's where only the ``tensorboard``
package is installed. A single run writes RUN_DIR/tensorboard; a sweep SWEEP_DIR/tensorboard/job<N>/ per job and,
at its end, SWEEP_DIR/tensorboard/sweep/ with ``sweep/throughput.images_per_s`` (forward-only throughput),
``sweep/timings.evaluation_s`` and ``sweep/<main metric>`` per job at step = world size, so that
``tensorboard --logdir SWEEP_DIR/tensorboard`` shows them against the world size."""
from __future__ import annotations

from pathlib import Path

from disteval.driver.loggers.base import JobView, TrackerCallback, scalar_metrics
from disteval.job.sweep import main_metric_of

FOLDER = "tensorboard"


def summary_writer(log_dir: Path):
    """A SummaryWriter writing into ``log_dir``: tensorboardX's, else torch.utils.tensorboard's."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        from torch.utils.tensorboard import SummaryWriter
    log_dir.mkdir(parents=True, exist_ok=True)
    return SummaryWriter(str(log_dir))


class TensorboardLogger(TrackerCallback):
    """Hydra callback (conf/logger/tensorboard.yaml). ``log_dir``: the root of the event folders (null: RUN_DIR/
    tensorboard, or SWEEP_DIR/tensorboard for a sweep)."""

    name = "tensorboard"

    def __init__(self, log_dir: str | None = None) -> None:
        super().__init__()
        self.log_dir = log_dir

    def _root(self, base_dir: Path) -> Path:
        return Path(self.log_dir) if self.log_dir else base_dir / FOLDER

    def log_job(self, job: JobView) -> str | None:
        """The job's scalars at step 0; nothing for a job without results.json."""
        if not job.ok:
            return None
        where = self._root(job.base_dir) / (f"job{job.num}" if job.sweep_dir is not None else "")
        writer = summary_writer(where)
        try:
            for key, value in scalar_metrics(job.results).items():
                writer.add_scalar(key, value, 0)
        finally:
            writer.close()
        return str(where)

    def log_sweep(self, sweep_dir: Path, jobs: list[JobView]) -> str | None:
        """Throughput, evaluation time and main metric of each completed job at step = its world size."""
        done = sorted((j for j in jobs if j.ok), key=lambda j: (j.world_size, j.num))
        if not done:
            return None
        where = self._root(sweep_dir) / "sweep"
        writer = summary_writer(where)
        try:
            for job in done:
                scalars = scalar_metrics(job.results)
                main = main_metric_of(job.results)
                for key in ("throughput.images_per_s", "timings.evaluation_s", main):
                    if key is not None and key in scalars:
                        writer.add_scalar(f"sweep/{key}", scalars[key], job.world_size)
        finally:
            writer.close()
        return str(where)
