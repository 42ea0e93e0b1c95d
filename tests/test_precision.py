"""Precision policy: autocast dtype, TF32 off by default, deterministic switch, CPU warning, refused counts."""
import warnings
from types import SimpleNamespace

import pytest
import torch

from disteval.errors import ConfigError
from disteval.precision import apply_global_switches, autocast, check_metric_dtypes


def _p(**kw):
    base = dict(model_dtype="fp32", tf32=False, deterministic=False, count_dtype="int64", sum_dtype="float64")
    base.update(kw)
    return SimpleNamespace(**base)


def test_fp32_default_no_warning_tf32_off():
    torch.backends.cuda.matmul.allow_tf32 = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_global_switches(_p(), torch.device("cpu"))
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_on_cpu_warns_and_autocasts(dtype, torch_dtype):
    with pytest.warns(UserWarning, match="25x slower"):
        apply_global_switches(_p(model_dtype=dtype), torch.device("cpu"))
    lin = torch.nn.Linear(4, 3)
    with autocast(_p(model_dtype=dtype), torch.device("cpu")):
        assert lin(torch.randn(2, 4)).dtype == torch_dtype


def test_deterministic_switch():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        apply_global_switches(_p(deterministic=True), torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("key,value", [("count_dtype", "float32"), ("count_dtype", "int32"),
                                       ("sum_dtype", "float32"), ("sum_dtype", "bfloat16")])
def test_narrow_metric_states_refused(key, value):
    with pytest.raises(ConfigError, match=f"precision.{key}"):
        check_metric_dtypes(_p(**{key: value}))
