"""flash_ext.attention_with_kvcache on the CPU and on CUDA (float16 / bfloat16; parameters marked `cuda`):
out and lse against attention_with_kvcache_ref (the tolerance rule of tests/tolerance.py; the reference runs on
the CPU), the caches updated exactly where the reference updates them and bitwise untouched elsewhere, every
option alone and in combinations, bad inputs (op and fake alike, CPU), the forward-only error, torch.compile,
a greedy decode loop that matches recomputing full attention at each step, and (CUDA) a decode loop captured
in a CUDA graph whose device cache_seqlens advance between replays."""
import math

import pytest
import torch

import flash_ext
from bad_inputs import all_of, replace_arg, set_kwargs
from devices import named, parametrize_devices
from flash_ext.reference import apply_rotary_ref, attention_with_kvcache_ref
from tolerance import EPS, FWD_FACTOR, assert_within_tolerance

CUDA_DTYPES = [torch.float16, torch.bfloat16]


def make_case(*, batch=2, seqlen_q=3, heads_q=4, heads_kv=2, head_dim=32, dtype=torch.float32, seqlen_cache=40,
              seqlen_new=3, cache_seqlens=(5, 11), page_size=None, batch_cache=None, batch_idx=False, leftpad=None,
              rotary_dim=None, rotary_interleaved=True, alibi=None, seqlens_as_int=False, device="cpu", **options):
    """(args, kwargs) of one call. With page_size, the caches are pages of that size (a shuffled block table
    holding ceil(seqlen_cache / page_size) pages per sequence, plus unused pages); with batch_idx, the cache
    has two more rows than the batch and each sequence gets a shuffled one. Made on the CPU, then moved to
    device."""
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype)
    kwargs = dict(options)
    if page_size is not None:
        max_blocks = math.ceil(seqlen_cache / page_size)
        num_blocks = batch * max_blocks + 3
        kwargs["block_table"] = torch.randperm(num_blocks)[:batch * max_blocks].view(batch, max_blocks).int()
        cache_shape = (num_blocks, page_size, heads_kv, head_dim)
    else:
        rows = batch + 2 if batch_idx else batch if batch_cache is None else batch_cache
        cache_shape = (rows, seqlen_cache, heads_kv, head_dim)
        if batch_idx:
            kwargs["cache_batch_idx"] = torch.randperm(rows)[:batch].int()
    k_cache, v_cache = torch.randn(cache_shape, dtype=dtype), torch.randn(cache_shape, dtype=dtype)
    args = [q, k_cache, v_cache]
    if seqlen_new is not None:
        args += [torch.randn(batch, seqlen_new, heads_kv, head_dim, dtype=dtype) for _ in range(2)]
    if cache_seqlens is not None:
        kwargs["cache_seqlens"] = (cache_seqlens[0] if seqlens_as_int
                                   else torch.tensor(cache_seqlens[:batch], dtype=torch.int32))
    if leftpad is not None:
        kwargs["cache_leftpad"] = torch.tensor(leftpad[:batch], dtype=torch.int32)
    if rotary_dim is not None:
        seqlen_ro = seqlen_cache if page_size is None else kwargs["block_table"].shape[1] * page_size
        angles = torch.rand(seqlen_ro, rotary_dim // 2) * 2 * math.pi
        kwargs.update(rotary_cos=angles.cos().to(dtype), rotary_sin=angles.sin().to(dtype),
                      rotary_interleaved=rotary_interleaved)
    if alibi == "per_head":
        kwargs["alibi_slopes"] = torch.rand(heads_q)
    elif alibi == "per_batch":
        kwargs["alibi_slopes"] = torch.rand(batch, heads_q)
    return [to(t, device) for t in args], {name: to(value, device) for name, value in kwargs.items()}


def to(value, device):
    """value on device when it is a tensor; anything else unchanged."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


def case(device, dtype, /, **options):
    """make_case on device; a dtype (the CUDA grids) overrides the options' own."""
    return make_case(**options, device=device, **({} if dtype is None else {"dtype": dtype}))


def written_mask(k_cache, kwargs, seqlen_new, batch):
    """True at the cache entries (cache row or page, position) the call appends to."""
    mask = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    seqlens = kwargs.get("cache_seqlens")
    if seqlen_new == 0:
        return mask
    for b in range(batch):
        start = seqlens if isinstance(seqlens, int) else int(seqlens[b])
        for pos in range(start, start + seqlen_new):
            if "block_table" in kwargs:
                page_size = k_cache.shape[1]
                mask[int(kwargs["block_table"][b, pos // page_size]), pos % page_size] = True
            elif "cache_batch_idx" in kwargs:
                mask[int(kwargs["cache_batch_idx"][b]), pos] = True
            else:
                mask[b, pos] = True
    return mask


def check_call(args, kwargs):
    """One call against the reference (on CPU copies of the inputs): out and lse by the tolerance rule, caches
    bitwise outside the appended entries and there bitwise (or, with rotary, within a rounding) equal to the
    reference's."""
    original = [t.cpu().clone() for t in args]
    cpu_kwargs = {name: to(value, "cpu") for name, value in kwargs.items()}
    with torch.no_grad():
        out, lse = flash_ext.attention_with_kvcache(*args, return_lse=True, **kwargs)
        out64, lse64, k_ref, v_ref = attention_with_kvcache_ref(*original, **cpu_kwargs)
        out_lowp, lse_lowp, _, _ = attention_with_kvcache_ref(*original, upcast=False, **cpu_kwargs)
    assert out.device == args[0].device and lse.device == args[0].device
    q, k_cache, v_cache = (t.cpu() for t in args[:3])
    kwargs = cpu_kwargs
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_within_tolerance("out", out, out_lowp, out64, FWD_FACTOR)
    assert_within_tolerance("lse", lse, lse_lowp, lse64, FWD_FACTOR)
    for t, t0 in zip(args[3:], original[3:]):
        assert torch.equal(t.cpu(), t0), "k / v were modified"
    assert torch.equal(q, original[0]), "q was modified"
    seqlen_new = args[3].shape[1] if len(args) > 3 else 0
    written = written_mask(k_cache, kwargs, seqlen_new, q.shape[0])
    for name, cache, before, ref in (("k_cache", k_cache, original[1], k_ref), ("v_cache", v_cache, original[2], v_ref)):
        assert torch.equal(cache[~written], before[~written]), f"{name} changed outside the appended entries"
        assert torch.equal(ref[~written], before[~written]), f"the reference's {name} changed outside them"
        if name == "k_cache" and "rotary_cos" in kwargs:
            tolerance = 2 * EPS.get(cache.dtype) if cache.dtype == torch.float32 else torch.finfo(cache.dtype).eps
            torch.testing.assert_close(cache[written], ref[written], atol=4 * tolerance, rtol=tolerance)
        else:
            assert torch.equal(cache[written], ref[written]), f"{name}: appended entries differ from the reference"
    return out, lse


SINGLE_OPTIONS = {
    "plain": dict(),
    "no_new_kv": dict(seqlen_new=None),
    "no_new_kv_full_cache": dict(seqlen_new=None, cache_seqlens=None),
    "seqlens_int": dict(seqlens_as_int=True),
    "paged_no_new_kv_full_cache": dict(page_size=16, seqlen_new=None, cache_seqlens=None),
    "causal": dict(causal=True),
    "window": dict(window_size=(4, 1)),
    "window_left_only": dict(window_size=(6, -1)),
    "softcap": dict(softcap=3.0),
    "alibi_per_head": dict(alibi="per_head"),
    "alibi_per_batch": dict(alibi="per_batch"),
    "softmax_scale": dict(softmax_scale=0.3),
    "mqa": dict(heads_q=6, heads_kv=1),
    "mha": dict(heads_q=2, heads_kv=2),
    "rotary_interleaved": dict(rotary_dim=32),
    "rotary_neox": dict(rotary_dim=32, rotary_interleaved=False),
    "rotary_partial": dict(rotary_dim=16),
    "rotary_partial_neox_causal": dict(rotary_dim=8, rotary_interleaved=False, causal=True),
    "cache_batch_idx": dict(batch_idx=True),
    "leftpad": dict(leftpad=(2, 7)),
    "paged16": dict(page_size=16),
    "paged256": dict(page_size=256, seqlen_cache=300, cache_seqlens=(255, 17)),
    "num_splits": dict(num_splits=3),
    "head_dim_1": dict(head_dim=1),
    "head_dim_256": dict(head_dim=256, rotary_dim=64),
    "head_dim_odd": dict(head_dim=24, rotary_dim=24, rotary_interleaved=False),
    "bf16": dict(dtype=torch.bfloat16, rotary_dim=32, causal=True),
    "fp16": dict(dtype=torch.float16, alibi="per_head", window_size=(3, 0)),
    "batch_1": dict(batch=1),
    "larger_cache": dict(batch_cache=2, seqlen_cache=64, cache_seqlens=(60, 0), seqlen_new=4),
    "head_dim_59": dict(head_dim=59, rotary_dim=32, causal=True),
    "head_dim_128_paged": dict(head_dim=128, rotary_dim=128, page_size=16, causal=True, heads_q=8, heads_kv=2),
}
# On CUDA the grid's dtypes (float16, bfloat16) replace the options' own, so the dtype options are left out.
CUDA_SINGLE_OPTIONS = {name: options for name, options in SINGLE_OPTIONS.items() if name not in ("bf16", "fp16")}


def _named(options):
    return [named(value, name) for name, value in options.items()]


@parametrize_devices(
    cpu=dict(options=_named(SINGLE_OPTIONS), dtype=[None]),
    cuda=dict(options=_named(CUDA_SINGLE_OPTIONS), dtype=CUDA_DTYPES),
)
def test_each_option(device, options, dtype):
    check_call(*case(device, dtype, **options))


@parametrize_devices(
    cpu=dict(seqlen_q=[1, 3, 16], causal=[named(False, "full"), named(True, "causal")], dtype=[None]),
    cuda=dict(seqlen_q=[1, 3, 16], causal=[named(False, "full"), named(True, "causal")], dtype=CUDA_DTYPES),
)
def test_seqlen_q(device, seqlen_q, causal, dtype):
    check_call(*case(device, dtype, seqlen_q=seqlen_q, seqlen_new=seqlen_q, seqlen_cache=48, cache_seqlens=(0, 23),
                     causal=causal, rotary_dim=16))


PAGES = [named(None, "dense"), named(16, "paged16"), named(256, "paged256")]
NEW = [named(None, "no_new"), named(2, "new2")]


@parametrize_devices(
    cpu=dict(page_size=PAGES, seqlen_new=NEW, dtype=[None]),
    cuda=dict(page_size=PAGES, seqlen_new=NEW, dtype=CUDA_DTYPES),
)
def test_cache_lengths(device, page_size, seqlen_new, dtype):
    """Cache lengths 0, 1, odd, and either side of page boundaries (page, 2 * page; 3 pages is the end of the
    cache; dense caches hold 3 * 16 + 1 keys and take the 16-key boundaries)."""
    page = page_size or 16
    seqlen_cache = 3 * page + (1 if page_size is None else 0)
    for lengths in [(0, 1), (page - 1, page), (page + 1, 2 * page - 1), (2 * page, 2 * page + 1), (3 * page - 1, 9)]:
        lengths = tuple(min(n, seqlen_cache - (seqlen_new or 0)) for n in lengths)
        check_call(*case(device, dtype, seqlen_cache=seqlen_cache, page_size=page_size, seqlen_q=2,
                         seqlen_new=seqlen_new, cache_seqlens=lengths, causal=True, head_dim=16))


@parametrize_devices(
    cpu=dict(page_size=PAGES, dtype=[None]),
    cuda=dict(page_size=PAGES, dtype=[torch.bfloat16]),
)
def test_cache_of_128k_keys(device, page_size, dtype):
    """A cache of 128k keys: one query token against it, and four with their keys appended, the sequences ending
    mid-page, one at the end of the cache (on CUDA the decode kernel's automatic splits)."""
    full = 128 * 1024
    for seqlen_q, seqlen_new, lengths in [(1, None, (full, 70001)), (4, 4, (full - 4, 65537))]:
        check_call(*case(device, dtype, batch=2, seqlen_cache=full, page_size=page_size, seqlen_q=seqlen_q,
                         seqlen_new=seqlen_new, heads_q=4, heads_kv=1, head_dim=64, cache_seqlens=lengths,
                         causal=True))


COMBINATIONS = {
    "paged16-leftpad-new-rotary-causal-gqa": dict(page_size=16, leftpad=(3, 16), cache_seqlens=(20, 33),
                                                  rotary_dim=32, causal=True),
    "paged256-leftpad-neox-partial-window": dict(page_size=256, seqlen_cache=512, cache_seqlens=(255, 257),
                                                 leftpad=(100, 0), rotary_dim=16, rotary_interleaved=False,
                                                 window_size=(20, 0), seqlen_q=4, seqlen_new=4),
    "batch_idx-leftpad-rotary-softcap-alibi": dict(batch_idx=True, leftpad=(1, 4), rotary_dim=32, softcap=4.0,
                                                   alibi="per_batch", causal=True),
    "batch_idx-no_new-window-mqa": dict(batch_idx=True, seqlen_new=None, heads_q=4, heads_kv=1, window_size=(2, 2)),
    "paged16-alibi-softcap-window-decode": dict(page_size=16, seqlen_q=1, seqlen_new=1, alibi="per_head",
                                                softcap=2.0, window_size=(8, 0), cache_seqlens=(31, 16)),
    "leftpad-rotary-noncausal-multi_q": dict(leftpad=(5, 0), rotary_dim=32, seqlen_q=5, seqlen_new=2),
    "bf16-paged16-everything": dict(dtype=torch.bfloat16, page_size=16, leftpad=(2, 0), rotary_dim=16,
                                    causal=True, softcap=5.0, alibi="per_head", heads_q=8, heads_kv=2,
                                    window_size=(10, 0)),
    "fp16-batch_idx-rotary-neox-window": dict(dtype=torch.float16, batch_idx=True, rotary_dim=32,
                                              rotary_interleaved=False, window_size=(3, 3), seqlen_q=2),
}


@parametrize_devices(
    cpu=dict(options=_named(COMBINATIONS), dtype=[None]),
    cuda=dict(options=_named(COMBINATIONS), dtype=[named(None, "own_dtype")]),
)
def test_combinations(device, options, dtype):
    """On CUDA each combination runs in float16 / bfloat16: its own when it names one, else alternately."""
    if device == "cuda" and "dtype" not in options:
        dtype = CUDA_DTYPES[list(COMBINATIONS.values()).index(options) % 2]
    check_call(*case(device, dtype, **options))


def test_empty_batch_and_no_keys():
    check_call(*make_case(batch=0, cache_seqlens=()))
    out, lse = check_call(*make_case(seqlen_new=None, cache_seqlens=(0, 0)))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_cache_update_is_in_place_and_repeated_calls_accumulate():
    """Two appends of 2 then 3 keys leave the same caches (and the second call the same result) as one
    reference pass per call."""
    (q, k_cache, v_cache, k, v), kwargs = make_case(page_size=16, seqlen_new=2, cache_seqlens=(14, 3))
    k_ptr = k_cache.data_ptr()
    with torch.no_grad():
        flash_ext.attention_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    assert k_cache.data_ptr() == k_ptr
    kwargs["cache_seqlens"] = kwargs["cache_seqlens"] + 2
    check_call([q, k_cache, v_cache, torch.randn(2, 3, 2, 32), torch.randn(2, 3, 2, 32)], kwargs)


def _strided_q_and_new_keys(q, k_cache, v_cache, k, v):
    def heads_slowest(t):
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return [heads_slowest(q), k_cache, v_cache, heads_slowest(k), v]


def _caches_of_one_kv_tensor(q, k_cache, v_cache, k, v):
    kv = torch.stack([k_cache, v_cache], dim=2)  # (rows, seqlen, 2, heads, head_dim): each cache a strided view
    return [q, kv[:, :, 0], kv[:, :, 1], k, v]


def _caches_every_other_element(q, k_cache, v_cache, k, v):
    wide = [torch.stack([c, torch.full_like(c, float("nan"))], dim=-1).flatten(-2) for c in (k_cache, v_cache)]
    return [q, wide[0][..., ::2], wide[1][..., ::2], k, v]


STRIDED = {"q_and_new_keys": _strided_q_and_new_keys, "caches_of_one_kv_tensor": _caches_of_one_kv_tensor,
           "caches_every_other_element": _caches_every_other_element}


@parametrize_devices(
    cpu=dict(layout=_named(STRIDED), page_size=[None], dtype=[None]),
    cuda=dict(layout=_named(STRIDED), page_size=[named(None, "dense"), named(16, "paged16")], dtype=CUDA_DTYPES),
)
def test_strided_inputs(device, layout, page_size, dtype):
    """Non-contiguous q, new keys and caches: the append writes through the caches' strides."""
    args, kwargs = case(device, dtype, rotary_dim=32, causal=True, page_size=page_size)
    check_call(layout(*args), kwargs)


# ---- Errors -------------------------------------------------------------------------------------------

def _bad(modify, error, message):
    return modify, error, message


I32 = dict(dtype=torch.int32)
# Checks that need no value of the index tensors: the op and its fake raise alike.
STATIC_ERRORS = {
    "q_3d": _bad(replace_arg(0, lambda q: q[0]), RuntimeError, "q must have 4 dimensions"),
    "cache_3d": _bad(all_of(replace_arg(1, lambda c: c[0]), replace_arg(2, lambda c: c[0])), RuntimeError,
                     "k_cache must have 4 dimensions"),
    "cache_shapes_differ": _bad(replace_arg(2, lambda c: c[:, :-1]), RuntimeError,
                                "k_cache and v_cache must have the same shape"),
    "q_int": _bad(replace_arg(0, lambda q: q.int()), RuntimeError, "q has dtype Int"),
    "cache_dtype": _bad(all_of(replace_arg(1, lambda c: c.double()), replace_arg(2, lambda c: c.double())), RuntimeError,
                        "k_cache has dtype Double but q has Float"),
    "head_dim": _bad(replace_arg(0, lambda q: q[..., :16]), RuntimeError, "k_cache has head_dim 32 but q has head_dim 16"),
    "gqa_ratio": _bad(replace_arg(0, lambda q: q[:, :, :3]), RuntimeError, "must be a multiple of heads_kv"),
    "cache_batch": _bad(all_of(replace_arg(1, lambda c: c[:1]), replace_arg(2, lambda c: c[:1])), RuntimeError,
                        "k_cache has batch 1 but q has batch 2"),
    "k_without_v": _bad(replace_arg(4, lambda v: None), RuntimeError, "k and v (the new keys and values) must be given"),
    "k_heads": _bad(all_of(replace_arg(3, lambda k: k[:, :, :1]), replace_arg(4, lambda v: v[:, :, :1])), RuntimeError,
                    "k must have shape (batch, seqlen_new, heads_kv, head_dim)"),
    "k_dtype": _bad(replace_arg(3, lambda k: k.double()), RuntimeError, "k has dtype Double but q has Float"),
    "kv_seqlen_differ": _bad(replace_arg(4, lambda v: v[:, :1]), RuntimeError, "k and v must have the same shape"),
    "new_longer_than_cache": _bad(all_of(replace_arg(3, lambda k: k.repeat(1, 20, 1, 1)),
                                        replace_arg(4, lambda v: v.repeat(1, 20, 1, 1))), RuntimeError,
                                  "the cache is too short: k has seqlen_new = 60"),
    "cache_seqlens_int64": _bad(set_kwargs(cache_seqlens=torch.tensor([1, 2])), RuntimeError,
                                "cache_seqlens must be int32, got Long"),
    "cache_seqlens_shape": _bad(set_kwargs(cache_seqlens=torch.tensor([1, 2, 3], **I32)), RuntimeError,
                                "cache_seqlens must have shape (batch,) = (2,)"),
    "cache_batch_idx_shape": _bad(set_kwargs(cache_batch_idx=torch.tensor([0], **I32)), RuntimeError,
                                  "cache_batch_idx must have shape (batch,)"),
    "cache_leftpad_dtype": _bad(set_kwargs(cache_leftpad=torch.tensor([0.0, 1.0])), RuntimeError,
                                "cache_leftpad must be int32, got Float"),
    "block_table_int64": _bad(set_kwargs(block_table=torch.zeros(2, 3, dtype=torch.long)), RuntimeError,
                              "block_table must be int32"),
    "block_table_shape": _bad(set_kwargs(block_table=torch.zeros(3, **I32)), RuntimeError,
                              "block_table must have shape (batch, max_blocks)"),
    "block_table_with_batch_idx": _bad(set_kwargs(block_table=torch.zeros(2, 3, **I32),
                                            cache_batch_idx=torch.tensor([0, 1], **I32)), RuntimeError,
                                       "cache_batch_idx cannot be used with block_table"),
    "page_size_0": _bad(all_of(replace_arg(1, lambda c: c[:, :0]), replace_arg(2, lambda c: c[:, :0]), replace_arg(3, lambda k: k[:, :0]),
                              replace_arg(4, lambda v: v[:, :0]), set_kwargs(block_table=torch.zeros(2, 3, **I32))),
                        RuntimeError, "k_cache.size(1) is the page size and must be >= 1"),
    "rotary_cos_only": _bad(set_kwargs(rotary_cos=torch.ones(40, 8)), RuntimeError,
                            "rotary_cos and rotary_sin must be given together"),
    "rotary_without_k": _bad(all_of(replace_arg(3, lambda k: None), replace_arg(4, lambda v: None),
                                   set_kwargs(rotary_cos=torch.ones(40, 8), rotary_sin=torch.ones(40, 8))), RuntimeError,
                             "rotary_cos / rotary_sin need k and v"),
    "rotary_dim_too_large": _bad(set_kwargs(rotary_cos=torch.ones(40, 17), rotary_sin=torch.ones(40, 17)), RuntimeError,
                                 "rotary_cos must have shape (seqlen_ro, rotary_dim / 2)"),
    "rotary_dtype": _bad(set_kwargs(rotary_cos=torch.ones(40, 8).double(), rotary_sin=torch.ones(40, 8).double()),
                         RuntimeError, "rotary_cos has dtype Double but q has Float"),
    "rotary_too_short": _bad(set_kwargs(rotary_cos=torch.ones(39, 8), rotary_sin=torch.ones(39, 8)), RuntimeError,
                             "rotary_cos has 39 rows (seqlen_ro) but a sequence of the cache holds up to 40"),
    "num_splits": _bad(set_kwargs(num_splits=-1), RuntimeError, "num_splits must be 0 (automatic) or >= 1"),
    "alibi_shape": _bad(set_kwargs(alibi_slopes=torch.ones(3)), RuntimeError, "alibi_slopes must have shape"),
    "window": _bad(set_kwargs(window_size=(-2, 0)), RuntimeError, "window_size[0]"),
    "softcap": _bad(set_kwargs(softcap=-1.0), RuntimeError, "softcap must be 0 (off)"),
}
# Checks of the index tensors' values (the CPU op only) and of Python types (the interface).
VALUE_ERRORS = {
    "seqlens_negative": _bad(set_kwargs(cache_seqlens=torch.tensor([-1, 2], **I32)), RuntimeError,
                             "cache_seqlens[0] = -1 must be >= 0"),
    "cache_full": _bad(set_kwargs(cache_seqlens=torch.tensor([1, 38], **I32)), RuntimeError,
                       "the cache is too short: cache_seqlens[1] = 38 plus seqlen_new = 3 exceeds the 40 keys"),
    "leftpad_past_seqlens": _bad(set_kwargs(cache_leftpad=torch.tensor([0, 12], **I32)), RuntimeError,
                                 "cache_leftpad[1] = 12 must be in 0..cache_seqlens[1] = 11"),
    "batch_idx_out_of_range": _bad(set_kwargs(cache_batch_idx=torch.tensor([0, 2], **I32)), RuntimeError,
                                   "cache_batch_idx[1] = 2 is not a row of k_cache (0..1)"),
    "batch_idx_repeated": _bad(set_kwargs(cache_batch_idx=torch.tensor([1, 1], **I32)), RuntimeError,
                               "cache_batch_idx[0] and cache_batch_idx[1] are both 1"),
    "block_out_of_range": _bad(set_kwargs(block_table=torch.tensor([[0, 1, 2], [3, 99, 4]], **I32)), RuntimeError,
                               "block_table[1][0] = 3 is not a block of k_cache (0..1)"),
    "seqlens_float": _bad(set_kwargs(cache_seqlens=2.0), TypeError, "cache_seqlens must be an int"),
    "q_not_tensor": _bad(replace_arg(0, lambda q: q.tolist()), TypeError, "q must be a torch.Tensor"),
    "block_table_list": _bad(set_kwargs(block_table=[[0]]), TypeError, "block_table must be a torch.Tensor"),
    "causal_int": _bad(set_kwargs(causal=1), TypeError, "causal must be a bool"),
    "num_splits_float": _bad(set_kwargs(num_splits=1.5), TypeError, "num_splits must be an int"),
    "interleaved_str": _bad(set_kwargs(rotary_interleaved="yes"), TypeError, "rotary_interleaved must be a bool"),
}


def bad_call(modify):
    (q, k_cache, v_cache, k, v), kwargs = make_case(cache_seqlens=(5, 11))
    args = [q, k_cache, v_cache, k, v]
    modify(args, kwargs)
    return args, kwargs


@pytest.mark.parametrize("modify,error,message", {**STATIC_ERRORS, **VALUE_ERRORS}.values(),
                         ids={**STATIC_ERRORS, **VALUE_ERRORS}.keys())
def test_bad_inputs(modify, error, message):
    args, kwargs = bad_call(modify)
    with pytest.raises(error) as raised, torch.no_grad():
        flash_ext.attention_with_kvcache(*args, **kwargs)
    assert message in str(raised.value) and "flash_ext" in str(raised.value)


@pytest.mark.parametrize("modify,error,message", STATIC_ERRORS.values(), ids=STATIC_ERRORS.keys())
def test_fake_raises_like_the_op(modify, error, message):
    args, kwargs = bad_call(modify)
    with pytest.raises(error) as real, torch.no_grad():
        flash_ext.attention_with_kvcache(*args, **kwargs)
    meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
    with pytest.raises(error) as fake, torch.no_grad():
        flash_ext.attention_with_kvcache(*[meta(a) for a in args], **{n: meta(a) for n, a in kwargs.items()})
    assert str(fake.value) == str(real.value).replace(" on cpu", " on meta")


def test_bad_inputs_leave_the_caches_alone():
    args, kwargs = bad_call(set_kwargs(cache_seqlens=torch.tensor([1, 38], **I32)))
    before = [t.clone() for t in args[1:3]]
    with pytest.raises(RuntimeError), torch.no_grad():
        flash_ext.attention_with_kvcache(*args, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(args[1:3], before))


@parametrize_devices(cpu=dict(index=[0, 1, 3], dtype=[None]), cuda=dict(index=[0, 1, 3], dtype=[torch.bfloat16]))
def test_requires_grad_is_rejected(device, index, dtype):
    (q, k_cache, v_cache, k, v), kwargs = case(device, dtype)
    args = [q, k_cache, v_cache, k, v]
    args[index].requires_grad_()
    with pytest.raises(RuntimeError, match="forward only"):
        flash_ext.attention_with_kvcache(*args, **kwargs)
    with torch.no_grad():
        flash_ext.attention_with_kvcache(*args, **kwargs)


def test_meta_inputs_give_shapes():
    (q, k_cache, v_cache, k, v), kwargs = make_case(page_size=16, rotary_dim=16)
    meta = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in kwargs.items()}
    out, lse = flash_ext.attention_with_kvcache(*(t.to("meta") for t in (q, k_cache, v_cache, k, v)),
                                                return_lse=True, **meta)
    assert out.shape == q.shape and out.device.type == "meta" and lse.shape == (2, 4, 3)


def test_opcheck():
    (q, k_cache, v_cache, k, v), kwargs = make_case(page_size=16, rotary_dim=16, causal=True)
    args = (q, k_cache, v_cache, k, v, kwargs["rotary_cos"], kwargs["rotary_sin"], True, kwargs["cache_seqlens"],
            None, None, kwargs["block_table"], 0.2, True, -1, 0, 0.0, None, 0)
    torch.library.opcheck(torch.ops.flash_ext.kvcache_fwd, args,
                          test_utils=("test_schema", "test_faketensor"))


@parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=[torch.bfloat16]))
def test_torch_compile_fullgraph(device, dtype):
    torch._dynamo.reset()
    (q, k_cache, v_cache, k, v), kwargs = case(device, dtype, page_size=16, rotary_dim=16, causal=True,
                                               leftpad=(1, 2))

    def step(q, k_cache, v_cache, k, v, cache_seqlens):
        out, lse = flash_ext.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                    return_lse=True, **kwargs)
        return out * 2, lse

    seqlens = kwargs.pop("cache_seqlens")
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = step(q, *caches[0], k, v, seqlens)
        result = compiled(q, *caches[1], k, v, seqlens)
    for a, b in zip(eager + caches[0], result + caches[1]):
        assert torch.equal(a, b)
    assert not torch.equal(caches[1][0], k_cache), "the compiled call did not update the cache in place"


# ---- A greedy decode loop -----------------------------------------------------------------------------

class TinyModel:
    """One attention layer with rotary embeddings, a residual and an LM head; random float32 weights on device.
    The attention runs in dtype: q, k, v are rounded to it, the rotary tables too."""

    def __init__(self, vocab=40, heads_q=4, heads_kv=2, head_dim=16, max_len=64, device="cpu", dtype=torch.float32):
        d_model = heads_q * head_dim
        self.heads_q, self.heads_kv, self.head_dim, self.dtype = heads_q, heads_kv, head_dim, dtype
        self.embed = torch.randn(vocab, d_model)
        self.wq = torch.randn(d_model, d_model) / math.sqrt(d_model)
        self.wk = torch.randn(d_model, heads_kv * head_dim) / math.sqrt(d_model)
        self.wv = torch.randn(d_model, heads_kv * head_dim) / math.sqrt(d_model)
        self.wo = torch.randn(d_model, d_model) / math.sqrt(d_model)
        angles = torch.arange(max_len)[:, None] * 10000.0 ** (-torch.arange(0, head_dim, 2) / head_dim)
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        for name in ("embed", "wq", "wk", "wv", "wo", "cos", "sin"):
            setattr(self, name, getattr(self, name).to(device))

    def qkv(self, tokens):
        x = self.embed[tokens]
        batch, seqlen = tokens.shape
        q = (x @ self.wq).view(batch, seqlen, self.heads_q, self.head_dim).to(self.dtype)
        k = (x @ self.wk).view(batch, seqlen, self.heads_kv, self.head_dim).to(self.dtype)
        v = (x @ self.wv).view(batch, seqlen, self.heads_kv, self.head_dim).to(self.dtype)
        return x, q, k, v

    def logits(self, x, attn):
        h = x + attn.flatten(-2).float() @ self.wo
        return h @ self.embed.t()

    def full(self, tokens):
        """Logits of the last position, recomputing full causal attention over every token (the rotary
        embedding in float32, rounded to dtype, as attention_with_kvcache computes it)."""
        x, q, k, v = self.qkv(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
        q, k = (apply_rotary_ref(t.float(), self.cos.float(), self.sin.float(), positions, interleaved=False)
                .to(self.dtype) for t in (q, k))
        return self.logits(x, flash_ext.attention(q, k, v, causal=True))[:, -1]

    def cached(self, tokens, k_cache, v_cache, length, block_table):
        """Logits of the last position of `tokens`, appended to caches holding `length` tokens."""
        x, q, k, v = self.qkv(tokens)
        attn = flash_ext.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=length, causal=True,
                                                rotary_cos=self.cos, rotary_sin=self.sin, rotary_interleaved=False,
                                                block_table=block_table)
        return self.logits(x, attn)[:, -1]


@parametrize_devices(
    cpu=dict(page_size=[named(None, "dense"), named(8, "paged8")], dtype=[torch.float32]),
    cuda=dict(page_size=[named(None, "dense"), named(8, "paged8")], dtype=CUDA_DTYPES),
)
def test_greedy_decode_matches_full_recompute(device, page_size, dtype):
    """Prefill, then 12 greedy steps of one token: each step's logits match recomputing full causal attention
    (flash_ext.attention) over the whole sequence. In float32 to 1e-4; in float16 / bfloat16 the two
    attention kernels may round differently, so to a few units of the dtype's precision of the logits' scale,
    and the greedy tokens must agree wherever the top two logits are further apart than that."""
    model, batch, prompt_len, steps, max_len = TinyModel(device=device, dtype=dtype), 2, 5, 12, 64
    tokens = torch.randint(0, 40, (batch, prompt_len)).to(device)
    if page_size is None:
        block_table, shape = None, (batch, max_len, model.heads_kv, model.head_dim)
    else:
        pages = max_len // page_size
        block_table = torch.randperm(batch * pages).view(batch, pages).int().to(device)
        shape = (batch * pages, page_size, model.heads_kv, model.head_dim)
    k_cache, v_cache = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
    with torch.no_grad():
        cached = model.cached(tokens, k_cache, v_cache, 0, block_table)  # prefill
        sequence = tokens
        for _ in range(steps):
            full = model.full(sequence)
            if dtype == torch.float32:
                tolerance = 1e-4
                torch.testing.assert_close(cached, full, atol=tolerance, rtol=tolerance)
            else:
                tolerance = 2.5 * torch.finfo(dtype).eps * full.abs().max().item()
                torch.testing.assert_close(cached, full, atol=tolerance, rtol=0)
            next_token = cached.argmax(-1, keepdim=True)
            top2 = full.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance
            assert torch.equal(next_token[clear], full.argmax(-1, keepdim=True)[clear])
            length = sequence.shape[1]
            sequence = torch.cat([sequence, next_token], dim=1)
            cached = model.cached(next_token, k_cache, v_cache, length, block_table)
    assert sequence.shape == (batch, prompt_len + steps)


# ---- Prefill: more packed query rows than the decode kernel takes -------------------------------------------

# The cache layouts of the prefill tests. On sm90 the forward reads a dense cache where it is (rows picked by
# cache_batch_idx, from leftpad on), and pages that hold whole key blocks (128 keys, 64 at head dim 256) without
# leftpad through the block table; other pages are gathered first.
PREFILL_LAYOUTS = {
    "dense": {},
    "batch_idx_leftpad": dict(batch_idx=True, leftpad=(3, 20)),
    "paged16": dict(page_size=16),
    "paged64": dict(page_size=64),
    "paged128": dict(page_size=128),
    "paged256": dict(page_size=256),
    "paged64_leftpad": dict(page_size=64, leftpad=(3, 20)),
}


def prefill_case(head_dim, layout, seqlen_new=5, **options):
    """70 queries x 4 query heads per kv head: 280 packed rows, past the decode kernel's 128."""
    return case("cuda", torch.bfloat16, head_dim=head_dim, heads_q=8, heads_kv=2, seqlen_q=70, seqlen_new=seqlen_new,
                seqlen_cache=700, cache_seqlens=(600, 37), **PREFILL_LAYOUTS[layout], **options)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [59, 64, 128, 256])
@pytest.mark.parametrize("layout", list(PREFILL_LAYOUTS))
@pytest.mark.parametrize("options", [dict(causal=False), dict(causal=True), dict(window_size=(90, 10), softcap=20.0),
                                     dict(causal=True, rotary_dim=32, alibi="per_head")], ids=str)
def test_prefill_against_the_reference(head_dim, layout, options):
    check_call(*prefill_case(head_dim, layout, **options))


def poison_unused_entries(k_cache, v_cache, kwargs, lengths, starts=None):
    """NaN in every cache entry that no sequence uses: positions outside [starts[b], lengths[b]) of sequence b's
    row or pages (starts: leftpad[b] unless given), and rows or pages of no sequence."""
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    leftpad = kwargs.get("cache_leftpad")
    if starts is None:
        starts = [0 if leftpad is None else int(leftpad[b]) for b in range(len(lengths))]
    for b, length in enumerate(lengths):
        positions = torch.arange(starts[b], length)
        if "block_table" in kwargs:
            page_size = k_cache.shape[1]
            used[kwargs["block_table"][b].cpu().long()[positions // page_size], positions % page_size] = True
        else:
            row = int(kwargs["cache_batch_idx"][b]) if "cache_batch_idx" in kwargs else b
            used[row, positions] = True
    unused = (~used).to(k_cache.device)
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("layout", list(PREFILL_LAYOUTS))
def test_prefill_ignores_nan_past_each_sequence(head_dim, layout):
    """Cache entries that no sequence uses hold NaN (a cache allocated with torch.empty may): the output is bitwise
    that of the same call before the NaN went in (the forward reads whole tiles past each sequence's end)."""
    args, kwargs = prefill_case(head_dim, layout, seqlen_new=None, causal=True)
    q, k_cache, v_cache = args
    with torch.no_grad():
        clean = flash_ext.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **kwargs)
    poison_unused_entries(k_cache, v_cache, kwargs, (600, 37))
    with torch.no_grad():
        poisoned = flash_ext.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **kwargs)
    assert torch.isfinite(poisoned[0]).all()
    assert torch.equal(poisoned[0], clean[0]) and torch.equal(poisoned[1], clean[1])


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [None, 256])
def test_prefill_reads_the_cache_in_place_on_sm90(head_dim, page_size):
    """On sm90 a prefill call on a dense cache, or on pages of whole key blocks, allocates its output, not a packed
    copy of the keys (2 x 64 MiB at head_dim 128 here)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the in-place read is the sm90 forward's")
    args, kwargs = case("cuda", torch.bfloat16, head_dim=head_dim, heads_q=32, heads_kv=8, seqlen_q=64, seqlen_new=None,
                        seqlen_cache=16384, cache_seqlens=(16000, 9000), page_size=page_size, causal=True)
    with torch.no_grad():
        flash_ext.attention_with_kvcache(*args, **kwargs)  # warm-up: workspace and library handles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        flash_ext.attention_with_kvcache(*args, **kwargs)
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 16 * 2**20, f"{extra / 2**20:.1f} MiB allocated by the call"


# ---- CUDA graphs ----------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [None, 16], ids=["dense", "paged16"])
@pytest.mark.parametrize("advance", ["inside", "between"])
def test_cuda_graph_decode_loop(page_size, advance):
    """A decode step (rotary, causal, GQA) captured once in a CUDA graph and replayed 4 times, its device
    cache_seqlens advanced in place (`+=` captured in the graph, or between replays): every step's out and lse
    match eager calls on copies of the caches bit for bit (and those match the reference, check_call), the final
    caches match the eager ones, and cache_seqlens ends 4 further. The lengths cross page boundaries (16, 32)."""
    steps = 4
    (q, k_cache, v_cache, k, v), kwargs = make_case(seqlen_q=1, seqlen_new=1, seqlen_cache=48, page_size=page_size,
                                                    cache_seqlens=(13, 30), rotary_dim=32, causal=True,
                                                    dtype=torch.bfloat16, device="cuda")
    seqlens = kwargs.pop("cache_seqlens")
    inputs = [[torch.randn_like(t) for t in (q, k, v)] for _ in range(steps)]

    eager_caches, eager_seqlens, eager_results = [k_cache.clone(), v_cache.clone()], seqlens.clone(), []
    for q_i, k_i, v_i in inputs:
        eager_results.append(check_call([q_i, *eager_caches, k_i, v_i], dict(kwargs, cache_seqlens=eager_seqlens)))
        eager_seqlens += 1

    static_q, static_k, static_v = (torch.zeros_like(t) for t in (q, k, v))
    graph_seqlens = seqlens.clone()
    initial_caches = [k_cache.clone(), v_cache.clone()]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        flash_ext.attention_with_kvcache(static_q, k_cache, v_cache, static_k, static_v, cache_seqlens=graph_seqlens,
                                         return_lse=True, **kwargs)  # warm-up on the side stream, undone below
        with torch.cuda.graph(graph, stream=stream):
            out, lse = flash_ext.attention_with_kvcache(static_q, k_cache, v_cache, static_k, static_v,
                                                        cache_seqlens=graph_seqlens, return_lse=True, **kwargs)
            if advance == "inside":
                graph_seqlens += 1
    torch.cuda.current_stream().wait_stream(stream)
    k_cache.copy_(initial_caches[0])
    v_cache.copy_(initial_caches[1])
    graph_seqlens.copy_(seqlens)

    for step, ((q_i, k_i, v_i), (eager_out, eager_lse)) in enumerate(zip(inputs, eager_results)):
        for static, value in ((static_q, q_i), (static_k, k_i), (static_v, v_i)):
            static.copy_(value)
        graph.replay()
        if advance == "between":
            graph_seqlens += 1
        assert torch.equal(out, eager_out), f"step {step}: out differs from the eager call"
        assert torch.equal(lse, eager_lse), f"step {step}: lse differs from the eager call"
    torch.cuda.synchronize()
    assert torch.equal(graph_seqlens, seqlens + steps)
    assert torch.equal(k_cache, eager_caches[0]) and torch.equal(v_cache, eager_caches[1])
    assert not torch.equal(k_cache, initial_caches[0]), "the replays did not append to the cache"


# ---- The CUDA decode kernels (head dims 64 / 128 / 256 read the caches in place) --------------------------

DECODE_OPTIONS = {name: options for name, options in SINGLE_OPTIONS.items()
                  if name not in ("bf16", "fp16", "head_dim_1", "head_dim_256", "head_dim_odd", "head_dim_59",
                                  "head_dim_128_paged", "rotary_interleaved", "rotary_neox")}


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("options", list(DECODE_OPTIONS.values()), ids=list(DECODE_OPTIONS))
def test_decode_kernel_each_option(options, head_dim):
    """Every option through the decode kernels (head dims they are built for), against the reference."""
    check_call(*case("cuda", torch.bfloat16, **dict(options, head_dim=head_dim)))


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("options", list(DECODE_OPTIONS.values()), ids=list(DECODE_OPTIONS))
def test_decode_kernel_four_row_tiles_each_option(options, head_dim):
    """Every option through the decode kernels' shape for more than 16 packed rows per kv head (speculative
    decoding: 8 query heads per kv head x 5 queries, the warps sharing each 64-key stage; wgmma on sm90), over
    several stages, against the reference."""
    base = dict(seqlen_q=5, seqlen_new=5, heads_q=16, seqlen_cache=200, cache_seqlens=(150, 37))
    check_call(*case("cuda", torch.bfloat16, **dict(base, **options, head_dim=head_dim)))


@pytest.mark.cuda
@pytest.mark.parametrize("options", list(COMBINATIONS.values()), ids=list(COMBINATIONS))
def test_decode_kernel_combinations(options):
    check_call(*case("cuda", None, **dict(options, head_dim=128, dtype=options.get("dtype", torch.float16))))


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [None, 16, 64, 256])
@pytest.mark.parametrize("seqlen_q", [1, 16])
def test_decode_long_walk_one_split(page_size, seqlen_q):
    """One split over thousands of keys: each warp walks more than 32 slices (the paged copies read the block table
    32 slices at a time), ending mid-page and mid-slice, with a window starting mid-slice."""
    for window in ((-1, -1), (3001, 0)):
        args, kwargs = case("cuda", torch.bfloat16, head_dim=128, heads_q=8, heads_kv=2, seqlen_q=seqlen_q,
                            seqlen_new=seqlen_q, seqlen_cache=9000, cache_seqlens=(8100, 4417), page_size=page_size,
                            causal=True, window_size=window)
        check_call(args, dict(kwargs, num_splits=1))


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("seqlen_q", [1, 16])
def test_decode_num_splits_agree_and_repeat(page_size, seqlen_q):
    """num_splits 1, 2, 7 and automatic: within tolerance of each other, and each bitwise repeatable (one row tile
    per CTA at seqlen_q 1, four at 16)."""
    args, kwargs = case("cuda", torch.bfloat16, head_dim=128, heads_q=8, heads_kv=2, seqlen_q=seqlen_q,
                        seqlen_new=seqlen_q, seqlen_cache=700, cache_seqlens=(650, 37), page_size=page_size, causal=True)
    results = {}
    for splits in (1, 2, 7, 0):
        runs = []
        for _ in range(2):
            k_cache, v_cache = args[1].clone(), args[2].clone()
            with torch.no_grad():
                runs.append(flash_ext.attention_with_kvcache(args[0], k_cache, v_cache, *args[3:], num_splits=splits,
                                                             return_lse=True, **kwargs))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), splits
        results[splits] = runs[0]
    for splits in (2, 7, 0):
        assert (results[splits][0].float() - results[1][0].float()).abs().max().item() <= 4 * EPS[torch.bfloat16]
        assert (results[splits][1] - results[1][1]).abs().max().item() <= 1e-4
    check_call(args, dict(kwargs, num_splits=7))


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("seqlen_q", [1, 16])
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_decode_ignores_nan_past_each_sequence(page_size, seqlen_q, splits):
    """Cache entries past each sequence's keys hold NaN (a cache allocated with torch.empty may): the output is
    bitwise that of the same call on the cache before the NaN went in, whichever slices (copied before the lengths
    are read, or after) hold them."""
    args, kwargs = case("cuda", torch.bfloat16, head_dim=128, heads_q=8, heads_kv=2, seqlen_q=seqlen_q,
                        seqlen_new=None, seqlen_cache=700, cache_seqlens=(650, 37), page_size=page_size, causal=True)
    q, k_cache, v_cache = args
    with torch.no_grad():
        clean = flash_ext.attention_with_kvcache(q, k_cache, v_cache, num_splits=splits, return_lse=True, **kwargs)
    poison_unused_entries(k_cache, v_cache, kwargs, (650, 37))
    with torch.no_grad():
        poisoned = flash_ext.attention_with_kvcache(q, k_cache, v_cache, num_splits=splits, return_lse=True, **kwargs)
    assert torch.isfinite(poisoned[0]).all()
    assert torch.equal(poisoned[0], clean[0]) and torch.equal(poisoned[1], clean[1])


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_decode_ignores_nan_below_the_window(page_size, seqlen_q, splits):
    """With a sliding window, cache entries below every query's window (and past each sequence) hold NaN: the output
    is bitwise that of the clean cache. The windows start mid-slice: a kernel copying whole slices must keep the
    keys below the window out of the output."""
    lengths, window = (650, 237), 101
    args, kwargs = case("cuda", torch.bfloat16, head_dim=128, heads_q=8, heads_kv=2, seqlen_q=seqlen_q,
                        seqlen_new=None, seqlen_cache=704, cache_seqlens=lengths, page_size=page_size, causal=True,
                        window_size=(window, 0))
    q, k_cache, v_cache = args
    with torch.no_grad():
        clean = flash_ext.attention_with_kvcache(q, k_cache, v_cache, num_splits=splits, return_lse=True, **kwargs)
    # Query 0's diagonal, less the window: the lowest key any query sees.
    poison_unused_entries(k_cache, v_cache, kwargs, lengths, starts=[n - seqlen_q - window for n in lengths])
    with torch.no_grad():
        poisoned = flash_ext.attention_with_kvcache(q, k_cache, v_cache, num_splits=splits, return_lse=True, **kwargs)
    assert torch.isfinite(poisoned[0]).all()
    assert torch.equal(poisoned[0], clean[0]) and torch.equal(poisoned[1], clean[1])
