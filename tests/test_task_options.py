"""Tasks own their options (disteval/options/): each module there registers one dataclass under eval.<task>; the
schema (disteval.config.EvalConfig) has a node per registered class and validates each, so a new task with options
adds a module and edits no shared file."""
from __future__ import annotations

import dataclasses
import pkgutil

import pytest
from omegaconf import OmegaConf

import disteval.options as options_pkg
from disteval.config import DistevalConfig, EvalBase, EvalConfig, _eval_config
from disteval.errors import ConfigError
from disteval.options import OPTIONS, task_options


def test_every_options_module_registers_its_node_and_the_schema_has_it():
    modules = sorted(m.name for m in pkgutil.iter_modules(options_pkg.__path__))
    assert sorted(cls.__module__.rsplit(".", 1)[1] for cls in OPTIONS.values()) == modules
    fields = {f.name: f.type for f in dataclasses.fields(EvalConfig)}
    for name, cls in OPTIONS.items():
        assert fields[name] in (cls, cls.__name__)
        node = OmegaConf.structured(DistevalConfig).eval[name]
        assert dict(node) == dataclasses.asdict(cls())  # the defaults, under eval.<name>


@pytest.mark.parametrize("key,value", [("classification.topk", [0]), ("detection.iou_type", "keypoints"),
                                       ("segmentation.ignore_index", -2), ("embedding.similarity", "cosine")])
def test_each_node_is_validated_with_its_key(key, value):
    cfg = EvalConfig()
    node, leaf = key.split(".")
    setattr(getattr(cfg, node), leaf, value)
    with pytest.raises(ConfigError, match=f"eval.{key}"):
        cfg.validate()


def test_a_new_task_s_options_join_the_schema(monkeypatch):
    """What a module in disteval/options/ does: register a dataclass; the schema built after it has the node,
    validates it, and refuses a name that is one of eval's own keys."""
    monkeypatch.setattr("disteval.options.OPTIONS", dict(OPTIONS))
    monkeypatch.setattr("disteval.config.OPTIONS", options_pkg.OPTIONS)

    @task_options("depth")
    @dataclasses.dataclass
    class DepthOptions:
        max_depth_m: float = 80.0

        def validate(self) -> None:
            if self.max_depth_m <= 0:
                raise ConfigError("eval.depth.max_depth_m", f"must be > 0, got {self.max_depth_m}")

    schema = _eval_config()
    cfg = schema()
    assert cfg.depth.max_depth_m == 80.0 and issubclass(schema, EvalBase)
    cfg.depth.max_depth_m = -1.0
    with pytest.raises(ConfigError, match="eval.depth.max_depth_m"):
        cfg.validate()
    task_options("trials")(DepthOptions)
    with pytest.raises(ValueError, match="clash"):
        _eval_config()
