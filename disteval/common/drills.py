"""State that fault drills set in one module and the records writer reads in another (a leaf, so that both
may import it): a simulated full disk (``DISTEVAL_FAULTS=diskfull@R:batch=K``, see ``disteval.faults``); the
drills' variable's name, which the local launcher hands to each launch's ranks."""
from __future__ import annotations

import threading

ENV = "DISTEVAL_FAULTS"  # the fault drills of a run (``disteval.faults``)

_full = threading.Event()


def simulate_full_disk() -> None:
    """From now on this process's record writes fail with ENOSPC as on a full filesystem, until
    ``free_simulated_disk`` (called when the run's reserve is released, which frees space on a real disk)."""
    _full.set()


def free_simulated_disk() -> None:
    _full.clear()


def disk_simulated_full() -> bool:
    return _full.is_set()
