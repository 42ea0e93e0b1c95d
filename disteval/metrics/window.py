"""A window: what one rank added to its evaluator over a run of consecutive batches, self-contained, so
that another run (of any world size) can add it again instead of evaluating those batches (durable
progress, ``disteval.rank.journal``).

A window holds the metric's contribution (``Metric.contribution``: int64 sum-state differences, the new rows
of gather- and local-states), the sample-id runs it covered, the batches as ``[global batch, first id, size]``
and, in bitwise mode, each batch's float partials (the leaves of ``BatchTreeSum``, so float sums stay
independent of who evaluated the batch); with ``eval.record_batches`` also the per-sample output digests.
Adding windows and evaluated batches in the order of their sample ids gives every state exactly what an
uninterrupted run gives: sums add, rows concatenate in order, leaves keep their global batch index.
Pure: no files (``to_tensors``/``from_tensors`` for ``torch.save`` with ``weights_only`` loading).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

SPARSE_MIN = 4096  # states of at least this many elements are stored sparsely when more than half are zeros


@dataclass
class Window:
    """Samples ``[start, end)`` (ids; ``end - start`` of them were evaluated in ``spans``' batches).

    spans: int64 [b, 3] ``(global batch, first sample id, size)`` per batch, in order; runs: int64 [k, 2]
    ``[start, end)`` of the ids covered; states: ``{state: tensor}`` (``Metric.contribution``); leaf_batches
    int64 [m] and leaf_values float64 [m, width]: the float partials of bitwise mode (m = 0 in fast mode or
    without float states); digests int64 [n]: per-sample output digests (empty unless recorded); extras:
    ``{source: rows}`` that other per-sample keepers of the rank added over these batches (``Evaluator.sources``:
    the bootstrap intervals' per-sample rows, the prediction store's rows); skipped int64 [s]: ids the data
    skipped (``data.on_decode_error=skip``), also in ``runs``."""

    start: int
    end: int
    spans: torch.Tensor
    runs: torch.Tensor
    states: dict[str, torch.Tensor]
    leaf_batches: torch.Tensor
    leaf_values: torch.Tensor
    digests: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    skipped: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    @property
    def samples(self) -> int:
        """Samples the window accounts for: evaluated in its batches, and skipped by the data."""
        return (int(self.spans[:, 2].sum()) if self.spans.numel() else 0) + int(self.skipped.numel())

    def to_tensors(self) -> dict:
        """A dict of ints and tensors only (``torch.load(weights_only=True)`` reads it back), with a 63-bit
        BLAKE2b ``digest`` of everything else, checked by ``from_tensors``. A state that is mostly zeros (the
        difference of a 1000 x 1000 confusion matrix over a few batches) is stored as its non-zero entries (integer states):
        ``states["<name>"]`` is then absent and ``sparse["<name>/shape" | "/index" | "/values"]`` hold it."""
        dense, sparse = {}, {}
        for name, t in self.states.items():
            flat = t.reshape(-1)
            exact_zeros = not (t.is_floating_point() or t.is_complex())  # a float's -0.0 would come back +0.0
            index = flat.nonzero().reshape(-1) if exact_zeros and t.numel() >= SPARSE_MIN else None
            if index is not None and 2 * index.numel() < t.numel():
                sparse.update({f"{name}/shape": torch.tensor(t.shape, dtype=torch.int64),
                               f"{name}/index": index, f"{name}/values": flat[index]})
            else:
                dense[name] = t
        body = {"start": int(self.start), "end": int(self.end), "spans": self.spans, "runs": self.runs,
                "states": dense, "leaf_batches": self.leaf_batches, "leaf_values": self.leaf_values,
                "digests": self.digests, "extras": dict(self.extras), "sparse": sparse, "skipped": self.skipped}
        return {**body, "digest": _digest(body)}

    @classmethod
    def from_tensors(cls, data: dict) -> "Window":
        """The window of a ``to_tensors`` dict. Raises ValueError when its digest does not match (a torn or
        altered record: its batches must be evaluated again, never trusted) or a field is missing."""
        try:
            body = {k: data[k] for k in ("start", "end", "spans", "runs", "states", "leaf_batches",
                                         "leaf_values", "digests", "extras")}
            body["sparse"] = data.get("sparse", {})
            body["skipped"] = data.get("skipped", torch.zeros(0, dtype=torch.int64))
            want = int(data["digest"])
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a window record: {exc!r}") from None
        if _digest(body) != want:
            raise ValueError("its digest does not match its contents (torn or altered)")
        sparse, states = body.pop("sparse"), dict(body["states"])
        for key in sparse:
            if key.endswith("/shape"):
                name = key[:-len("/shape")]
                index, values = sparse[f"{name}/index"], sparse[f"{name}/values"]
                t = torch.zeros(int(torch.prod(sparse[key])), dtype=values.dtype)
                t[index] = values
                states[name] = t.reshape(tuple(sparse[key].tolist()))
        body["states"] = states
        return cls(**body)


def _digest(body: dict) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{body['start']}:{body['end']}".encode())
    tensors = [("spans", body["spans"]), ("runs", body["runs"]), ("skipped", body["skipped"]),
               ("leaf_batches", body["leaf_batches"]),
               ("leaf_values", body["leaf_values"]), ("digests", body["digests"]),
               *sorted((f"state:{k}", v) for k, v in body["states"].items()),
               *sorted((f"extra:{k}", v) for k, v in body["extras"].items()),
               *sorted((f"sparse:{k}", v) for k, v in body.get("sparse", {}).items())]
    for name, t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") >> 1
