"""What a metric's numbers mean is declared once, by each metric class (``Metric.meaning``,
disteval/metrics/meaning.py), and read by the task's main metric, results.json ``task.lower_is_better`` and the
checkpoint table's choice of the best value."""
from __future__ import annotations

import importlib
import inspect
import io
import pkgutil

from rich.console import Console

import disteval.metrics
from disteval.metrics import meaning
from disteval.metrics.base import Metric
from disteval.metrics.collection import MetricCollection


def _concrete_metric_classes() -> list[type]:
    for mod in pkgutil.iter_modules(disteval.metrics.__path__):
        importlib.import_module(f"disteval.metrics.{mod.name}")
    out, todo = [], list(Metric.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if not inspect.isabstract(cls) and not issubclass(cls, MetricCollection) and cls.__module__.startswith("disteval."):
            out.append(cls)
    return out


def test_every_metric_class_declares_its_meaning():
    """Every concrete metric (collections hold metrics that do) declares ``meaning``."""
    classes = _concrete_metric_classes()
    assert len(classes) >= 6
    missing = [c.__qualname__ for c in classes if "meaning" not in c.__dict__]
    assert not missing, missing


def test_main_metric_and_lower_is_better_follow_the_declarations():
    _concrete_metric_classes()
    # the results of each task family (keys as their compute() writes them) and the number that states each
    cases = [({"num_samples": 10, "top1": 0.5, "top5": 0.9, "accuracy": 0.5, "nll": 1.2, "ece": 0.1,
               "auroc_macro": 0.7, "ap_macro": 0.6}, "top1", ["nll", "ece"]),
             ({"auroc_macro": 0.7, "ap_macro": 0.6}, "auroc_macro", []),
             ({"AP": 0.4, "AP50": 0.6, "AP75": 0.4}, "AP", []),
             ({"mIoU": 0.6, "mIoU_per_image": 0.55, "pixel_accuracy": 0.9}, "mIoU", []),
             ({"recall@1": 0.3, "knn_majority_k20_top1": 0.8}, "knn_majority_k20_top1", []),
             ({"recall@1": 0.3, "recall@5": 0.6}, "recall@1", []),
             ({"num_samples": 3}, None, [])]
    for metrics, main, lower in cases:
        assert (meaning.main_metric(metrics), meaning.lower_is_better(metrics)) == (main, lower), metrics


def test_the_checkpoint_table_bolds_the_smallest_where_lower_is_better():
    from disteval.job.report import present

    def section_of(m: dict) -> tuple:  # the base Task's console rows: one per scalar, labelled by its key
        return [(k, f"{v:.4f}") for k, v in m.items() if isinstance(v, float)], [], []

    blocks = [{"name": "a", "metrics": {"top1": 0.5, "nll": 1.25}}, {"name": "b", "metrics": {"top1": 0.75, "nll": 0.5}},
              {"name": "c", "metrics": {"top1": 0.25, "nll": 2.0}}]
    results = {"checkpoints": blocks, "metrics": {}, "task": {"main_metric": "top1", "lower_is_better": ["nll"]},
               "world_size": 1, "timings": {"total": 1.0}, "throughput": {"images_per_s": None}}
    out = io.StringIO()
    try:
        present(results, section_of, Console(file=out, width=200, force_terminal=True, color_system="standard"))
    except (KeyError, TypeError):
        pass  # the job's own lines need more of results.json; the table is printed first
    text = out.getvalue()
    bold = "\x1b[1m"
    assert f"{bold}0.7500" in text and f"{bold}0.5000" in text, text  # top1: the largest; nll: the smallest
    assert f"{bold}1.2500" not in text and f"{bold}2.0000" not in text and f"{bold}0.2500" not in text
