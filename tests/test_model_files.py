"""Model files without processes: a plain state dict loaded into a torchvision segmentation model through
``build_segmenter`` (``models.checkpoint.load_checkpoint_into``: equal tensors, the auxiliary head's keys
dropped, a misfit named with its file) and the driver's one download of torchvision weights
(``models.builders.prefetch_torchvision_weights``: unknown names and a refused network are ConfigErrors
naming ``model.weights``)."""
from __future__ import annotations

import socket

import pytest
import torch
import torchvision
from omegaconf import OmegaConf

from disteval.errors import CheckpointError, ConfigError
from disteval.models.builders import prefetch_torchvision_weights
from disteval.models.segmentation import build_segmenter


def _cfg(name: str, checkpoint=None, weights=None) -> OmegaConf:
    return OmegaConf.create({"name": name, "weights": weights, "checkpoint": checkpoint, "num_classes": 3,
                             "kwargs": {}})


def test_checkpoint_loads_equal_tensors_and_drops_the_aux_head(tmp_path):
    torch.manual_seed(1)
    trained = torchvision.models.get_model("fcn_resnet50", weights=None, weights_backbone=None, num_classes=3,
                                           aux_loss=True)  # saved with its auxiliary head, as training leaves it
    path = tmp_path / "fcn.pt"
    torch.save(trained.state_dict(), path)
    net = build_segmenter(_cfg("fcn_resnet50", str(path)), 3, seed=7)
    got = net.state_dict()
    want = {k: v for k, v in trained.state_dict().items() if not k.startswith("aux_classifier.")}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not net.training


def test_checkpoint_that_does_not_fit_names_the_file(tmp_path):
    other = torchvision.models.get_model("lraspp_mobilenet_v3_large", weights=None, weights_backbone=None,
                                         num_classes=5)
    path = tmp_path / "five_classes.pt"
    torch.save(other.state_dict(), path)
    with pytest.raises(CheckpointError, match="five_classes.pt"):
        build_segmenter(_cfg("lraspp_mobilenet_v3_large", str(path)), 3)


def test_weights_prefetch_names_model_weights(monkeypatch, tmp_path):
    assert prefetch_torchvision_weights(_cfg("fcn_resnet50")) is None  # nothing named: nothing to fetch
    assert prefetch_torchvision_weights(_cfg("fcn_resnet50", "ckpt.pt", "COCO_WITH_VOC_LABELS_V1")) is None
    with pytest.raises(ConfigError, match=r"model\.weights.*'NOT_A_NAME' is not a weights name of fcn_resnet50"):
        prefetch_torchvision_weights(_cfg("fcn_resnet50", weights="NOT_A_NAME"))

    def refuse(*args, **kwargs):
        raise OSError("network refused by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty hub cache
    monkeypatch.setattr(torch.hub, "_hub_dir", None, raising=False)
    with pytest.raises(ConfigError, match=r"model\.weights.*offline\? pass model\.checkpoint=PATH"):
        prefetch_torchvision_weights(_cfg("fcn_resnet50", weights="COCO_WITH_VOC_LABELS_V1"))
