"""Model builders: the reference networks of this package and torchvision classification models by name.

Weights, in order of precedence: ``model.checkpoint`` (a local plain state dict), ``model.weights``
(``shipped`` for the reference CNNs, or a torchvision weights enum name such as IMAGENET1K_V1), else random
initialisation (seeded by ``seed``).

torchvision is imported only where a torchvision model is named: its import costs seconds per process (its
detection ops pull in torch._dynamo), which every rank would pay for a shipped CNN.
"""
from __future__ import annotations

import importlib.resources
import re
from typing import Any

import torch
from torch import nn

from disteval.errors import CheckpointError, ConfigError
from disteval.models.checkpoint import check_state_dict, load_state_dict_file
from disteval.models.parallel_plans import tp_problems
from disteval.models.reference_cnn import REFERENCE_MODELS, SHIPPED_CHECKPOINTS


def _torchvision_models():
    import torchvision.models

    return torchvision.models


# The driver checks small models' shapes on CPU: two samples through them take milliseconds, while the meta
# device's shape functions (meta conv, the addmm decomposition) import torch._dynamo, about 1.5-2 s.
CPU_CHECK_MAX_PARAMS = 2_000_000


def available_models() -> list[str]:
    """Reference model names followed by torchvision's classification model names."""
    models = _torchvision_models()
    return sorted(REFERENCE_MODELS) + models.list_models(module=models)


def shipped_checkpoint(name: str) -> str:
    """Path of the checkpoint shipped inside the package for reference model ``name``."""
    if name not in SHIPPED_CHECKPOINTS:
        raise ConfigError("model.weights", f"'shipped' weights exist only for {sorted(SHIPPED_CHECKPOINTS)}, "
                          f"not {name!r}")
    path = importlib.resources.files("disteval.models") / "checkpoints" / SHIPPED_CHECKPOINTS[name]
    if not path.is_file():
        raise CheckpointError(f"shipped checkpoint {path} is missing: run scripts/train_reference_cnns.py")
    return str(path)


def _torchvision_weights(name: str, weights: str):
    models = _torchvision_models()
    try:
        return models.get_model_weights(name)[weights]
    except KeyError:
        options = [w.name for w in models.get_model_weights(name)]
        raise ConfigError("model.weights", f"{weights!r} is not a weights name of {name} "
                          f"(available: {options + ['null']})") from None


def weights_plan(model: Any) -> tuple[str, Any]:
    """Decide where the weights come from: ``("checkpoint", path)``, ``("torchvision", WeightsEnum)``
    or ``("random", None)``. Raises ConfigError for an unknown model name or weights name."""
    if model.name not in REFERENCE_MODELS and model.name not in available_models():
        raise ConfigError("model.name", f"unknown model {model.name!r}; reference models: "
                          f"{sorted(REFERENCE_MODELS)}, or any torchvision classification model "
                          "(torchvision.models.list_models(module=torchvision.models))")
    if model.checkpoint:
        return "checkpoint", str(model.checkpoint)
    if model.weights in (None, "", "none", "null"):
        return "random", None
    if model.name in REFERENCE_MODELS:
        if model.weights != "shipped":
            raise ConfigError("model.weights", f"{model.name} takes weights=shipped or null, not {model.weights!r}")
        return "checkpoint", shipped_checkpoint(model.name)
    return "torchvision", _torchvision_weights(model.name, model.weights)


def _architecture(model: Any, num_classes: int) -> nn.Module:
    kwargs = dict(model.kwargs or {})
    if model.name in REFERENCE_MODELS:
        return REFERENCE_MODELS[model.name](num_classes=num_classes, **kwargs)
    return _torchvision_models().get_model(model.name, weights=None, num_classes=num_classes, **kwargs)


def resolve_num_classes(model: Any, dataset_classes: int | None) -> int:
    """Output classes: model.num_classes, else the torchvision weights' categories, else the dataset's."""
    plan, weights = weights_plan(model)
    if plan == "torchvision":
        n = len(weights.meta["categories"])
        if model.num_classes not in (None, n):
            raise ConfigError("model.num_classes", f"{model.weights} weights of {model.name} have {n} classes, "
                              f"not {model.num_classes}")
        return n
    if model.num_classes is not None:
        return int(model.num_classes)
    if dataset_classes is None:
        raise ConfigError("model.num_classes", "cannot infer the number of classes; set model.num_classes")
    return dataset_classes


def shape_error(name: str, input_shape: tuple[int, ...], exc: BaseException, channel_key: str | None) -> ConfigError:
    """The ConfigError for a model that cannot take the data's inputs: a channel count the first layer does not
    take (torch's "expected input[...] to have 1 channels, but got 3 channels") names ``channel_key`` (the data's
    setting that decides the channels, e.g. ``data.image_mode``), any other shape error ``data.crop_size``."""
    found = re.search(r"to have (\d+) channels, but got (\d+) channels", str(exc))
    if found and channel_key:
        return ConfigError(channel_key, f"{name} takes {found.group(1)}-channel inputs but the data gives "
                                        f"{found.group(2)} channels (inputs of shape {list(input_shape)}); set "
                                        f"{channel_key} to match the model (l8: 1 channel, rgb8: 3)")
    return ConfigError("data.crop_size", f"{name} cannot take the data's inputs of shape {list(input_shape)} "
                                         f"({type(exc).__name__}: {exc}); check data.crop_size and model.kwargs")


def preflight_model(model: Any, num_classes: int, input_shape: tuple[int, ...] | None = None,
                    channel_key: str | None = None) -> None:
    """Driver-side checks before any rank starts: the architecture builds and, given the data's
    ``input_shape`` (C, H, W), runs a forward pass to logits [B, num_classes], both on the meta device (no
    memory, no compute), or on CPU for a model of at most ``CPU_CHECK_MAX_PARAMS`` parameters; a checkpoint
    loads with weights_only=True and fits it; torchvision weights are in torch.hub's cache (downloaded here,
    once, when missing). ``channel_key``: the config key that sets the inputs' channels (named when the model's
    first layer takes another number, ``shape_error``). Raises ConfigError or CheckpointError."""
    plan, source = weights_plan(model)
    device = torch.device("meta")
    try:
        with device:
            net = _architecture(model, num_classes).eval()
    except TypeError as exc:
        raise ConfigError("model.kwargs", f"{model.name} does not accept {dict(model.kwargs)}: {exc}") from exc
    except NotImplementedError:  # builders that initialise weights by copying data (regnet) need real memory
        device, net = torch.device("cpu"), None
    if net is None or sum(p.numel() for p in net.parameters()) <= CPU_CHECK_MAX_PARAMS:
        device = torch.device("cpu")
        with torch.random.fork_rng(devices=[]):  # leave the caller's random state as it was
            net = _architecture(model, num_classes).eval()
    with device, torch.no_grad():
        if input_shape is not None:
            try:
                out = net(torch.zeros((2, *input_shape)))
            except Exception as exc:  # noqa: BLE001 - any shape error of the architecture
                raise shape_error(model.name, input_shape, exc, channel_key) from exc
            if tuple(out.shape) != (2, num_classes):
                raise ConfigError("model.num_classes", f"{model.name} returns outputs of shape {list(out.shape[1:])} "
                                  f"per sample, expected [{num_classes}] logits")
    if plan == "checkpoint":
        check_state_dict(net, load_state_dict_file(source), source)
    elif plan == "torchvision":
        try:
            source.get_state_dict(progress=False, check_hash=True)
        except Exception as exc:  # noqa: BLE001 - offline machines land here
            raise ConfigError("model.weights", f"cannot fetch {model.name} {model.weights} from {source.url} "
                              f"({type(exc).__name__}: {exc}); offline? pass model.checkpoint=PATH to a local "
                              "state dict") from exc


def prefetch_torchvision_weights(model: Any) -> Any:
    """In the driver, before any rank starts: download the torchvision weights named by ``model.weights`` of
    ``model.name`` into torch.hub's cache (once, not in every rank) and return their weights enum (its
    ``meta["categories"]`` gives the class count); None when no weights are named or ``model.checkpoint``
    replaces them. For the task builders that take any torchvision model (detection, segmentation).

    Raises ConfigError("model.weights") for a name that is not a weights name of ``model.name``, or when the
    download fails (an offline machine: pass model.checkpoint=PATH).
    """
    if model.weights in (None, "", "none", "null") or model.checkpoint:
        return None
    try:  # download once here, not in every rank
        weights = _torchvision_models().get_model_weights(model.name)[model.weights]
        weights.get_state_dict(progress=False)
    except KeyError:
        raise ConfigError("model.weights", f"{model.weights!r} is not a weights name of "
                          f"{model.name}") from None
    except Exception as exc:  # noqa: BLE001 - offline machines land here
        raise ConfigError("model.weights", f"cannot fetch {model.name} {model.weights} "
                          f"({type(exc).__name__}: {exc}); offline? pass model.checkpoint=PATH") from None
    return weights


def tp_split_problems(model: Any, tp: int) -> list[str]:
    """Why the configured architecture cannot be split ``tp`` ways by its tensor-parallel plan
    (``disteval.models.parallel_plans.tp_problems``), checked on the meta device (no memory). [] when it can."""
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        net = _architecture(model, int(model.num_classes or 2))
    return tp_problems(net, tp)


def build_model(model: Any, num_classes: int, seed: int = 0) -> nn.Module:
    """Build the configured model on CPU in eval mode with its weights loaded (strict).

    Raises ConfigError / CheckpointError (see ``preflight_model``)."""
    plan, source = weights_plan(model)
    torch.manual_seed(seed)
    if plan == "torchvision":
        net = _torchvision_models().get_model(model.name, weights=source, **dict(model.kwargs or {}))
    else:
        net = _architecture(model, num_classes)
        if plan == "checkpoint":
            state = load_state_dict_file(source)
            check_state_dict(net, state, source)
            net.load_state_dict(state, strict=True)
    return net.eval()
