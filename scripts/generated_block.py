"""A generated block of a docs page: the text between a ``BEGIN`` and an ``END`` marker line, read and replaced by
the scripts that draw it from the code (``layout_tree.py``, ``task_table.py``) and checked by tests/test_docs.py."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable


def block(doc: Path, begin: str, end: str) -> str:
    """The text between the markers of ``doc``, stripped. Raises ValueError when a marker is missing."""
    text = doc.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        raise ValueError(f"{doc}: the markers {begin!r} ... {end!r} are missing")
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def main(doc: Path, begin: str, end: str, draw: Callable[[], str]) -> int:
    """A script's entry: print ``draw()``, or with ``--write`` put it between the markers of ``doc``."""
    out = draw()
    if "--write" in sys.argv[1:]:
        text = doc.read_text(encoding="utf-8")
        head, rest = text.split(begin, 1)
        doc.write_text(head + begin + "\n" + out + "\n" + end + rest.split(end, 1)[1], encoding="utf-8")
    else:
        print(out)
    return 0
