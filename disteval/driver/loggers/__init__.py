"""Experiment trackers (``logger=none|csv|mlflow|tensorboard|wandb``, several as ``logger=[csv,mlflow]``).

Each tracker is a Hydra callback (conf/logger/*.yaml adds it to ``hydra.callbacks``) that runs in the driver after
a job has ended (``on_job_end``) and after a sweep (``on_multirun_end``), never in the ranks: it reads what the job
left in its run directory (results.json, .hydra/config.yaml, report.html when present) and logs it. A tracker
whose package is missing is a configuration error naming the extra (exit code 2, before any rank starts); a
tracker that fails at the end (an unwritable folder, a tracking server that does not answer) prints a warning and
is recorded in results.json ``tracker_warnings``; the job's results and exit code are unchanged. Where each
tracker logged is recorded in results.json ``trackers`` {name: location} and returned by ``locations()``
(this process) and ``tracker_locations(RUN_DIR)`` (any run); ``trackers_line`` formats them as one console line.

Modules: ``disteval.driver.loggers.base`` (the callback base class and the records), ``csv_logger``, ``mlflow_logger``,
``tensorboard_logger``, ``wandb_logger``. See docs/loggers.md.
"""
from __future__ import annotations

from disteval.driver.loggers.base import (EXTRAS, JobView, TrackerCallback, locations, scalar_metrics, tracker_locations,
                                   tracker_warnings, trackers_line)

__all__ = ["EXTRAS", "JobView", "TrackerCallback", "locations", "scalar_metrics", "tracker_locations",
           "tracker_warnings", "trackers_line"]
