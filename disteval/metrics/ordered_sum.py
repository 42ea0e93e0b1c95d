"""Float64 sums whose value does not depend on how the summands were split among ranks.

Floating-point addition is not associative, so a sum over the batches of a dataset depends on the order
in which partial sums are combined: per rank then across ranks gives other last bits at every world size.
``BatchTreeSum`` fixes the order by the *global batch index* alone. The per-batch partials (leaves) are
combined in the canonical binary tree over batch indices: node ``(level, i)`` covers batches
``[i * 2**level, (i + 1) * 2**level)`` and its value is ``left + right`` of its two children. A rank that
holds a contiguous run of batches builds every complete node inside its run (a binary counter: O(log n)
nodes kept); the nodes of all ranks are merged by the same rule, and the nodes that remain (those whose
sibling is absent) are added left to right. Every node is therefore the same sum of the same leaves in the
same order whatever W, and the total is bit-identical for every split of the batches among ranks
(pairwise summation, Higham, "The accuracy of floating point summation", SIAM J. Sci. Comput. 1993, whose
error bound O(log n) is also better than a running sum's O(n)).

Values are float64 tensors of one fixed shape ``[k]`` (several states concatenated); pure, no
torch.distributed: ``disteval.rank.sync`` moves the nodes.
"""
from __future__ import annotations

from typing import Iterable

import torch

Node = tuple[int, int, torch.Tensor]  # (level, index, value float64 [k])


def _siblings(left: Node, right: Node) -> bool:
    return left[0] == right[0] and left[1] % 2 == 0 and right[1] == left[1] + 1


def _push(stack: list[Node], node: Node) -> None:
    stack.append(node)
    while len(stack) >= 2 and _siblings(stack[-2], stack[-1]):
        (level, index, a), (_, _, b) = stack[-2], stack[-1]
        stack[-2:] = [(level + 1, index // 2, a + b.to(a.device))]


def _start(node: Node) -> int:
    return node[1] << node[0]


class BatchTreeSum:
    """Accumulates per-batch float64 partials ``[k]`` keyed by global batch index.

    ``add(batch, value)`` with strictly increasing batch indices; ``nodes()`` the complete tree nodes held
    (to send to the other ranks); ``total()`` this instance's sum; ``combine(nodes)`` the sum of nodes from
    any number of instances (disjoint batch sets), identical for every split of the same leaves.
    Raises ValueError for a batch index that does not increase or a value of another shape.
    """

    def __init__(self, width: int):
        self.width = int(width)
        self._stack: list[Node] = []
        self._last = -1

    def add(self, batch: int, value: torch.Tensor) -> None:
        """Add the partial ``value`` (float64 [k], detached; copied) of global batch ``batch``."""
        if batch <= self._last:
            raise ValueError(f"batch index {batch} after {self._last}: batches must come in increasing order")
        if value.shape != (self.width,) or value.dtype != torch.float64:
            raise ValueError(f"partial of shape {tuple(value.shape)} {value.dtype}, want ({self.width},) float64")
        self._last = batch
        _push(self._stack, (0, int(batch), value.clone()))

    def nodes(self) -> list[Node]:
        """The complete nodes held, in batch order (at most about 2 log2(batches) of them)."""
        return list(self._stack)

    def load(self, nodes: Iterable[Node]) -> None:
        """Replace the held nodes (a checkpoint's); later ``add`` calls continue after their last batch."""
        self._stack = []
        for node in sorted(nodes, key=_start):
            _push(self._stack, node)
        self._last = max(((n[1] + 1) << n[0]) - 1 for n in self._stack) if self._stack else -1

    def total(self) -> torch.Tensor:
        """float64 [k]: this instance's sum (zeros when empty)."""
        return self.combine(self._stack, self.width)

    @staticmethod
    def to_tensors(nodes: list[Node], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Nodes as plain tensors (to send or save): ``where`` int64 [n, 2] (level, index) and ``values``
        float64 [n, width] on the CPU."""
        where = torch.tensor([[lvl, idx] for lvl, idx, _ in nodes], dtype=torch.int64).reshape(-1, 2)
        values = (torch.stack([v.cpu() for _, _, v in nodes]) if nodes
                  else torch.zeros((0, width), dtype=torch.float64))
        return where, values

    @staticmethod
    def from_tensors(where: torch.Tensor, values: torch.Tensor) -> list[Node]:
        """The inverse of ``to_tensors``."""
        return [(int(lvl), int(idx), values[i]) for i, (lvl, idx) in enumerate(where.tolist())]

    @staticmethod
    def combine(nodes: Iterable[Node], width: int) -> torch.Tensor:
        """float64 [width]: the sum of nodes of disjoint batch sets (from any ranks, in any order): merged
        into the canonical tree, then the remaining nodes added left to right."""
        stack: list[Node] = []
        for node in sorted(nodes, key=_start):
            _push(stack, node)
        total = torch.zeros(width, dtype=torch.float64)
        for i, (_, _, value) in enumerate(stack):
            total = value.to(torch.float64).clone() if i == 0 else total + value.to(total.device)
        return total.cpu()
