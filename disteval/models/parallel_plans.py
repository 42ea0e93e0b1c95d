"""Model-parallel plans kept as data beside the model builders: for each architecture (by class name), which
sub-modules are split column-wise / row-wise by tensor parallelism and which are the units of FSDP2 sharding,
plus the one preparation torchvision's ViT needs. ``disteval.comm.mesh.apply_parallelism`` turns a plan into
``parallelize_module`` / ``fully_shard`` calls; this module itself knows nothing of torch.distributed.

Another architecture adds its entry to ``PLANS`` (and a ``prepare`` function when its layers are not
``nn.Linear`` that can be split as they are).

torchvision's ViT attention is an ``nn.MultiheadAttention``: its packed ``in_proj_weight`` [3D, D] is a
parameter, not an ``nn.Linear``, so ``ColwiseParallel`` cannot be applied, and a plain row split of it would
give TP rank 0 the queries of all heads and rank 1 the keys. ``prepare_vit`` swaps each one for
``ShardableSelfAttention``: the same weights in an ``nn.Linear`` ``qkv`` whose rows are reordered head by head
([q_h; k_h; v_h] for h = 0..H-1), so a column split gives each TP rank whole heads (H/tp of them) with their
own queries, keys and values (Megatron-LM's layout: Shoeybi et al. 2019, section 3), and the output projection
``out_proj`` is split row-wise (its partial products summed by one all_reduce).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PLANS", "ParallelPlan", "ShardableSelfAttention", "plan_for", "prepare_vit", "tp_problems",
           "vit_state_dict_to_tp_layout"]


class ShardableSelfAttention(nn.Module):
    """Self-attention with one packed projection ``qkv`` (``nn.Linear(D, 3D)``, rows head-major:
    [q_0; k_0; v_0; q_1; ...], each block ``head_dim`` rows) and ``out_proj`` (``nn.Linear(D, D)``).

    Called as torchvision's ``EncoderBlock`` calls ``nn.MultiheadAttention``: ``forward(x, x, x,
    need_weights=False) -> (out [B, S, D], None)``. The number of heads is read from the width of ``qkv``'s
    output, so the same code runs unsplit (H heads) and column-split by tensor parallelism (H/tp local heads);
    attention is ``F.scaled_dot_product_attention`` (softmax(q k^T / sqrt(head_dim)) v, Vaswani et al. 2017).
    Dropout is not applied (evaluation only)."""

    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not a multiple of num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention) -> "ShardableSelfAttention":
        """The same attention as ``mha`` (batch_first, packed in-projection with bias, no bias_k/bias_v)."""
        if not mha.batch_first or mha.in_proj_weight is None or mha.bias_k is not None or mha.in_proj_bias is None:
            raise ValueError("ShardableSelfAttention replaces batch-first attention with a packed, biased "
                             "in-projection and no bias_k/bias_v only")
        out = cls(mha.embed_dim, mha.num_heads)
        with torch.no_grad():
            out.qkv.weight.copy_(head_major(mha.in_proj_weight, mha.num_heads))
            out.qkv.bias.copy_(head_major(mha.in_proj_bias, mha.num_heads))
            out.out_proj.weight.copy_(mha.out_proj.weight)
            out.out_proj.bias.copy_(mha.out_proj.bias)
        return out.to(mha.in_proj_weight.device)

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                need_weights: bool = False) -> tuple[torch.Tensor, None]:
        b, s, _ = query.shape
        y = self.qkv(query)  # [B, S, 3 * heads_local * head_dim]
        heads = y.shape[-1] // (3 * self.head_dim)
        q, k, v = y.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)  # each [B, h, S, hd]
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, heads * self.head_dim)), None


def head_major(packed: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder a packed in-projection ([Wq; Wk; Wv], rows 3D, any trailing shape) to [q_0; k_0; v_0; q_1; ...]
    (blocks of D/num_heads rows). Returns a new tensor of the same shape."""
    rows = packed.shape[0]
    hd = rows // (3 * num_heads)
    return packed.reshape(3, num_heads, hd, *packed.shape[1:]).transpose(0, 1).reshape(packed.shape).clone()


def prepare_vit(model: nn.Module) -> nn.Module:
    """Swap every ``encoder.layers.*.self_attention`` (``nn.MultiheadAttention``) of a torchvision
    VisionTransformer for ``ShardableSelfAttention`` with the same weights, in place. Returns the model."""
    for block in model.encoder.layers:
        if isinstance(block.self_attention, nn.MultiheadAttention):
            block.self_attention = ShardableSelfAttention.from_mha(block.self_attention)
    return model


def vit_state_dict_to_tp_layout(state: dict[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """A torchvision VisionTransformer state dict in the layout of ``prepare_vit``'s model:
    ``...self_attention.in_proj_weight`` / ``in_proj_bias`` become ``...self_attention.qkv.weight`` / ``bias``
    (head-major rows); other keys unchanged. A dict already in that layout is returned as it is."""
    out = {}
    for key, value in state.items():
        if key.endswith("self_attention.in_proj_weight"):
            out[key.replace("in_proj_weight", "qkv.weight")] = head_major(value, num_heads)
        elif key.endswith("self_attention.in_proj_bias"):
            out[key.replace("in_proj_bias", "qkv.bias")] = head_major(value, num_heads)
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class ParallelPlan:
    """How one architecture is split.

    tp_layers: ``{module name pattern: "colwise" | "rowwise"}`` (``*`` matches one name component, as in
    ``parallelize_module``'s plans); fsdp_units: module name patterns each wrapped by ``fully_shard`` (the root
    module is wrapped last); prepare: an in-place rewrite making the model splittable (None: none needed);
    convert_state_dict: ``(full state dict, model) -> state dict`` of the prepared layout;
    divisible: ``{attribute path: description}`` whose values must be multiples of the TP degree."""

    tp_layers: dict[str, str]
    fsdp_units: tuple[str, ...]
    prepare: Callable[[nn.Module], nn.Module] | None = None
    convert_state_dict: Callable[[dict, nn.Module], dict] | None = None
    divisible: dict[str, str] = field(default_factory=dict)


VIT_PLAN = ParallelPlan(
    tp_layers={"encoder.layers.*.self_attention.qkv": "colwise",
               "encoder.layers.*.self_attention.out_proj": "rowwise",
               "encoder.layers.*.mlp.0": "colwise",   # MLPBlock: Linear(D, mlp_dim), GELU, Dropout, Linear, Dropout
               "encoder.layers.*.mlp.3": "rowwise"},
    fsdp_units=("encoder.layers.*",),
    prepare=prepare_vit,
    convert_state_dict=lambda state, model: vit_state_dict_to_tp_layout(state, _vit_heads(model)),
    divisible={"encoder.layers.0.self_attention.num_heads": "attention heads",
               "encoder.layers.0.mlp.0.out_features": "MLP width"})

# architecture (class name) -> plan
PLANS: dict[str, ParallelPlan] = {"VisionTransformer": VIT_PLAN}


def _vit_heads(model: nn.Module) -> int:
    attn = model.encoder.layers[0].self_attention
    return int(attn.num_heads)


def plan_for(model: nn.Module) -> ParallelPlan | None:
    """The plan of ``model``'s architecture (``PLANS`` by class name), or None."""
    return PLANS.get(type(model).__name__)


def tp_problems(model: nn.Module, tp: int) -> list[str]:
    """Why ``model`` cannot be split ``tp`` ways (empty when it can): no plan for its class, or a width of
    the plan's ``divisible`` attributes that is not a multiple of ``tp``."""
    plan = plan_for(model)
    if plan is None:
        return [f"no tensor-parallel plan for {type(model).__name__} (plans exist for {sorted(PLANS)}; add one to "
                "disteval.models.parallel_plans.PLANS)"]
    out = []
    for path, what in plan.divisible.items():
        value = model
        for part in path.split("."):
            value = value[int(part)] if part.isdigit() else getattr(value, part)
        if int(value) % tp:
            out.append(f"{what} ({path} = {int(value)}) is not a multiple of tp={tp}")
    return out
