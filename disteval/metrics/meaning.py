"""What a metric's numbers mean, declared once by each metric class (``Metric.meaning``) and read by everything
that ranks or picks them: the task's main metric (results.json ``task.main_metric``), the keys where lower is
better (``task.lower_is_better``), the sweep summary and the trackers (which number to compare across world
sizes), the checkpoint table (which value is best).

A ``Meaning`` holds regular expressions over the keys of the metric's ``compute()`` result: ``main`` in order of
preference (the first that matches a key present names the main metric), ``lower`` the keys where a smaller value
is better (losses, calibration errors); every other number is better when higher."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

__all__ = ["Meaning", "lower_is_better", "main_metric", "register", "registered"]


@dataclass(frozen=True)
class Meaning:
    """``main``: patterns of main-metric keys, preferred first; ``lower``: patterns of keys where lower is better
    (``re.fullmatch`` on the key); ``precedence``: where a result holds the keys of several metric families (a
    classifier's top1 beside its ranking AUROC), the meaning with the lower precedence names the main metric."""

    main: tuple[str, ...] = ()
    lower: tuple[str, ...] = ()
    precedence: int = 100

    def main_of(self, keys: Iterable[str]) -> str | None:
        """The first key (in the order of ``main``, then of ``keys``) that a main pattern matches, else None."""
        keys = list(keys)
        return next((k for p in self.main for k in keys if re.fullmatch(p, k)), None)

    def lower_of(self, keys: Iterable[str]) -> list[str]:
        """The keys where lower is better."""
        return [k for k in keys if any(re.fullmatch(p, k) for p in self.lower)]


_REGISTRY: dict[str, Meaning] = {}


def register(name: str, meaning: Meaning) -> None:
    """Record a metric class's meaning under its qualified name (``Metric.__init_subclass__`` calls it)."""
    _REGISTRY[name] = meaning


def registered() -> list[Meaning]:
    """Every declared meaning, by precedence (then by the metric class's name)."""
    return [m for _, m in sorted(_REGISTRY.items(), key=lambda kv: (kv[1].precedence, kv[0]))]


def _scalars(metrics: dict) -> list[str]:
    return [k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def main_metric(metrics: dict, meanings: Iterable[Meaning] | None = None) -> str | None:
    """The main metric among the scalar keys of ``metrics`` by the declared meanings (``meanings``; None: every
    registered one, by precedence), or None when no declaration matches."""
    keys = _scalars(metrics)
    for meaning in registered() if meanings is None else meanings:
        key = meaning.main_of(keys)
        if key is not None:
            return key
    return None


def lower_is_better(metrics: dict, meanings: Iterable[Meaning] | None = None) -> list[str]:
    """The scalar keys of ``metrics`` where lower is better by the declared meanings (None: all registered)."""
    keys = _scalars(metrics)
    out: list[str] = []
    for meaning in registered() if meanings is None else meanings:
        out += [k for k in meaning.lower_of(keys) if k not in out]
    return out
