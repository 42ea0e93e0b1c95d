"""Loading checkpoints safely: ``torch.load(weights_only=True)``, plain state dicts only, shapes checked."""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch
from torch import nn

from disteval.errors import CheckpointError


def load_state_dict_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a plain state dict (mapping str -> Tensor) with ``weights_only=True``, mapped to CPU.

    Raises CheckpointError naming the file when it is missing, not loadable without arbitrary pickle
    (e.g. a whole pickled nn.Module), or not a flat mapping of names to tensors (e.g. a training
    checkpoint with ``epoch`` and ``optimizer`` entries: save ``model.state_dict()`` instead).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        what = "is not a file" if os.path.exists(path) else "does not exist"
        raise CheckpointError(f"checkpoint {path!r} (model.checkpoint) {what}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not a plain state dict"
        detail = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().split("\n")[0][:300] or "empty or truncated file"
        raise CheckpointError(f"checkpoint {path!r} is not a plain state dict loadable with "
                              f"torch.load(weights_only=True) (a pickled module, a truncated or non-torch "
                              f"file?): {type(exc).__name__}: {detail}") from exc
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"checkpoint {path!r} holds a {type(obj).__name__}, not a state dict "
                              "(save model.state_dict())")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"checkpoint {path!r} is not a plain state dict: entries {bad[:5]} are not "
                              "tensors (save model.state_dict(), not a training checkpoint)")
    return dict(obj)


def check_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], path: str = "") -> None:
    """Compare ``state`` with ``model.state_dict()`` (the model may live on the meta device).

    Raises CheckpointError naming the first mismatching parameter: a shape mismatch, a missing key or an
    unexpected key, with the counts of each.
    """
    expected = model.state_dict()
    where = f"checkpoint {path!r}" if path else "checkpoint"
    for name, tensor in state.items():
        if name in expected and tuple(expected[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{where}: parameter {name!r} has shape {tuple(tensor.shape)} but the model "
                                  f"expects {tuple(expected[name].shape)}")
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing:
        raise CheckpointError(f"{where}: parameter {missing[0]!r} is missing ({len(missing)} missing in all)")
    if unexpected:
        raise CheckpointError(f"{where}: unexpected parameter {unexpected[0]!r} ({len(unexpected)} unexpected "
                              "in all; wrong model.name?)")


def load_checkpoint_into(net: nn.Module, path: str | os.PathLike, drop_prefixes: tuple[str, ...] = ()) -> nn.Module:
    """Load the plain state dict at ``path`` into ``net`` (strict), after dropping the keys that start with
    any of ``drop_prefixes`` (e.g. ``("aux_classifier.",)`` for a head the model was built without).

    The file is read with ``load_state_dict_file`` and compared with ``check_state_dict`` first; tensors keep
    the checkpoint's values, converted to the parameters' dtypes by ``load_state_dict``. Returns ``net``.
    Raises CheckpointError naming the file when it cannot be read, does not fit the model, or
    ``load_state_dict`` refuses it (``"{path}: {error}"``).
    """
    state = load_state_dict_file(path)
    if drop_prefixes:
        state = {k: v for k, v in state.items() if not k.startswith(tuple(drop_prefixes))}
    check_state_dict(net, state, str(path))
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return net
