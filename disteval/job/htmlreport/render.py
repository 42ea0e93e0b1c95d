"""Shared by the three pages: the jinja2 environment over the package's templates, figures as data: URIs and the
atomic write of a page."""
from __future__ import annotations

import base64
import io
import os
import time
from pathlib import Path
from typing import Any

from disteval.common.figures import ReportFigure, ReportTable


def environment():
    """The jinja2 environment (autoescaped) over ``disteval/job/htmlreport/templates``, with the ``num`` filter."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("disteval.job.htmlreport", "templates"),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = num
    env.filters["when"] = when
    return env


def num(value: Any, digits: int = 4) -> str:
    """A number as the page shows it: ints with thousands separators, floats with ``digits`` decimals (small
    ones in scientific notation), None as an en dash."""
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value != 0 and abs(value) < 10 ** -digits:
        return f"{value:.2e}"
    return f"{value:,.{digits}f}"


def when(epoch: float | None) -> str:
    """A Unix time as local date and time, or an en dash."""
    return "–" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(epoch)))


def png_uri(figure: Any, dpi: int = 100) -> str:
    """A matplotlib figure as a ``data:image/png;base64,...`` URI (the page needs no other file)."""
    buf = io.BytesIO()
    figure.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def items(figures: list) -> list[dict]:
    """Task figures and tables as template items: {kind, key, title, caption, src | columns + rows}."""
    out = []
    for f in figures:
        if isinstance(f, ReportFigure):
            out.append({"kind": "figure", "key": f.key, "title": f.title, "caption": f.caption, "src": png_uri(f.figure)})
        elif isinstance(f, ReportTable):
            out.append({"kind": "table", "key": f.key, "title": f.title, "caption": f.caption, "columns": f.columns,
                        "rows": f.rows})
    return out


def write_page(path: Path, template: str, context: dict) -> Path:
    """Render ``template`` with ``context`` and write it to ``path`` atomically (a temporary file renamed over it).
    Returns ``path``."""
    text = environment().get_template(template).render(**context)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_json(path: Path) -> dict | None:
    """A JSON record, or None when it is missing or unreadable (a report shows what exists)."""
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
