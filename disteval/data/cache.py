"""disteval's on-disk cache: ``DISTEVAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/disteval`` or ``~/.cache/disteval``.

A cache file is disposable: it holds what can be computed again (the digits split as scikit-learn builds it,
a shard index). Files are written atomically (a temporary file in the same folder, then ``os.replace``), so a
reader sees the old file or the new one; a file that is corrupt all the same (a disk fault, a copy cut short,
a hand edit) is named, rebuilt and said so (``say``), never a raw ``BadZipFile``."""
from __future__ import annotations

import logging
import os
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

log = logging.getLogger("disteval.rank")  # a rank's log file (RUN_DIR/ranks/rank{r}/log.txt)
READ_ERRORS = (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, zlib.error)


def cache_root() -> Path:
    """The cache folder (it may not exist yet)."""
    return Path(os.environ.get("DISTEVAL_CACHE_DIR") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "disteval")


def read_npz(path: Path, check: Callable[[dict[str, np.ndarray]], str | None]) -> tuple[dict | None, str | None]:
    """``(arrays, None)`` of a valid cache file; ``(None, None)`` when there is none; ``(None, problem)`` when it
    exists but does not load or ``check(arrays)`` names a problem (wrong shapes)."""
    if not path.exists():
        return None, None
    try:
        with np.load(path) as cached:
            arrays = {k: cached[k] for k in cached.files}
    except READ_ERRORS as exc:
        return None, f"{type(exc).__name__}: {exc}"
    problem = check(arrays)
    return (None, problem) if problem else (arrays, None)


def write_npz(path: Path, **arrays: np.ndarray) -> str | None:
    """Write ``arrays`` to ``path`` atomically. Returns None, or what failed (an unwritable cache is skipped:
    the data are computed again next time)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
        return None
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return f"{type(exc).__name__}: {exc}"


def say(message: str, notes: list[str] | None) -> None:
    """A cache event the user should know about: into ``notes`` (the driver's preflight notes: results.json
    ``warnings`` and the console) when given, else the rank's log."""
    if notes is not None:
        notes.append(message)
    else:
        log.warning("%s", message)
