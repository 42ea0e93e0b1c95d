"""Collecting the problems of independent checks, so that one try reports them all (``PreflightProblems``)."""
from __future__ import annotations

import contextlib
from typing import Iterator

from disteval.errors import DistevalError, PreflightProblems


class Problems:
    """The DistevalErrors of independent checks, in the order found, each once (by message).

    ``with problems.check(): ...`` runs one check and keeps its DistevalError (the problems of a nested
    ``PreflightProblems`` one by one); any other exception propagates. ``raise_any()`` raises the one problem
    as it was, several as one ``PreflightProblems``, nothing when there is none."""

    def __init__(self) -> None:
        self.errors: list[DistevalError] = []

    def __bool__(self) -> bool:
        return bool(self.errors)

    def add(self, exc: DistevalError) -> None:
        for one in exc.problems if isinstance(exc, PreflightProblems) else [exc]:
            if str(one) not in {str(e) for e in self.errors}:
                self.errors.append(one)

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except DistevalError as exc:
            self.add(exc)

    def raise_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise PreflightProblems(self.errors)
