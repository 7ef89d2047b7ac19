"""flash_ext.flash_attn_interface, flash-attn 2.8's public functions over flash_ext, on the CPU and on CUDA
(parameters marked `cuda`).

The signatures against flash-attn 2.8.3's (names, order, defaults). Each function, called with every argument
positional as flash-attn code writes it, over a grid shaped like flash-attn's tests/test_flash_attn.py (seqlens
with 1, 17, 129 and seqlen_q != seqlen_k, head dims with 59, MHA / GQA / MQA, causal, sliding windows, softcap,
ALiBi, dropout, deterministic): out and softmax_lse against the float64 reference (tests/tolerance.py's rule,
dropout with the call's own keep mask), the gradients likewise (of the packed tensor for the packed variants),
and out bit for bit equal to the flash_ext call it maps to. Also: keyword calls, flash-attn's conventions
(negative window sides, softcap <= 0, slopes that require grad, a KV cache call in grad mode), the errors for
what flash_ext cannot return, paged varlen, flash_attn_with_kvcache against its reference, torch.compile."""
import inspect
import math

import pytest
import torch

import flash_ext
import flash_ext.flash_attn_interface as flash_attn_interface
from devices import CAUSAL, parametrize_devices
from flash_ext.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                            flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                            flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from flash_ext.reference import attention_ref, attention_varlen_ref, attention_with_kvcache_ref
from flash_ext.testing import attention_varlen_with_rng_state, attention_with_rng_state
from make_inputs import cu_seqlens, make_qkv, make_varlen_qkv
from tolerance import (FWD_FACTOR, assert_forward_within_tolerance, assert_gradients_within_tolerance,
                       assert_within_tolerance, max_seqlen, reference_options)

CUDA_DTYPES = [torch.float16, torch.bfloat16]

# ---- Signatures --------------------------------------------------------------------------------------

_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
            ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_REQUIRED = inspect.Parameter.empty
# flash-attn 2.8.3, flash_attn/flash_attn_interface.py: every parameter positional-or-keyword, in this order.
FLASH_ATTN_SIGNATURES = {
    "flash_attn_qkvpacked_func": [("qkv", _REQUIRED)] + _OPTIONS,
    "flash_attn_kvpacked_func": [("q", _REQUIRED), ("kv", _REQUIRED)] + _OPTIONS,
    "flash_attn_func": [("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED)] + _OPTIONS,
    "flash_attn_varlen_qkvpacked_func": [("qkv", _REQUIRED), ("cu_seqlens", _REQUIRED), ("max_seqlen", _REQUIRED)]
    + _OPTIONS,
    "flash_attn_varlen_kvpacked_func": [(name, _REQUIRED) for name in ("q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                                                       "max_seqlen_q", "max_seqlen_k")] + _OPTIONS,
    "flash_attn_varlen_func": [(name, _REQUIRED) for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                                              "max_seqlen_q", "max_seqlen_k")]
    + _OPTIONS + [("block_table", None)],
    "flash_attn_with_kvcache": [("q", _REQUIRED), ("k_cache", _REQUIRED), ("v_cache", _REQUIRED), ("k", None),
                                ("v", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                                ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
                                ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                                ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
                                ("num_splits", 0), ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("name", list(FLASH_ATTN_SIGNATURES))
def test_signature_is_flash_attns(name):
    parameters = inspect.signature(getattr(flash_attn_interface, name)).parameters.values()
    got = [(p.name, p.default) for p in parameters]
    assert got == FLASH_ATTN_SIGNATURES[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)
    assert getattr(flash_attn_interface, name).__doc__


def test_module_exports_the_seven_functions():
    assert sorted(flash_attn_interface.__all__) == sorted(FLASH_ATTN_SIGNATURES)
    namespace = {}
    exec("from flash_ext.flash_attn_interface import *", namespace)
    assert all(callable(namespace[name]) for name in FLASH_ATTN_SIGNATURES)


# ---- The grid ----------------------------------------------------------------------------------------

MHA_TYPES = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# Feature sets as flash-attn passes them, as functions of (batch, heads_q, seqlen_k, device). A window as in
# flash-attn's tests: both sides bounded, below seqlen_k.
FEATURES = {
    "plain": lambda batch, heads, seqlen_k, device: {},
    "local": lambda batch, heads, seqlen_k, device: dict(window_size=(seqlen_k // 3, seqlen_k // 5)),
    "softcap": lambda batch, heads, seqlen_k, device: dict(softcap=1.5),
    "alibi": lambda batch, heads, seqlen_k, device: dict(
        alibi_slopes=torch.rand(batch, heads, device=device) * 0.3),
    "dropout": lambda batch, heads, seqlen_k, device: dict(dropout_p=0.17, deterministic=True),
    "all": lambda batch, heads, seqlen_k, device: dict(
        window_size=(seqlen_k // 2, 3), softcap=1.5, alibi_slopes=torch.rand(heads, device=device) * 0.3,
        dropout_p=0.17, deterministic=True),
}
OPTION_NAMES = [name for name, _ in _OPTIONS]
# The grid's options (canonical values: -1 for an unbounded side, softcap >= 0) have the same names and meanings
# as flash_ext's keywords, so the flash_ext call a flash-attn call maps to takes them as they are.


def positional_options(options, return_attn_probs):
    """dropout_p .. return_attn_probs as flash-attn's positional arguments."""
    defaults = dict(_OPTIONS)
    values = {**defaults, **options, "return_attn_probs": return_attn_probs}
    return [values[name] for name in OPTION_NAMES]


def fresh_seed():
    """A seed drawn from the test's own seeded stream, to replay one call's dropout mask in another."""
    return int(torch.randint(0, 2**62, ()))


def packed_leaves(packing, q, k, v, dim):
    """The autograd leaves a flash-attn caller holds: (q, k, v), (q, kv) or (qkv,), packed along dim; and
    the function that turns their gradients into (dq, dk, dv)."""
    if packing == "qkv":
        leaves = [torch.stack((q, k, v), dim).requires_grad_()]
        return leaves, lambda grads: grads[0].unbind(dim)
    if packing == "kv":
        leaves = [q.clone().requires_grad_(), torch.stack((k, v), dim).requires_grad_()]
        return leaves, lambda grads: (grads[0], *grads[1].unbind(dim))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return leaves, tuple


DENSE_FUNCTIONS = {"unpacked": flash_attn_func, "kv": flash_attn_kvpacked_func, "qkv": flash_attn_qkvpacked_func}


def check_dense_call(packing, q, k, v, options):
    """flash-attn's call with every argument positional: the result's form, out bit for bit equal to
    flash_ext.attention's with the same options (and the same seed), out / softmax_lse and the gradients of the
    packed leaves against the float64 reference."""
    dropout = options.get("dropout_p", 0.0) > 0
    leaves, unpack = packed_leaves(packing, q, k, v, dim=2)
    seed = fresh_seed()
    torch.manual_seed(seed)
    result = DENSE_FUNCTIONS[packing](*leaves, *positional_options(options, return_attn_probs=not dropout))
    torch.manual_seed(seed)
    with torch.no_grad():
        out_ext, lse_ext, rng_state = attention_with_rng_state(q, k, v, **options)
    if dropout:
        out, lse = result, lse_ext
    else:
        out, lse, probs = result
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
        assert not lse.requires_grad
        assert probs.shape == (0,) and probs.dtype == q.dtype and probs.device == q.device
        assert torch.equal(lse, lse_ext)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out.detach(), out_ext), "out differs from flash_ext.attention's with the same options"

    features = {name: value for name, value in options.items() if name not in ("causal", "softmax_scale")}
    reference = reference_options(features, rng_state, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    common = dict(causal=options.get("causal", False), softmax_scale=options.get("softmax_scale"))
    assert_forward_within_tolerance(out, lse, attention_ref, q, k, v, **common, **reference)
    dout = torch.randn_like(out)
    grads = unpack(torch.autograd.grad(out, leaves, dout))
    assert_gradients_within_tolerance(grads, dout, attention_ref, (q, k, v), **common, **reference)


# The seqlens of flash-attn's grid, smaller: a single query, a single key, 17 and 129 (tiles of 64 and a
# remainder), seqlen_q < seqlen_k and seqlen_q > seqlen_k (rows that see no key under causal masks).
CPU_SEQLENS = [(1, 1), (1, 129), (17, 129), (129, 17)]
CUDA_SEQLENS = [(1, 239), (113, 203), (239, 1), (512, 256), (1023, 1024)]
PACKINGS = ["unpacked", "kv"]


@parametrize_devices(
    cpu=dict(packing=PACKINGS, mha_type=list(MHA_TYPES), causal=CAUSAL, seqlens=CPU_SEQLENS, feature=list(FEATURES),
             dtype=[torch.float32], head_dim=[59]),
    cuda=dict(packing=PACKINGS, mha_type=list(MHA_TYPES), causal=CAUSAL, seqlens=CUDA_SEQLENS,
              feature=list(FEATURES), dtype=[torch.bfloat16], head_dim=[59, 128]),
)
def test_dense(device, packing, mha_type, causal, seqlens, feature, dtype, head_dim):
    heads_q, heads_kv = MHA_TYPES[mha_type]
    q, k, v = make_qkv(2, *seqlens, heads_q, heads_kv, head_dim, dtype, device=device)
    check_dense_call(packing, q, k, v, dict(causal=causal, **FEATURES[feature](2, heads_q, seqlens[1], device)))


@parametrize_devices(
    cpu=dict(causal=CAUSAL, seqlen=[1, 17, 129], feature=list(FEATURES), dtype=[torch.float32], head_dim=[59]),
    cuda=dict(causal=CAUSAL, seqlen=[97, 512], feature=list(FEATURES), dtype=CUDA_DTYPES, head_dim=[64, 128]),
)
def test_qkvpacked(device, causal, seqlen, feature, dtype, head_dim):
    """flash_attn_qkvpacked_func: one head count and one seqlen for q, k and v, as flash-attn's layout forces."""
    q, k, v = make_qkv(2, seqlen, seqlen, 4, 4, head_dim, dtype, device=device)
    check_dense_call("qkv", q, k, v, dict(causal=causal, **FEATURES[feature](2, 4, seqlen, device)))


# flash-attn's head dims: multiples of 8 and 32, and 59 and 111 (padded on CUDA).
@parametrize_devices(
    cpu=dict(head_dim=[32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256], dtype=[torch.bfloat16]),
    cuda=dict(head_dim=[32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256], dtype=CUDA_DTYPES),
)
def test_head_dims(device, head_dim, dtype):
    q, k, v = make_qkv(2, 17, 129, 4, 2, head_dim, dtype, device=device)
    check_dense_call("kv", q, k, v, dict(causal=True, window_size=(40, 5), softcap=1.5))


# ---- Variable-length batches ------------------------------------------------------------------------

VARLEN_FUNCTIONS = {"unpacked": flash_attn_varlen_func, "kv": flash_attn_varlen_kvpacked_func,
                    "qkv": flash_attn_varlen_qkvpacked_func}


def varlen_lengths(seqlen_q, seqlen_k, same):
    """Three sequences, the first as long as the grid's seqlens (as flash-attn's random padding masks keep
    some full rows), the others shorter; the same lengths for queries and keys when same."""
    lengths_q = [seqlen_q, (seqlen_q + 1) // 2, 1]
    lengths_k = lengths_q if same else [seqlen_k, seqlen_k // 3 + 1, seqlen_k]
    return lengths_q, lengths_k


def check_varlen_call(packing, q, k, v, cu_q, cu_k, options):
    """check_dense_call's checks for a varlen call (all arguments positional)."""
    dropout = options.get("dropout_p", 0.0) > 0
    max_q, max_k = max_seqlen(cu_q), max_seqlen(cu_k)
    leaves, unpack = packed_leaves(packing, q, k, v, dim=1)
    indices = [cu_q, max_q] if packing == "qkv" else [cu_q, cu_k, max_q, max_k]
    seed = fresh_seed()
    torch.manual_seed(seed)
    result = VARLEN_FUNCTIONS[packing](*leaves, *indices, *positional_options(options, return_attn_probs=not dropout))
    torch.manual_seed(seed)
    with torch.no_grad():
        out_ext, lse_ext, rng_state = attention_varlen_with_rng_state(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    if dropout:
        out, lse = result, lse_ext
    else:
        out, lse, probs = result
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32  # (nheads, total_q)
        assert probs.shape == (0,) and probs.dtype == q.dtype
        assert torch.equal(lse, lse_ext)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out.detach(), out_ext), "out differs from flash_ext.attention_varlen's with the same options"

    features = {name: value for name, value in options.items() if name not in ("causal", "softmax_scale")}
    reference = reference_options(features, rng_state, len(cu_q) - 1, q.shape[1], max_q, max_k)
    common = dict(causal=options.get("causal", False), softmax_scale=options.get("softmax_scale"))
    assert_forward_within_tolerance(out, lse, attention_varlen_ref, q, k, v, cu_q, cu_k, **common, **reference)
    dout = torch.randn_like(out)
    grads = unpack(torch.autograd.grad(out, leaves, dout))
    assert_gradients_within_tolerance(grads, dout, attention_varlen_ref, (q, k, v), cu_q, cu_k, **common,
                                      **reference)


@parametrize_devices(
    # MHA: test_varlen_qkvpacked.
    cpu=dict(packing=PACKINGS, mha_type=["gqa", "mqa"], causal=CAUSAL, seqlens=[(1, 129), (17, 129), (129, 17)],
             feature=list(FEATURES), dtype=[torch.float32], head_dim=[59]),
    cuda=dict(packing=PACKINGS, mha_type=list(MHA_TYPES), causal=CAUSAL, seqlens=[(1, 147), (113, 203), (512, 256)],
              feature=list(FEATURES), dtype=[torch.bfloat16], head_dim=[59, 128]),
)
def test_varlen(device, packing, mha_type, causal, seqlens, feature, dtype, head_dim):
    heads_q, heads_kv = MHA_TYPES[mha_type]
    lengths_q, lengths_k = varlen_lengths(*seqlens, same=False)
    q, k, v, cu_q, cu_k = make_varlen_qkv(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, device=device)
    options = dict(causal=causal, **FEATURES[feature](3, heads_q, max(lengths_k), device))
    check_varlen_call(packing, q, k, v, cu_q, cu_k, options)


@parametrize_devices(
    cpu=dict(causal=CAUSAL, seqlen=[17, 129], feature=list(FEATURES), dtype=[torch.float32], head_dim=[59]),
    cuda=dict(causal=CAUSAL, seqlen=[128, 300], feature=list(FEATURES), dtype=CUDA_DTYPES, head_dim=[64, 128]),
)
def test_varlen_qkvpacked(device, causal, seqlen, feature, dtype, head_dim):
    lengths, _ = varlen_lengths(seqlen, seqlen, same=True)
    q, k, v, cu, _ = make_varlen_qkv(lengths, lengths, 4, 4, head_dim, dtype, device=device)
    check_varlen_call("qkv", q, k, v, cu, cu, dict(causal=causal, **FEATURES[feature](3, 4, seqlen, device)))


# ---- Keyword calls and flash-attn's conventions -------------------------------------------------------


def test_keyword_calls_equal_positional_calls():
    q, k, v = make_qkv(2, 33, 70, 6, 2, 40, torch.float32)
    slopes = torch.rand(6) * 0.3
    positional = flash_attn_func(q, k, v, 0.0, 0.2, True, (20, 0), 3.0, slopes, False, True)
    keywords = flash_attn_func(q, k, v, causal=True, softmax_scale=0.2, window_size=(20, 0), softcap=3.0,
                               alibi_slopes=slopes, return_attn_probs=True)
    ext = flash_ext.attention(q, k, v, causal=True, softmax_scale=0.2, window_size=(20, 0), softcap=3.0,
                              alibi_slopes=slopes, return_lse=True)
    for a, b, c in zip(positional, keywords, ext):
        assert torch.equal(a, b) and torch.equal(a, c)
    # The common short forms of flash-attn callers.
    assert torch.equal(flash_attn_func(q, k, v, 0.0, None, True), flash_ext.attention(q, k, v, causal=True))
    assert torch.equal(flash_attn_func(q, k, v), flash_ext.attention(q, k, v))
    assert torch.equal(flash_attn_func(q, k, v, window_size=[5, 5]),
                       flash_ext.attention(q, k, v, window_size=(5, 5)))


def test_varlen_keyword_call_as_transformers_writes_it():
    q, k, v, cu_q, cu_k = make_varlen_qkv([5, 40, 1], [9, 40, 30], 4, 2, 32, torch.float32)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40, max_seqlen_k=40,
                                 dropout_p=0.0, softmax_scale=None, causal=True, window_size=(7, 7), softcap=0.0,
                                 deterministic=False)
    assert torch.equal(out, flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 40, 40, causal=True, window_size=(7, 7)))


@pytest.mark.parametrize("window_size,canonical", [((-5, 0), (-1, 0)), ((-1, -2), (-1, -1)), ((3, -100), (3, -1))])
def test_any_negative_window_side_is_unbounded(window_size, canonical):
    q, k, v = make_qkv(1, 30, 45, 2, 2, 16, torch.float32)
    assert torch.equal(flash_attn_func(q, k, v, window_size=window_size),
                       flash_ext.attention(q, k, v, window_size=canonical))


def test_softcap_at_or_below_zero_is_off():
    q, k, v = make_qkv(1, 30, 45, 2, 2, 16, torch.float32)
    plain = flash_ext.attention(q, k, v)
    for softcap in (0.0, -1.0, -30):
        assert torch.equal(flash_attn_func(q, k, v, softcap=softcap), plain)


def test_alibi_slopes_that_require_grad_get_none():
    """flash-attn returns no gradient for the slopes; q, k and v still get theirs."""
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 20, 30, 4, 2, 16, torch.float32))
    slopes = (torch.rand(4) * 0.3).requires_grad_()
    out = flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), 0.0, slopes)
    assert torch.equal(out.detach(), flash_ext.attention(q.detach(), k.detach(), v.detach(), causal=True,
                                                         alibi_slopes=slopes.detach()))
    out.sum().backward()
    assert slopes.grad is None
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


# ---- What flash_ext cannot return ---------------------------------------------------------------------


def all_calls(dropout_p, return_attn_probs):
    """One call of each of the six training functions, with these two arguments."""
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float32)
    q1, k1, v1, cu, _ = make_varlen_qkv([3, 5], [3, 5], 2, 2, 16, torch.float32)
    options = dict(dropout_p=dropout_p, return_attn_probs=return_attn_probs)
    return {
        "flash_attn_func": lambda: flash_attn_func(q, k, v, **options),
        "flash_attn_kvpacked_func": lambda: flash_attn_kvpacked_func(q, torch.stack((k, v), 2), **options),
        "flash_attn_qkvpacked_func": lambda: flash_attn_qkvpacked_func(torch.stack((q, k, v), 2), **options),
        "flash_attn_varlen_func": lambda: flash_attn_varlen_func(q1, k1, v1, cu, cu, 5, 5, **options),
        "flash_attn_varlen_kvpacked_func": lambda: flash_attn_varlen_kvpacked_func(
            q1, torch.stack((k1, v1), 1), cu, cu, 5, 5, **options),
        "flash_attn_varlen_qkvpacked_func": lambda: flash_attn_varlen_qkvpacked_func(
            torch.stack((q1, k1, v1), 1), cu, 5, **options),
    }


def test_attn_probs_with_dropout_is_an_error():
    """flash-attn returns S_dmask (the probabilities, dropout in the sign bits) when dropout_p > 0; flash_ext
    never materialises them, and says so instead of returning something else."""
    for name, call in all_calls(0.1, True).items():
        with pytest.raises(NotImplementedError, match=rf"{name}: return_attn_probs=True with dropout_p > 0 .*S_dmask"):
            call()
    for name, call in all_calls(0.1, False).items():
        assert isinstance(call(), torch.Tensor), name


def test_attn_probs_without_dropout_returns_flash_attns_triple():
    for name, call in all_calls(0.0, True).items():
        out, lse, probs = call()
        assert probs.shape == (0,) and probs.dtype == out.dtype, name
        assert lse.dtype == torch.float32 and torch.isfinite(lse).all(), name


@pytest.mark.parametrize("argument,value,message", [
    ("return_attn_probs", 1, "return_attn_probs must be a bool"),
    ("dropout_p", "0.1", "dropout_p must be a real number"),
    ("window_size", (1.5, 0), r"window_size\[0\] must be an int"),
    ("softcap", "x", "softcap must be a real number"),
])
def test_bad_options_name_the_argument(argument, value, message):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float32)
    with pytest.raises(TypeError, match=message):
        flash_attn_func(q, k, v, **{argument: value})


@pytest.mark.parametrize("call,message", [
    (lambda t: flash_attn_qkvpacked_func(t.new_zeros(1, 8, 2, 2, 16)),
     r"qkv must have shape \(batch_size, seqlen, 3, nheads, headdim\), got \(1, 8, 2, 2, 16\)"),
    (lambda t: flash_attn_qkvpacked_func(t.new_zeros(8, 3, 2, 16)), r"qkv must have shape \(batch_size"),
    (lambda t: flash_attn_kvpacked_func(t.new_zeros(1, 8, 2, 16), t.new_zeros(1, 8, 3, 2, 16)),
     r"kv must have shape \(batch_size, seqlen_k, 2, nheads_k, headdim\)"),
    (lambda t: flash_attn_varlen_qkvpacked_func(t.new_zeros(8, 2, 2, 16), t.new_tensor([0, 8]).int(), 8),
     r"qkv must have shape \(total, 3, nheads, headdim\)"),
    (lambda t: flash_attn_varlen_kvpacked_func(t.new_zeros(8, 2, 16), t.new_zeros(1, 8, 2, 2, 16),
                                               t.new_tensor([0, 8]).int(), t.new_tensor([0, 8]).int(), 8, 8),
     r"kv must have shape \(total_k, 2, nheads_k, headdim\)"),
    (lambda t: flash_attn_kvpacked_func(t.new_zeros(1, 8, 2, 16), [1, 2]), "kv must be a torch.Tensor"),
])
def test_packed_shapes_are_checked(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(torch.zeros(()))


# ---- Paged varlen (forward only) ----------------------------------------------------------------------


def test_varlen_block_table():
    """flash-attn 2.8's paged varlen prefill: the keys of sequence b in the pages block_table[b]."""
    page_size, lengths_q, lengths_k = 16, [3, 20], [40, 20]
    q = torch.randn(sum(lengths_q), 4, 32)
    k_pool, v_pool = torch.randn(9, page_size, 2, 32), torch.randn(9, page_size, 2, 32)
    block_table = torch.tensor([[4, 1, 7], [2, 8, -1]], dtype=torch.int32)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    out, lse, probs = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 20, 40, 0.0, None, True, (-1, -1), 0.0,
                                             None, False, True, block_table)
    assert probs.shape == (0,)
    assert torch.equal(out, flash_ext.attention_varlen(q, k_pool, v_pool, cu_q, cu_k, 20, 40, causal=True,
                                                       block_table=block_table))
    assert_forward_within_tolerance(out, lse, attention_varlen_ref, q, k_pool, v_pool, cu_q, cu_k, causal=True,
                                    block_table=block_table)
    with pytest.raises(RuntimeError, match="block_table is forward only.*q requires grad"):
        flash_attn_varlen_func(q.requires_grad_(), k_pool, v_pool, cu_q, cu_k, 20, 40, block_table=block_table)


# ---- flash_attn_with_kvcache --------------------------------------------------------------------------


def kvcache_case(*, batch=2, seqlen_q, heads=(4, 2), head_dim=32, dtype, device, seqlen_cache=48, seqlen_new=3,
                 page_size=None, rotary=False, rotary_interleaved=True, alibi=False, **options):
    """(positional arguments of flash-attn's flash_attn_with_kvcache, the same as attention_with_kvcache_ref's
    keywords): caches of seqlen_cache positions (pages of page_size, shuffled, when paged) filled up to 5 and 17."""
    heads_q, heads_kv = heads
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype)
    if page_size is None:
        cache_shape, block_table = (batch, seqlen_cache, heads_kv, head_dim), None
    else:
        blocks = math.ceil(seqlen_cache / page_size)
        cache_shape = (batch * blocks + 2, page_size, heads_kv, head_dim)
        block_table = torch.randperm(batch * blocks + 2)[:batch * blocks].view(batch, blocks).int()
    k_cache, v_cache = torch.randn(cache_shape, dtype=dtype), torch.randn(cache_shape, dtype=dtype)
    k, v = (torch.randn(batch, seqlen_new, heads_kv, head_dim, dtype=dtype) for _ in range(2)) if seqlen_new \
        else (None, None)
    cos = sin = None
    if rotary:
        angles = torch.rand(seqlen_cache, head_dim // 4) * 2 * math.pi  # rotary_dim = head_dim / 2
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache_seqlens = torch.tensor([5, 17][:batch], dtype=torch.int32)
    slopes = torch.rand(batch, heads_q) * 0.3 if alibi else None
    causal, window_size, softcap = options.get("causal", False), options.get("window_size", (-1, -1)), \
        options.get("softcap", 0.0)
    to = (lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
    positional = [to(t) for t in (q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, None, None, block_table,
                                  None, causal, window_size, softcap, rotary_interleaved, slopes, 0, True)]
    reference = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary_interleaved,
                     cache_seqlens=cache_seqlens, block_table=block_table, causal=causal, window_size=window_size,
                     softcap=softcap, alibi_slopes=slopes)
    return positional, (q, k_cache, v_cache), reference


KVCACHE_CASES = {
    "decode": dict(seqlen_q=1, causal=True),
    "decode-gqa-rotary": dict(seqlen_q=1, causal=True, rotary=True, rotary_interleaved=False),
    "mqa-paged": dict(seqlen_q=1, heads=(4, 1), page_size=16, causal=True),
    "prefix-window-softcap": dict(seqlen_q=17, seqlen_new=17, causal=True, window_size=(9, 0), softcap=1.5),
    "prefix-paged-rotary-alibi": dict(seqlen_q=17, seqlen_new=17, page_size=16, causal=True, rotary=True,
                                      alibi=True),
    "no-new-keys": dict(seqlen_q=3, seqlen_new=0, window_size=(4, 2)),
}


@parametrize_devices(
    cpu=dict(case=list(KVCACHE_CASES), dtype=[torch.float32], head_dim=[32]),
    cuda=dict(case=list(KVCACHE_CASES), dtype=CUDA_DTYPES, head_dim=[59, 128]),
)
def test_with_kvcache(device, case, dtype, head_dim):
    """All arguments positional, as flash-attn code writes them: out and softmax_lse against the reference, the
    caches updated in place as the reference updates its copies."""
    positional, originals, reference = kvcache_case(**KVCACHE_CASES[case], head_dim=head_dim, dtype=dtype,
                                                    device=device)
    originals = [t.clone() for t in originals]
    out, lse = flash_attn_with_kvcache(*positional)
    q = positional[0]
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    with torch.no_grad():
        out64, lse64, k_ref, v_ref = attention_with_kvcache_ref(*originals, **reference)
        out_lowp, lse_lowp, _, _ = attention_with_kvcache_ref(*originals, upcast=False, **reference)
    assert_within_tolerance("out", out.cpu(), out_lowp, out64, FWD_FACTOR)
    assert_within_tolerance("lse", lse.cpu(), lse_lowp, lse64, FWD_FACTOR)
    # Rotary rounds once in either implementation; without it, the appended keys are copied exactly.
    tolerance = dict(rtol=0, atol=0) if reference["rotary_cos"] is None else {}
    torch.testing.assert_close(positional[1].cpu(), k_ref, **tolerance)
    torch.testing.assert_close(positional[2].cpu(), v_ref, **tolerance)


def test_with_kvcache_keywords_and_grad_mode():
    """Keywords as flash-attn callers pass them; q requiring grad in grad mode is no error and the output carries
    no gradient, as flash-attn's; out (not lse) unless return_softmax_lse."""
    positional, originals, _ = kvcache_case(seqlen_q=1, causal=True, dtype=torch.float32, device="cpu")
    q, k_cache, v_cache, k, v = positional[:5]
    caches = [t.clone() for t in (k_cache, v_cache)]
    q = q.clone().requires_grad_()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=positional[7], causal=True)
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    expected = flash_ext.attention_with_kvcache(q.detach(), *caches, k, v, cache_seqlens=positional[7], causal=True)
    assert torch.equal(out, expected)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    with pytest.raises(TypeError, match="return_softmax_lse must be a bool"):
        flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse="yes")


def test_with_kvcache_int_cache_seqlens_and_flash_attn_conventions():
    positional, _, _ = kvcache_case(seqlen_q=4, seqlen_new=0, dtype=torch.float32, device="cpu")
    q, k_cache, v_cache = positional[:3]
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, window_size=(-3, -7), softcap=-1.0,
                                       return_softmax_lse=True)
    expected = flash_ext.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, return_lse=True)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


# ---- torch.compile ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_torch_compile_fullgraph():
    """The functions trace into one graph with their backward: the same results as eager, bit for bit."""
    qkv = torch.randn(2, 40, 3, 4, 32)
    slopes = torch.rand(4) * 0.3

    def loss(qkv):
        out = flash_attn_qkvpacked_func(qkv, 0.0, None, True, (16, 0), 2.0, slopes)
        q, kv = qkv[:, :, 0], qkv[:, :, 1:]
        out2, lse, _ = flash_attn_kvpacked_func(q, kv, window_size=[-2, 4], return_attn_probs=True)
        return (out * out2).sum() + lse.sum()

    results = {}
    for name, fn in (("eager", loss), ("compiled", torch.compile(loss, fullgraph=True, backend="aot_eager"))):
        leaf = qkv.clone().requires_grad_()
        value = fn(leaf)
        value.backward()
        results[name] = (value.detach(), leaf.grad)
    for eager, compiled in zip(results["eager"], results["compiled"]):
        assert torch.equal(eager, compiled)
