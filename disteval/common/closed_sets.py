"""The closed sets of names that several layers check, spelled once: the config's schema, the metrics, the data
readers and the comm layer derive theirs from here.

``IOU_TYPES``: pycocotools' iouType values the detection task evaluates (``eval.detection.iou_type``; keypoints
are their own task). ``COMPRESSION_MODES``: how gathered states travel (``communication.compression``;
``disteval.comm.compression``): none, lossless (exact: float32 values that are small integers or whose range
allows it), fp16 or bf16 (lossy, bounded error)."""
from __future__ import annotations

IOU_TYPES = ("bbox", "segm")
COMPRESSION_MODES = ("none", "lossless", "fp16", "bf16")
