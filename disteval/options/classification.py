"""``eval.classification.*``: the classification task's options (``disteval/tasks/classification.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from disteval.common.checks import at_least
from disteval.errors import ConfigError
from disteval.options import task_options

@task_options("classification")
@dataclass
class ClassificationOptions:
    """``eval.classification.*`` (the classification task, ``disteval/tasks/classification.py``; also the
    classification metrics of an embedding run and the bootstrap's columns): ``topk``, the k of top-k accuracy
    (each in [1, C]; the task checks C); ``ece_bins``, the equal-width confidence bins of the expected calibration
    error (Guo et al. 2017)."""

    topk: List[int] = field(default_factory=lambda: [1, 5])
    ece_bins: int = 15

    def validate(self) -> None:
        """Raises ConfigError naming the ``eval.classification.*`` key."""
        if not self.topk or any(k < 1 for k in self.topk):
            raise ConfigError("eval.classification.topk", f"needs positive integers, got {list(self.topk)}")
        at_least("eval.classification.ece_bins", self.ece_bins, 1)
