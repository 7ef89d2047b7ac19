"""The checks are written twice: in C++ (csrc/api/checks.cpp, for real tensors) and in Python (the fakes
of flash_ext/_ops.py, for meta tensors and tracing, where shapes may be symbolic). For each bad call of
tests/bad_inputs.py, the op on CPU tensors and the same call on meta tensors (which reaches the fake)
raise the same error with the same message, up to the device it names. (The checks of cu_seqlens'
values read the values, which a fake cannot: bad_inputs.VALUES is left out.)"""
import pytest
import torch

from bad_inputs import BAD_BWD_INPUTS, BAD_OPTIONS, BAD_TENSORS, ids

CASES = BAD_TENSORS + BAD_OPTIONS + BAD_BWD_INPUTS


def to_meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def error_of(function, args, kwargs):
    with pytest.raises(Exception) as error:
        function(*args, **kwargs)
    return error.value


@pytest.mark.parametrize("make", [case[1] for case in CASES], ids=ids(CASES))
def test_real_op_and_fake_raise_alike(make):
    function, args, kwargs = make()
    real = error_of(function, args, kwargs)
    fake = error_of(function, [to_meta(a) for a in args], {name: to_meta(a) for name, a in kwargs.items()})
    assert type(fake) is type(real), f"the fake raised {type(fake).__name__} ({fake}), the op {type(real).__name__}"
    # Messages that name a device name the call's own: cpu for the op, meta for the fake.
    expected = str(real).replace(" on cpu", " on meta")
    assert str(fake) == expected, f"messages differ:\n  op:   {real}\n  fake: {fake}"
