"""Each task's own options, one module per task, each registering its dataclass under ``eval.<task>`` with
``@task_options("<task>")``. ``disteval.config`` builds ``EvalConfig`` with one node per registered options class,
so a new task with options adds its module here and edits no shared file (docs/extending.md). Every module of
this package is imported when the package is (a leaf layer: it imports only ``disteval.common`` and
``disteval.errors``)."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, TypeVar

T = TypeVar("T")

OPTIONS: dict[str, type] = {}
"""``eval.<name>`` -> the options dataclass (its fields have defaults; ``validate()`` raises ConfigError)."""


def task_options(name: str) -> Callable[[type[T]], type[T]]:
    """Register the decorated dataclass as the options of ``eval.<name>``. Raises ValueError when another class
    holds the name already."""
    def register(cls: type[T]) -> type[T]:
        if name in OPTIONS and OPTIONS[name].__qualname__ != cls.__qualname__:
            raise ValueError(f"eval.{name}: options registered twice ({OPTIONS[name].__qualname__}, {cls.__qualname__})")
        OPTIONS[name] = cls
        return cls
    return register


for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
