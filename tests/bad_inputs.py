"""Bad calls and the errors they must raise, shared by the tests of the messages (test_api.py,
test_features_api.py) and the test that the real op and its fake raise alike (test_check_parity.py).

Each case is (id, make, error type, fragment of the message that names the argument):
make() returns (function, args, kwargs), on CPU tensors. Cases marked VALUES need the values of
cu_seqlens, which only the C++ op reads (a fake cannot).
"""
import math

import torch

import flash_ext
from make_inputs import make_qkv, make_varlen_qkv


def randn(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


def dense(q, k, v, **kwargs):
    return lambda: (flash_ext.attention, (q(), k(), v()), kwargs)


def dense_args():
    q, k, v = make_qkv(2, 6, 7, 4, 2, 16, torch.float32)
    return (q, k, v), {}


def varlen_args():
    q, k, v, cu_q, cu_k = make_varlen_qkv([3, 0, 5], [4, 2, 1], 4, 2, 16, torch.float32)
    return (q, k, v, cu_q, cu_k, 5, 4), {}


def varlen_args_without_kv_heads():
    (q, k, v, *layout), kwargs = varlen_args()
    return (q, k[:, :0], v[:, :0], *layout), kwargs


def with_kwargs(make_args, **kwargs):
    def make():
        args, base = make_args()
        function = flash_ext.attention_varlen if len(args) > 3 else flash_ext.attention
        return function, args, {**base, **kwargs}
    return make


def with_arg(make_args, index, make_value):
    def make():
        args, kwargs = make_args()
        args = list(args)
        args[index] = make_value(args)
        function = flash_ext.attention_varlen if len(args) > 3 else flash_ext.attention
        return function, tuple(args), kwargs
    return make


# Modifiers of a valid call's (args list, kwargs dict), for error tables that spoil one call several ways
# (test_kvcache.py, test_varlen_paged.py).
def replace_arg(index, make):
    def modify(args, kwargs):
        args[index] = make(args[index])
    return modify


def set_kwargs(**changes):
    def modify(args, kwargs):
        kwargs.update(changes)
    return modify


def all_of(*modifiers):
    def modify(args, kwargs):
        for m in modifiers:
            m(args, kwargs)
    return modify


def shape(*dims, dtype=torch.float32):
    return lambda: randn(*dims, dtype=dtype)


def ints(*dims):
    return lambda: torch.randint(-5, 5, dims, dtype=torch.int32)


# The tensors: dtypes, ranks, shapes, heads, head_dim; softmax_scale's range.
BAD_TENSORS = [
    ("q-float64", dense(shape(1, 4, 2, 16, dtype=torch.float64), shape(1, 4, 2, 16, dtype=torch.float64),
                        shape(1, 4, 2, 16, dtype=torch.float64)), RuntimeError, "q has dtype Double"),
    ("q-int32", dense(ints(1, 4, 2, 16), ints(1, 4, 2, 16), ints(1, 4, 2, 16)), RuntimeError, "q has dtype Int"),
    ("k-dtype-differs", dense(shape(1, 4, 2, 16), shape(1, 4, 2, 16, dtype=torch.float16), shape(1, 4, 2, 16)),
     RuntimeError, "k has dtype Half but q has Float"),
    ("v-dtype-differs", dense(shape(1, 4, 2, 16, dtype=torch.bfloat16), shape(1, 4, 2, 16, dtype=torch.bfloat16),
                              shape(1, 4, 2, 16)), RuntimeError, "v has dtype Float but q has BFloat16"),
    ("q-rank-3", dense(shape(4, 2, 16), shape(1, 4, 2, 16), shape(1, 4, 2, 16)), RuntimeError,
     "q must have 4 dimensions"),
    ("k-rank-5", dense(shape(1, 4, 2, 16), shape(1, 1, 4, 2, 16), shape(1, 4, 2, 16)), RuntimeError,
     "k must have 4 dimensions"),
    ("v-rank-3", dense(shape(1, 4, 2, 16), shape(1, 4, 2, 16), shape(4, 2, 16)), RuntimeError,
     "v must have 4 dimensions"),
    ("batch-differs", dense(shape(2, 4, 2, 16), shape(3, 4, 2, 16), shape(3, 4, 2, 16)), RuntimeError,
     "k has batch 3 but q has batch 2"),
    ("head-dim-differs", dense(shape(1, 4, 2, 16), shape(1, 4, 2, 32), shape(1, 4, 2, 32)), RuntimeError,
     "k has head_dim 32 but q has head_dim 16"),
    ("k-v-seqlen-differ", dense(shape(1, 4, 2, 16), shape(1, 5, 2, 16), shape(1, 6, 2, 16)), RuntimeError,
     "k and v must have the same shape"),
    ("k-v-heads-differ", dense(shape(1, 4, 2, 16), shape(1, 5, 2, 16), shape(1, 5, 1, 16)), RuntimeError,
     "k and v must have the same shape"),
    ("heads-not-multiple", dense(shape(1, 4, 3, 16), shape(1, 4, 2, 16), shape(1, 4, 2, 16)), RuntimeError,
     "heads_q (q.size(2) = 3) must be a multiple of heads_kv (k.size(2) = 2)"),
    ("heads-kv-zero", dense(shape(1, 4, 2, 16), shape(1, 4, 0, 16), shape(1, 4, 0, 16)), RuntimeError,
     "k and v have 0 heads (k.size(2)) but q has 2; heads_kv must be >= 1"),
    ("head-dim-257", dense(shape(1, 4, 2, 257), shape(1, 4, 2, 257), shape(1, 4, 2, 257)), RuntimeError,
     "head_dim (last dimension of q) must be in 1..256, got 257"),
    ("head-dim-0", dense(shape(1, 4, 2, 0), shape(1, 4, 2, 0), shape(1, 4, 2, 0)), RuntimeError,
     "head_dim (last dimension of q) must be in 1..256, got 0"),
] + [
    (f"softmax-scale-{scale}", dense(shape(1, 4, 2, 16), shape(1, 4, 2, 16), shape(1, 4, 2, 16), softmax_scale=scale),
     RuntimeError, "softmax_scale must be a finite positive number")
    for scale in (-0.5, 0.0, math.nan, math.inf, -math.inf)
]

# The feature options and attention_varlen's arguments.
BAD_OPTIONS = [
    ("window-left-minus-2", with_kwargs(dense_args, window_size=(-2, 0)), RuntimeError, "window_size[0]"),
    ("window-right-minus-5", with_kwargs(dense_args, window_size=(3, -5)), RuntimeError, "window_size[1]"),
    ("window-left-past-int32", with_kwargs(dense_args, window_size=(2**31, 0)), RuntimeError, "window_size[0]"),
    ("softcap-negative", with_kwargs(dense_args, softcap=-1.0), RuntimeError,
     "softcap must be 0 (off) or a finite positive"),
    ("softcap-nan", with_kwargs(dense_args, softcap=float("nan")), RuntimeError,
     "softcap must be 0 (off) or a finite positive"),
    ("dropout-negative", with_kwargs(dense_args, dropout_p=-0.1), RuntimeError, "dropout_p must be in [0, 1)"),
    ("dropout-one", with_kwargs(dense_args, dropout_p=1.0), RuntimeError, "dropout_p must be in [0, 1)"),
    ("alibi-float64", with_kwargs(dense_args, alibi_slopes=torch.ones(4, dtype=torch.float64)), RuntimeError,
     "alibi_slopes must be float32"),
    ("alibi-wrong-heads", with_kwargs(dense_args, alibi_slopes=torch.ones(3)), RuntimeError,
     "alibi_slopes must have shape"),
    ("alibi-wrong-batch", with_kwargs(dense_args, alibi_slopes=torch.ones(3, 4)), RuntimeError,
     "alibi_slopes must have shape"),
    ("alibi-rank-3", with_kwargs(dense_args, alibi_slopes=torch.ones(2, 4, 1)), RuntimeError,
     "alibi_slopes must have shape"),
    ("varlen-alibi-wrong-batch", with_kwargs(varlen_args, alibi_slopes=torch.ones(2, 4)), RuntimeError,
     "alibi_slopes must have shape"),
    ("varlen-window", with_kwargs(varlen_args, window_size=(0, -3)), RuntimeError, "window_size[1]"),
    ("varlen-q-rank-4", with_arg(varlen_args, 0, lambda a: a[0][None]), RuntimeError, "q must have 3 dimensions"),
    ("varlen-k-rank-2", with_arg(varlen_args, 1, lambda a: a[1][0]), RuntimeError, "k must have 3 dimensions"),
    ("varlen-heads-kv-zero", with_kwargs(varlen_args_without_kv_heads), RuntimeError,
     "k and v have 0 heads (k.size(1)) but q has 4; heads_kv must be >= 1"),
    ("cu-seqlens-q-int64", with_arg(varlen_args, 3, lambda a: a[3].long()), RuntimeError,
     "cu_seqlens_q must be int32"),
    ("cu-seqlens-k-float", with_arg(varlen_args, 4, lambda a: a[4].float()), RuntimeError,
     "cu_seqlens_k must be int32"),
    ("cu-seqlens-q-2d", with_arg(varlen_args, 3, lambda a: a[3][None]), RuntimeError, "cu_seqlens_q must be 1-D"),
    ("cu-seqlens-k-length", with_arg(varlen_args, 4, lambda a: a[4][:3]), RuntimeError, "cu_seqlens_k has 3 entries"),
    ("max-seqlen-k-negative", with_arg(varlen_args, 6, lambda a: -1), RuntimeError,
     "max_seqlen_k must be in 0..2^31-1"),
]

# Checks of cu_seqlens' values: the C++ op only.
VALUES = [
    ("cu-seqlens-q-start", with_arg(varlen_args, 3, lambda a: a[3] + 1), RuntimeError, "cu_seqlens_q[0] must be 0"),
    ("cu-seqlens-k-decreasing", with_arg(varlen_args, 4, lambda a: torch.tensor([0, 4, 3, 7], dtype=torch.int32)),
     RuntimeError, "cu_seqlens_k must be non-decreasing"),
    ("cu-seqlens-q-end", with_arg(varlen_args, 3, lambda a: torch.tensor([0, 3, 3, 7], dtype=torch.int32)),
     RuntimeError, "cu_seqlens_q[-1] must equal total_q"),
    ("max-seqlen-q-too-small", with_arg(varlen_args, 5, lambda a: 4), RuntimeError,
     "max_seqlen_q must be at least the longest"),
]


def valid_bwd_args(dtype=torch.float32):
    q, k, v = make_qkv(2, 5, 7, 4, 2, 16, dtype)
    out, lse = flash_ext.attention(q, k, v, return_lse=True)
    return dict(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, lse=lse,
                softmax_scale=0.25, causal=False, deterministic=False)


def bwd_with(argument, make_bad_value):
    def make():
        args = valid_bwd_args()
        args[argument] = make_bad_value(args)
        return torch.ops.flash_ext.bwd, (), args
    return make


# torch.ops.flash_ext.bwd called directly.
BAD_BWD_INPUTS = [
    ("dout-shape", bwd_with("dout", lambda a: a["dout"][:, :4]), RuntimeError,
     "dout must match q in shape, dtype and device"),
    ("dout-dtype", bwd_with("dout", lambda a: a["dout"].half()), RuntimeError,
     "dout must match q in shape, dtype and device"),
    ("out-shape", bwd_with("out", lambda a: a["out"][:, :, :2]), RuntimeError,
     "out must match q in shape, dtype and device"),
    ("out-dtype", bwd_with("out", lambda a: a["out"].bfloat16()), RuntimeError,
     "out must match q in shape, dtype and device"),
    ("lse-shape", bwd_with("lse", lambda a: a["lse"].transpose(1, 2)), RuntimeError,
     "lse must be float32 of shape (batch, heads_q, seqlen_q)"),
    ("lse-dtype", bwd_with("lse", lambda a: a["lse"].double()), RuntimeError,
     "lse must be float32 of shape (batch, heads_q, seqlen_q)"),
    ("k-shape", bwd_with("k", lambda a: a["k"][:, :, :1]), RuntimeError, "k and v must have the same shape"),
    ("softmax-scale", bwd_with("softmax_scale", lambda a: -1.0), RuntimeError,
     "softmax_scale must be a finite positive number"),
    ("dropout-without-rng-state", bwd_with("dropout_p", lambda a: 0.2), RuntimeError, "needs rng_state"),
]


def ids(cases):
    return [case[0] for case in cases]


def params(cases):
    return [case[1:] for case in cases]
