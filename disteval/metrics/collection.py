"""Several metric families behind one Metric: states are namespaced ``family.state``, so the engine
synchronises all of them in the same few collectives."""
from __future__ import annotations

import torch

from disteval.errors import DataError
from disteval.metrics.base import Metric


class MetricCollection(Metric):
    """``MetricCollection({"classification": ClassificationMetrics(...), "ranking": RankingMetrics(...)})``.

    ``compute()`` merges the families' result dicts (their keys must not collide)."""

    def __init__(self, metrics: dict[str, Metric]):
        super().__init__()
        self.metrics = dict(metrics)

    @property
    def device_resident(self) -> bool:  # type: ignore[override]
        """True when every family is (``Metric.device_resident``)."""
        return all(m.device_resident for m in self.metrics.values())

    def to(self, device):
        """Every family's states to ``device`` (``Metric.to``). Returns self."""
        super().to(device)
        for m in self.metrics.values():
            m.to(device)
        return self

    def raise_deferred(self) -> None:
        """Each family's deferred error, in family order (``Metric.raise_deferred``)."""
        for m in self.metrics.values():
            m.raise_deferred()

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, sample_ids: torch.Tensor) -> None:
        """Each family's ``update`` with the same batch (shapes as the families document)."""
        for m in self.metrics.values():
            m.update(outputs, targets, sample_ids)

    def states(self):
        """``{"family.state": (tensor, reduction)}`` of every family."""
        return {f"{family}.{name}": value for family, m in self.metrics.items() for name, value in m.states().items()}

    def specs(self):
        """``{"family.state": StateSpec}`` of every family."""
        return {f"{family}.{name}": spec for family, m in self.metrics.items() for name, spec in m.specs().items()}

    def _route(self, name: str) -> tuple[Metric, str]:
        family, _, state = name.partition(".")
        return self.metrics[family], state

    def slice_partials(self, name, block, start, stop):
        """Routed to the family of ``name`` (``family.state``)."""
        m, state = self._route(name)
        return m.slice_partials(state, block, start, stop)

    def finish_slice(self, name, block, start, stop, partial):
        """Routed to the family of ``name``."""
        m, state = self._route(name)
        return m.finish_slice(state, block, start, stop, partial)

    def load_finished(self, name, rows):
        """Routed to the family of ``name``."""
        m, state = self._route(name)
        m.load_finished(state, rows)

    def load_synced(self, states: dict[str, torch.Tensor]) -> None:
        """Each family receives its namespaced states (prefix stripped). Raises as ``Metric.load_synced``."""
        for family, m in self.metrics.items():
            prefix = f"{family}."
            m.load_synced({k[len(prefix):]: v for k, v in states.items() if k.startswith(prefix)})

    def merge_state(self, others) -> None:
        """Family by family, as ``Metric.merge_state``; ``others`` are collections of the same families."""
        others = list(others)
        for family, m in self.metrics.items():
            m.merge_state([o.metrics[family] for o in others])

    def float_sum_states(self):
        """``{"family.state": tensor}`` of every family's float64 sum-states."""
        return {f"{family}.{name}": v for family, m in self.metrics.items() for name, v in m.float_sum_states().items()}

    def reset(self) -> None:
        """Every family back to its initial states."""
        for m in self.metrics.values():
            m.reset()

    def snapshot(self):
        """``{"family.state": copy}`` of every family's local states (raises what ``raise_deferred`` raises)."""
        return {f"{family}.{name}": v for family, m in self.metrics.items() for name, v in m.snapshot().items()}

    def restore(self, snapshot) -> None:
        """Every family from its part of a ``snapshot()``. Raises KeyError for a missing state."""
        for family, m in self.metrics.items():
            prefix = f"{family}."
            m.restore({k[len(prefix):]: v for k, v in snapshot.items() if k.startswith(prefix)})

    def mark(self):
        """``{"family.state": mark}`` of every family (``Metric.mark``)."""
        return {f"{family}.{name}": v for family, m in self.metrics.items() for name, v in m.mark().items()}

    def contribution(self, mark):
        """``{"family.state": part}`` of every family since its part of ``mark`` (``Metric.contribution``)."""
        return {f"{family}.{name}": v for family, m in self.metrics.items()
                for name, v in m.contribution(self._part(mark, family)).items()}

    def add_contribution(self, part) -> None:
        """Every family adds its part of a ``contribution`` (``Metric.add_contribution``)."""
        for family, m in self.metrics.items():
            m.add_contribution(self._part(part, family))

    @staticmethod
    def _part(named: dict, family: str) -> dict:
        prefix = f"{family}."
        return {k[len(prefix):]: v for k, v in named.items() if k.startswith(prefix)}

    def compute(self) -> dict:
        """The families' results merged into one dict. Raises ValueError when two families report the same key."""
        out: dict = {}
        for m in self.metrics.values():
            result = m.compute()
            clash = set(result) & set(out)
            if clash:
                raise ValueError(f"metric families report the same keys {sorted(clash)}")
            out.update(result)
        return out

    def local_summary(self) -> dict:
        """The families' local summaries merged (e.g. classification's accuracy and NLL of this rank)."""
        out: dict = {}
        for m in self.metrics.values():
            out.update(m.local_summary())
        return out


class PerModelMetrics(MetricCollection):
    """One metric per model of a set evaluated on the same batches (``model.checkpoints``):
    ``PerModelMetrics({"epoch_10": m10, "epoch_20": m20})``. States are namespaced ``model.state`` (model
    names hold no ``.``), so all models' states are synchronised in the same few collectives, each exactly as
    its own run would synchronise it.

    ``update(outputs, targets, ids)`` takes ``outputs`` as a tuple with one entry per model, in the order of
    the dict; ``compute()`` returns ``{model: metrics}``. Raises ValueError when the tuple's length differs."""

    def raise_deferred(self) -> None:
        """Each model's deferred error, naming the model (a checkpoint whose outputs are not finite)."""
        for name, m in self.metrics.items():
            try:
                m.raise_deferred()
            except DataError as exc:
                raise DataError(f"checkpoint {name}: {exc}", sample_id=exc.sample_id) from exc

    def update(self, outputs, targets: torch.Tensor, sample_ids: torch.Tensor) -> None:
        """Model i's metric gets ``outputs[i]`` with the shared targets and ids; a DataError names the model."""
        if not isinstance(outputs, (tuple, list)) or len(outputs) != len(self.metrics):
            raise ValueError(f"expected a tuple of {len(self.metrics)} outputs (one per model), got "
                             f"{type(outputs).__name__}{'' if not isinstance(outputs, (tuple, list)) else len(outputs)}")
        for (name, m), out in zip(self.metrics.items(), outputs):
            try:
                m.update(out, targets, sample_ids)
            except DataError as exc:
                raise DataError(f"checkpoint {name}: {exc}", sample_id=exc.sample_id) from exc

    def compute(self) -> dict:
        """``{model: that model's metrics}``."""
        return {name: m.compute() for name, m in self.metrics.items()}

    def local_summary(self) -> dict:
        """{} (a rank's local accuracy is one per model: the outlier check, which compares ranks by one
        accuracy, does not apply)."""
        return {}
