"""What a task hands the HTML run report (``Task.report_figures``): matplotlib figures and small tables, each
with a title and a caption. Plain containers, so that tasks and the report layer meet here without importing
each other."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReportFigure:
    """One matplotlib ``Figure`` (embedded in the page as a PNG) with its title, caption and a ``key`` that
    names it in the page (``data-figure`` attribute)."""

    key: str
    title: str
    figure: Any
    caption: str = ""


@dataclass
class ReportTable:
    """A small table: column names and rows of cells (numbers or text) with its title and ``key``."""

    key: str
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    caption: str = ""


def new_figure(width: float = 6.0, height: float = 3.6) -> tuple[Any, Any]:
    """A matplotlib (figure, axes) pair on the Agg canvas, without pyplot's global state (safe in any thread)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()
