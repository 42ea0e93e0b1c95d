"""What one rank accumulates while it evaluates: the metric's states, the sample-id coverage, and in the
default bitwise mode the per-batch float partials in a ``BatchTreeSum`` (so float statistics do not depend
on the world size), plus optionally a per-batch record (output digests and float partials) for
``python -m diagnostics compare``. Pure: synchronising it is ``disteval.rank.sync``'s job."""
from __future__ import annotations

import array
import contextlib
from typing import Any, Iterator

import torch

from disteval.common.digest import outputs_digest
from disteval.errors import DataError
from disteval.metrics.base import Metric
from disteval.metrics.coverage import SampleIdCoverage
from disteval.metrics.ordered_sum import BatchTreeSum
from disteval.metrics.window import Window


class Evaluator:
    """A metric with its coverage, order-independent float sums and an optional batch log.

    Args:
        metric: the task's Metric (float64 sum-states updated in place).
        bitwise: fold each batch's float64 sum-state partials into a BatchTreeSum keyed by global batch index
            (``eval.mode=bitwise``); False keeps plain running sums (``fast``).
        record_batches: keep per batch ``[index, first id, size]``, the per-sample output digests and the
            float partials (``batch_log()``), for ``diagnostics compare``.
    """

    def __init__(self, metric: Metric, bitwise: bool = True, record_batches: bool = False):
        self.metric, self.bitwise, self.record_batches = metric, bitwise, record_batches
        self.coverage = SampleIdCoverage()
        names = metric.float_sum_states()
        if bitwise and any(bool(v.any()) for v in names.values()):
            raise ValueError("the metric already holds float sums: build the Evaluator before the first update "
                             "(bitwise mode folds float partials per batch)")
        self.float_names = list(names)
        self.float_shapes = [tuple(v.shape) for v in names.values()]
        self.tree = BatchTreeSum(sum(v.numel() for v in names.values())) if bitwise else None
        self._spans = array.array("q")  # (global batch, first sample id, size) per batch, flat
        self._digests: list[torch.Tensor] = []
        self._partials: list[torch.Tensor] = []
        # windows (disteval.metrics.window): where the open one began, and recorded ones to add in id order
        self.windows = False  # keep what take_window needs (the journal turns it on)
        self._mark: dict | None = None
        self._mark_at = (0, 0, 0)  # lengths of _spans, _digests and _skipped at the mark
        self._ends = array.array("q")  # per batch: its last sample id + 1 (ids need not be consecutive: skips)
        self._skipped = array.array("q")  # ids skipped by the data (``skip``) while windows are kept
        self.skipped_recorded: list[int] = []  # ids the added windows had skipped
        self._leaves: list[tuple[int, torch.Tensor]] = []
        self._replay: list[Window] = []
        self.closed: list[Window] = []  # windows closed because a recorded one was added after them
        # other per-sample keepers whose rows windows carry: {name: source with mark() -> m, since(m) -> tensor,
        # add(tensor)}, rows appended per batch after the evaluator's (the intervals' SampleStatsHook)
        self.sources: dict[str, Any] = {}
        self._source_marks: dict[str, Any] = {}
        self.replayed = {"windows": 0, "samples": 0}

    def process(self, batch_index: int, outputs: Any, targets: torch.Tensor, sample_ids: torch.Tensor) -> None:
        """Add one batch (global batch ``batch_index``): metric update, coverage, float fold, batch log.
        Recorded windows scheduled before its first sample id are added first (``schedule``). Raises what
        ``metric.update`` raises (DataError naming the sample)."""
        n = int(sample_ids.numel())  # sample ids stay on the host: no device access
        first = int(sample_ids[0]) if n else -1
        if self._replay and n:
            self._add_recorded(until=first)
        if self.windows and self._mark is None:
            self._open_window()
        self.metric.update(outputs, targets, sample_ids)
        self.coverage.update(sample_ids)
        self._spans.extend((int(batch_index), first, n))
        if self.windows:
            self._ends.append(int(sample_ids[-1]) + 1 if n else first)
        partial = self._fold(batch_index) if self.tree is not None else None
        if partial is not None and self.windows:
            self._leaves.append((int(batch_index), partial))
        if self.record_batches:
            self._digests.append(outputs_digest(outputs, n))
            if partial is not None:
                self._partials.append(partial)

    def skip(self, sample_ids: torch.Tensor) -> None:
        """Samples the data skipped (streamed shards, ``data.on_decode_error=skip``): counted in the coverage
        and, with windows kept, carried by the next window taken."""
        if not sample_ids.numel():
            return
        if self._replay:  # recorded windows before these ids first (a window never mixes them)
            self._add_recorded(until=int(sample_ids.min()))
        self.coverage.update(sample_ids)
        if self.windows:
            if self._mark is None:
                self._open_window()
            self._skipped.extend(int(i) for i in sample_ids)

    def _open_window(self) -> None:
        with self._batch_named():
            self._mark = self.metric.mark()
        self._mark_at = (len(self._spans), len(self._digests), len(self._skipped))
        del self._ends[:]
        self._leaves = []
        self._source_marks = {name: src.mark() for name, src in self.sources.items()}

    def take_window(self) -> Window | None:
        """Close the open window (the batches processed and the ids skipped since the last one) and return it,
        None when it holds neither. The next ``process`` opens the next window. Raises what
        ``Metric.raise_deferred`` raises."""
        if self._mark is None or (len(self._spans) == self._mark_at[0] and len(self._skipped) == self._mark_at[2]):
            return None
        spans = torch.tensor(self._spans[self._mark_at[0]:], dtype=torch.int64).reshape(-1, 3)
        skipped = torch.tensor(self._skipped[self._mark_at[2]:], dtype=torch.int64)
        runs = _merged([(int(a), int(b)) for a, b in zip(spans[:, 1].tolist(), self._ends) if a < b] +
                       [(i, i + 1) for i in skipped.tolist()])
        width = self.tree.width if self.tree is not None else 0
        leaves = self._leaves
        with self._batch_named():
            states = self.metric.contribution(self._mark)
        window = Window(
            start=int(runs[0, 0]), end=int(runs[-1, 1]), spans=spans, runs=runs,
            states=states,
            leaf_batches=torch.tensor([b for b, _ in leaves], dtype=torch.int64),
            leaf_values=torch.stack([v.detach().cpu() for _, v in leaves]) if leaves else
            torch.zeros(0, width, dtype=torch.float64),
            digests=torch.cat([d.cpu() for d in self._digests[self._mark_at[1]:]]) if self.record_batches and
            len(self._digests) > self._mark_at[1] else torch.zeros(0, dtype=torch.int64),
            extras={name: src.since(self._source_marks[name]) for name, src in self.sources.items()},
            skipped=skipped)
        self._mark = None
        return window

    def schedule(self, windows: list[Window]) -> None:
        """Recorded windows of other runs to add in place of evaluating their batches: each is added just
        before the first processed batch that comes after it in sample-id order, the rest at ``finish_local``.
        Raises ValueError for overlapping windows or a window of float partials of another width."""
        windows = sorted(windows, key=lambda w: w.start)
        for a, b in zip(windows, windows[1:]):
            if b.start < a.end:
                raise ValueError(f"recorded windows [{a.start}, {a.end}) and [{b.start}, {b.end}) overlap")
        width = self.tree.width if self.tree is not None else 0
        names = set(self.metric.specs())
        for w in windows:
            if set(w.states) != names:
                raise ValueError(f"window [{w.start}, {w.end}) holds the states {sorted(set(w.states) ^ names)} "
                                 "this metric does not, or lacks them (another metric set)")
            missing = sorted(set(self.sources) - set(w.extras))
            if missing:
                raise ValueError(f"window [{w.start}, {w.end}) holds no rows of {missing}")
            if w.leaf_values.numel() and w.leaf_values.shape[1] != width:
                raise ValueError(f"window [{w.start}, {w.end}): float partials of width {w.leaf_values.shape[1]}, "
                                 f"this metric has {width}")
        self._replay = windows

    def _add_recorded(self, until: int | None) -> None:
        """Add the scheduled windows that start before sample id ``until`` (all of them for None), after
        closing the open window (kept in ``closed``: a window never mixes evaluated and recorded batches)."""
        due = [w for w in self._replay if until is None or w.start < until]
        if not due:
            return
        if self.windows:
            open_window = self.take_window()
            if open_window is not None:
                self.closed.append(open_window)
        self._replay = self._replay[len(due):]
        for w in due:
            self.metric.add_contribution(w.states)
            self.coverage.update_runs(w.runs)  # the ids it evaluated and those it skipped
            self.skipped_recorded.extend(int(i) for i in w.skipped.tolist())
            self._spans.extend(int(x) for x in w.spans.reshape(-1).tolist())
            if self.tree is not None:
                for b, v in zip(w.leaf_batches.tolist(), w.leaf_values):
                    self.tree.add(int(b), v.to(torch.float64))
                    if self.record_batches:
                        self._partials.append(v)
            if self.record_batches:
                self._digests.append(w.digests)
            for name, src in self.sources.items():
                src.add(w.extras[name])
            self.replayed["windows"] += 1
            self.replayed["samples"] += w.samples

    def _fold(self, batch_index: int) -> torch.Tensor | None:
        floats = self.metric.float_sum_states()
        if not floats:
            return None
        flat = torch.cat([v.detach().reshape(-1) for v in floats.values()])  # stays on the states' device
        self.tree.add(batch_index, flat)
        for v in floats.values():
            v.zero_()
        return flat

    def float_total(self) -> torch.Tensor:
        """float64 [k]: this rank's folded float partials (zeros when nothing was folded)."""
        return self.tree.total() if self.tree is not None else torch.zeros(0, dtype=torch.float64)

    def load_float_total(self, total: torch.Tensor) -> None:
        """Write a folded total ``[k]`` back into the metric's float64 sum-states (after the loop: the
        local total; after synchronisation: the global one)."""
        floats = self.metric.float_sum_states()
        offset = 0
        for v in floats.values():
            v.copy_(total[offset:offset + v.numel()].reshape(v.shape).to(v.device))
            offset += v.numel()

    def finish_local(self) -> None:
        """End of this rank's loop: in bitwise mode the float sum-states receive the local tree total (for
        per-rank summaries and checkpoints); a no-op in fast mode. First raises what the metric found wrong
        but recorded on the device only (``Metric.raise_deferred``: DataError naming the sample id, here also
        its global batch)."""
        if self._replay:
            with torch.inference_mode():  # as in the loop: a state the metric replaced there is an inference tensor
                self._add_recorded(until=None)
        with self._batch_named():
            self.metric.raise_deferred()
        if self.tree is not None and self.float_names:
            self.load_float_total(self.float_total())

    @contextlib.contextmanager
    def _batch_named(self) -> Iterator[None]:
        """A deferred DataError of the metric raised in the block also names the sample's global batch."""
        try:
            yield
        except DataError as exc:
            batch = _batch_of(self._spans, exc.sample_id) if exc.sample_id is not None else None
            if batch is None:
                raise
            raise DataError(f"{exc}, in global batch {batch}", sample_id=exc.sample_id) from None

    def state_dict(self) -> dict:
        """The accumulated state as plain tensors (checkpoints with weights_only loading, exclusion of ranks):
        metric states, coverage runs and, in bitwise mode, the float tree nodes."""
        tree = self.tree
        where, values = BatchTreeSum.to_tensors(tree.nodes() if tree else [], tree.width if tree else 0)
        return {"states": self.metric.snapshot(), "runs": self.coverage.runs(), "tree_where": where,
                "tree_values": values}

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()`` of an evaluator of the same job into this fresh one."""
        self.metric.restore(state["states"])
        self.coverage.update_runs(state["runs"])
        if self.tree is not None:
            self.tree.load(BatchTreeSum.from_tensors(state["tree_where"], state["tree_values"]))

    def batch_log(self) -> dict:
        """The per-batch record: ``batches`` [[index, first id, size]], ``digests`` (one int per sample, in
        batch order), ``partials`` (float partials per batch, bitwise mode) and ``float_states`` (names and
        shapes of the partials' parts). One host transfer, at the end."""
        digests = torch.cat([d.cpu() for d in self._digests]).tolist() if self._digests else []
        spans = self._spans.tolist()
        return {"batches": [spans[i:i + 3] for i in range(0, len(spans), 3)], "digests": digests,
                "partials": torch.stack(self._partials).cpu().tolist() if self._partials else [],
                "float_states": [[n, list(s)] for n, s in zip(self.float_names, self.float_shapes)]}


def _merged(runs: list[tuple[int, int]]) -> torch.Tensor:
    """int64 [k, 2]: the ``[start, end)`` runs joined where they touch or overlap, in order. Not
    ``coverage.merge_runs``, which keeps overlaps apart to find duplicates: here a batch's run ``[first, last + 1)``
    contains the ids skipped inside it, which must join it."""
    out: list[list[int]] = []
    for a, b in sorted(runs):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return torch.tensor(out, dtype=torch.int64).reshape(-1, 2)


def _batch_of(spans: array.array, sample_id: int) -> int | None:
    """The global batch index in which ``sample_id`` was processed, None if none was: ``spans`` is the
    evaluator's flat ``(global batch, first id, size)`` record (ids are consecutive within a batch: positions
    of the shard plan)."""
    for i in range(0, len(spans), 3):
        if spans[i + 1] <= sample_id < spans[i + 1] + spans[i + 2]:
            return int(spans[i])
    return None
