"""AGGREGATION LAYER: metric states, merge and compute. Pure: nothing here imports torch.distributed."""
from disteval.metrics.base import Metric
from disteval.metrics.classification import ClassificationMetrics
from disteval.metrics.collection import MetricCollection
from disteval.metrics.ranking import RankingMetrics
from disteval.metrics.coverage import CoverageReport, SampleIdCoverage, check_coverage, raise_if_incomplete


__all__ = ["Metric", "ClassificationMetrics", "MetricCollection", "RankingMetrics", "SampleIdCoverage", "CoverageReport", "check_coverage",
           "raise_if_incomplete"]
