"""The features the CUDA kernels do not have yet (sliding windows other than causal, softcap, ALiBi,
dropout, variable-length batches) must fail on CUDA with a clear error, never compute something else;
window_size=(-1, 0) and causal=True with a window's left side unbounded are causal and do run.
Every test here is marked `cuda` and is skipped where torch sees no GPU."""
import pytest
import torch

import flash_ext
from flash_ext.testing import attention_with_rng_state
from make_inputs import make_qkv, make_varlen_qkv

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

NOT_YET = "is not supported by the CUDA kernels yet"

UNSUPPORTED = {
    "window-16-0": (dict(window_size=(16, 0)), "sliding window"),
    "window-minus1-8": (dict(window_size=(-1, 8)), "sliding window"),
    "causal-window-16": (dict(causal=True, window_size=(16, -1)), "sliding window"),
    "softcap": (dict(softcap=30.0), "softcap"),
    "alibi": (dict(alibi_slopes=torch.ones(4, device="cuda") if torch.cuda.is_available() else None), "ALiBi"),
    "dropout": (dict(dropout_p=0.1), "dropout"),
}


@pytest.mark.parametrize("features,name", list(UNSUPPORTED.values()), ids=list(UNSUPPORTED))
def test_unsupported_features_raise(features, name):
    q, k, v = make_qkv(2, 64, 64, 4, 2, 64, torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError) as error:
        flash_ext.attention(q, k, v, **features)
    assert NOT_YET in str(error.value) and name in str(error.value), str(error.value)


@pytest.mark.parametrize("features,name", list(UNSUPPORTED.values()), ids=list(UNSUPPORTED))
def test_unsupported_features_raise_in_the_backward_op(features, name):
    q, k, v = make_qkv(2, 64, 64, 4, 2, 64, torch.bfloat16, device="cuda")
    out, lse = flash_ext.attention(q, k, v, return_lse=True)
    options = dict(window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0)
    causal = features.get("causal", False)
    if "window_size" in features:
        options["window_left"], options["window_right"] = features["window_size"]
    for key in ("softcap", "alibi_slopes", "dropout_p"):
        options[key] = features.get(key, options[key])
    with pytest.raises(RuntimeError, match=NOT_YET):
        torch.ops.flash_ext.bwd(torch.randn_like(out), q, k, v, out, lse, 0.125, causal, False, **options)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_varlen_raises(backward):
    q, k, v, cu_q, cu_k = make_varlen_qkv([5, 0, 70], [9, 3, 64], 4, 2, 64, torch.float16, device="cuda")
    message = "variable-length batches (attention_varlen) " + NOT_YET
    if not backward:
        with pytest.raises(RuntimeError) as error:
            flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 70, 64, causal=True)
    else:
        out, lse = torch.zeros_like(q), torch.zeros(4, q.shape[0], device="cuda")
        with pytest.raises(RuntimeError) as error:
            torch.ops.flash_ext.varlen_bwd(torch.randn_like(q), q, k, v, out, lse, cu_q, cu_k, 70, 64, 0.125, True)
    assert message in str(error.value), str(error.value)


def test_window_minus_one_zero_is_causal_on_cuda():
    q, k, v = make_qkv(2, 150, 200, 4, 2, 64, torch.bfloat16, device="cuda")
    causal = flash_ext.attention(q, k, v, causal=True, return_lse=True)
    for kwargs in (dict(window_size=(-1, 0)), dict(causal=True, window_size=(-1, 7))):
        for a, b in zip(flash_ext.attention(q, k, v, return_lse=True, **kwargs), causal):
            assert torch.equal(a, b), kwargs


def test_rng_state_is_zeros_without_dropout():
    q, k, v = make_qkv(1, 16, 16, 2, 2, 64, torch.float16, device="cuda")
    _, _, rng_state = attention_with_rng_state(q, k, v)
    assert rng_state.device == q.device and torch.equal(rng_state.cpu(), torch.zeros(2, dtype=torch.int64))
