"""``eval.detection.*``: the detection and replay tasks' options (``disteval/tasks/detection.py``)."""
from __future__ import annotations

from dataclasses import dataclass

from disteval.common.closed_sets import IOU_TYPES
from disteval.errors import ConfigError
from disteval.options import task_options

@task_options("detection")
@dataclass
class DetectionOptions:
    """``eval.detection.*`` (the detection and replay tasks, ``disteval/tasks/detection.py``): ``iou_type``,
    ``bbox`` or ``segm`` (pycocotools' iouType; live models: bbox)."""

    iou_type: str = "bbox"

    def validate(self) -> None:
        """Raises ConfigError naming the ``eval.detection.*`` key."""
        if self.iou_type not in IOU_TYPES:
            raise ConfigError("eval.detection.iou_type", f"must be one of {' or '.join(IOU_TYPES)}, got {self.iou_type!r}")
