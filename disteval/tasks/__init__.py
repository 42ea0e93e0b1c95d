"""TASKS: one module per task family (classification, detection + replay, segmentation + replay, embedding,
keypoints + replay). A Task turns the config into a
dataset, a model or prediction source, a metric, a per-batch step and a console section; the engine knows
no task by name (``disteval.tasks.base``)."""
from disteval.tasks.base import Task, register_task, registered_tasks, resolve_task
from disteval.tasks.classification import ClassificationTask
from disteval.tasks.detection import CocoDetectionTask, CocoReplayTask
from disteval.tasks.segmentation import SegmentationReplayTask, SegmentationTask
from disteval.tasks.embedding import EmbeddingTask
from disteval.tasks.keypoints import KeypointReplayTask, KeypointTask

__all__ = ["Task", "register_task", "registered_tasks", "resolve_task", "ClassificationTask", "CocoDetectionTask",
           "CocoReplayTask", "SegmentationTask", "SegmentationReplayTask", "EmbeddingTask",
           "KeypointTask", "KeypointReplayTask"]
