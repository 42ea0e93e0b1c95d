"""``eval.segmentation.*``: semantic segmentation's options (``disteval/tasks/segmentation.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from disteval.errors import ConfigError
from disteval.options import task_options

@task_options("segmentation")
@dataclass
class SegmentationOptions:
    """``eval.segmentation.*`` (semantic segmentation, ``disteval/tasks/segmentation.py``): ``ignore_index``, the
    label value left out of every count (default 255, VOC's boundary; null: none)."""

    ignore_index: Optional[int] = 255

    def validate(self) -> None:
        """Raises ConfigError naming the ``eval.segmentation.*`` key."""
        if self.ignore_index is not None and self.ignore_index < 0:
            raise ConfigError("eval.segmentation.ignore_index",
                              f"must be a label value >= 0 or null, got {self.ignore_index}")
