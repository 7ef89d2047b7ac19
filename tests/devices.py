"""One test over several devices, each with its own grid of parameters.

    @parametrize_devices(
        cpu=dict(dtype=[torch.float32, torch.bfloat16], head_dim=[32]),
        cuda=dict(dtype=[torch.float16, torch.bfloat16], head_dim=[64, 128]),
    )
    def test_something(device, dtype, head_dim): ...

gives the test a `device` argument and the cartesian product of each device's axes (both devices
name the same axes, in the same order). The CUDA parameters carry the `cuda` mark: conftest.py skips
them where torch sees no GPU, and `pytest -m cuda` selects them. Test ids are the device, then the
id of each axis that has more than one value on that device (named(value, id) gives a value an id of
its own).
"""
import itertools

import pytest
import torch

DEVICE_MARKS = {"cpu": (), "cuda": (pytest.mark.cuda,)}
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


class named:
    """An axis value with its own test id."""

    def __init__(self, value, id):
        self.value, self.id = value, id


CAUSAL = [named(False, "full"), named(True, "causal")]
DQ_PATHS = [named(False, "atomic_dq"), named(True, "deterministic")]


def _value_and_id(value):
    if isinstance(value, named):
        return value.value, value.id
    if isinstance(value, torch.dtype):
        return value, DTYPE_IDS[value]
    return value, str(value)


def device_params(device, axes):
    """pytest.params (device, *axis values) of the cartesian product of axes, marked for the device."""
    shown = [len(values) > 1 for values in axes.values()]
    params = []
    for combination in itertools.product(*axes.values()):
        values, ids = zip(*(_value_and_id(value) for value in combination)) if combination else ((), ())
        test_id = "-".join([device] + [i for i, show in zip(ids, shown) if show])
        params.append(pytest.param(device, *values, marks=DEVICE_MARKS[device], id=test_id))
    return params


def parametrize_devices(**grids):
    """pytest.mark.parametrize over ("device", *axes), one grid of axes per device (cpu=..., cuda=...)."""
    names = [list(axes) for axes in grids.values()]
    assert all(n == names[0] for n in names), f"every device must name the same axes in one order: {names}"
    params = [param for device, axes in grids.items() for param in device_params(device, axes)]
    return pytest.mark.parametrize(["device", *names[0]], params)
