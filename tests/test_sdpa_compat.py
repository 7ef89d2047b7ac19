"""flash_ext.scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention.

The reference is torch's SDPA in float64 on the CPU; the error budget is the same computation in plain
PyTorch in the inputs' dtype (tolerance.py's rule), for the output and for dq, dk, dv. Every path is
covered: no mask, is_causal (seqlen_q <, = and > seqlen_k), GQA, scale, masks that run the dense kernels,
key-padding masks and causal masks with padding (the varlen kernels, one or two calls), rows that see no
key, masks that are rejected, dropout, SDPA's shapes (2-D to 5-D, broadcasting) and strided inputs. Which
flash_ext calls a case makes is recorded (the `calls` fixture), so a mask that should run the dense kernels
cannot pass through the varlen ones unnoticed.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import flash_ext
import flash_ext.sdpa as sdpa_module
from devices import parametrize_devices
from flash_ext.testing import attention_with_rng_state, dropout_keep_mask
from tolerance import FWD_FACTOR, GRAD_FACTOR, assert_within_tolerance, leaf_copies, magnitude

sdpa = flash_ext.scaled_dot_product_attention


# ---- Reference and checks ------------------------------------------------------------------------


def plain_sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, keep=None,
               dropout_p=0.0):
    """SDPA's definition in plain PyTorch in the inputs' dtype (the error budget of the tolerance rule): a row
    that sees no key gives 0. keep: a dropout keep mask (True = kept) broadcastable to the probabilities."""
    if enable_gqa:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    if scale is None:
        scale = 1 / math.sqrt(query.shape[-1])
    scores = query @ key.transpose(-2, -1) * scale
    seqlen_q, seqlen_k = scores.shape[-2:]
    if is_causal:
        visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    no_key = torch.isneginf(scores).all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(no_key, 0.0), dim=-1).masked_fill(no_key, 0.0)
    if keep is not None:
        probs = probs.masked_fill(~keep, 0.0) / (1 - dropout_p)
    return probs @ value


def sdpa_ref(query, key, value, attn_mask=None, keep=None, dropout_p=0.0, **kwargs):
    """torch's SDPA (float64 inputs give the float64 reference); with a keep mask, the same in plain PyTorch."""
    if keep is not None:
        return plain_sdpa(query, key, value, attn_mask, keep=keep, dropout_p=dropout_p, **kwargs)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(query.dtype)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kwargs)


def check_sdpa(query, key, value, *, backward=True, keep=None, **kwargs):
    """flash_ext's SDPA (forward and, with backward, dq, dk, dv) against torch's SDPA in float64 on the CPU,
    with the budget of plain_sdpa in the inputs' dtype; returns (out, grads)."""
    inputs = leaf_copies((query, key, value))
    out = sdpa(*inputs, **kwargs)
    cpu_kwargs = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    keep = None if keep is None else keep.cpu()
    inputs64 = leaf_copies([t.cpu() for t in (query, key, value)], torch.float64)
    inputs_lowp = leaf_copies([t.cpu() for t in (query, key, value)])
    out64 = sdpa_ref(*inputs64, keep=keep, **cpu_kwargs)
    out_lowp = plain_sdpa(*inputs_lowp, keep=keep, **cpu_kwargs)
    assert out.shape == out64.shape and out.dtype == query.dtype and out.device == query.device
    assert_within_tolerance("out", out, out_lowp, out64, FWD_FACTOR)
    if not backward:
        return out, None
    dout = torch.randn(out.shape, dtype=out.dtype, device=out.device)
    grads = torch.autograd.grad(out, inputs, dout)
    grads64 = torch.autograd.grad(out64, inputs64, dout.cpu().double())
    grads_lowp = torch.autograd.grad(out_lowp, inputs_lowp, dout.cpu())
    scale = magnitude(*grads64)
    for name, x, grad, grad_lowp, grad64 in zip(("dq", "dk", "dv"), (query, key, value), grads, grads_lowp, grads64):
        assert grad.shape == x.shape and grad.dtype == x.dtype, f"{name}: {grad.shape} {grad.dtype}"
        assert_within_tolerance(name, grad, grad_lowp, grad64, GRAD_FACTOR, scale=scale)
    return out, grads


def make(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, device="cpu", layout="projection"):
    """query (batch, heads_q, seqlen_q, head_dim), key and value (batch, heads_kv, seqlen_k, head_dim):
    "projection" as (batch, seqlen, heads, head_dim).transpose(1, 2) (a linear layer's output split into heads),
    "contiguous" SDPA's own contiguous layout, "last_dim_strided" every other element of a larger tensor."""
    def one(heads, seqlen):
        options = dict(dtype=dtype, device=device)
        if layout == "projection":
            return torch.randn(batch, seqlen, heads, head_dim, **options).transpose(1, 2)
        if layout == "contiguous":
            return torch.randn(batch, heads, seqlen, head_dim, **options)
        if layout == "last_dim_strided":
            return torch.randn(batch, heads, seqlen, head_dim, 2, **options)[..., 0]
        raise ValueError(layout)
    return one(heads_q, seqlen_q), one(heads_kv, seqlen_k), one(heads_kv, seqlen_k)


@pytest.fixture
def calls(monkeypatch):
    """The flash_ext calls that scaled_dot_product_attention makes: ("dense" | "varlen" | "kvcache", args,
    kwargs)."""
    recorded = []

    def recording(kind, function):
        def wrapper(*args, **kwargs):
            recorded.append((kind, args, kwargs))
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(sdpa_module, "attention", recording("dense", sdpa_module.attention))
    monkeypatch.setattr(sdpa_module, "attention_varlen", recording("varlen", sdpa_module.attention_varlen))
    monkeypatch.setattr(sdpa_module, "attention_with_kvcache",
                        recording("kvcache", sdpa_module.attention_with_kvcache))
    return recorded


def kinds(calls):
    return [kind for kind, _, _ in calls]


def padding(lengths, seqlen_k, side, device="cpu"):
    """(batch, seqlen_k) bool: True on each sequence's keys, padded on the right or the left."""
    lengths = torch.tensor(lengths, device=device)[:, None]
    positions = torch.arange(seqlen_k, device=device)[None]
    return positions < lengths if side == "right" else positions >= seqlen_k - lengths


def causal(seqlen_q, seqlen_k, diagonal=0, device="cpu"):
    """(seqlen_q, seqlen_k) bool, True where key j <= query i + diagonal."""
    return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device).tril(diagonal)


CPU_DTYPES = [torch.float32, torch.bfloat16]
CUDA_DTYPES = [torch.bfloat16, torch.float16]


# ---- No mask, is_causal, GQA, scale ---------------------------------------------------------------


@parametrize_devices(
    cpu=dict(dtype=CPU_DTYPES, layout=["projection", "contiguous", "last_dim_strided"], head_dim=[32]),
    cuda=dict(dtype=CUDA_DTYPES, layout=["projection", "contiguous"], head_dim=[64, 128]),
)
def test_no_mask(device, dtype, layout, head_dim, calls):
    seqlen_q, seqlen_k = (37, 53) if device == "cpu" else (300, 450)
    check_sdpa(*make(2, 3, 3, seqlen_q, seqlen_k, head_dim, dtype, device, layout))
    assert kinds(calls) == ["dense"]


@parametrize_devices(
    cpu=dict(seqlens=[(37, 53), (53, 37), (41, 41), (1, 20), (20, 1)], dtype=CPU_DTYPES, head_dim=[32]),
    cuda=dict(seqlens=[(200, 333), (333, 200), (300, 300), (1, 128)], dtype=CUDA_DTYPES, head_dim=[128]),
)
def test_is_causal_is_top_left(device, seqlens, dtype, head_dim, calls):
    """SDPA's is_causal: query i sees keys j <= i whatever seqlen_q and seqlen_k (flash_ext's own causal is
    bottom-right); with seqlen_q > seqlen_k the last rows see every key."""
    seqlen_q, seqlen_k = seqlens
    check_sdpa(*make(2, 4, 4, seqlen_q, seqlen_k, head_dim, dtype, device), is_causal=True)
    assert kinds(calls) == ["dense"]


@parametrize_devices(
    cpu=dict(heads=[(6, 2), (6, 1), (4, 4)], is_causal=[False, True], dtype=[torch.bfloat16]),
    cuda=dict(heads=[(8, 2), (8, 1)], is_causal=[False, True], dtype=[torch.bfloat16]),
)
def test_enable_gqa(device, heads, is_causal, dtype, calls):
    head_dim, (seqlen_q, seqlen_k) = (32, (29, 45)) if device == "cpu" else (128, (257, 300))
    q, k, v = make(2, *heads, seqlen_q, seqlen_k, head_dim, dtype, device)
    check_sdpa(q, k, v, enable_gqa=True, is_causal=is_causal)
    # key and value reach the kernels with their own heads, not repeated.
    assert calls[0][1][1].shape[2] == heads[1]


def test_heads_broadcast_without_enable_gqa(calls):
    """Without enable_gqa, SDPA broadcasts key and value with one head over query's heads (MQA); flash_ext runs
    that as heads_kv = 1. Other head counts need enable_gqa, as in SDPA."""
    q, k, v = make(2, 4, 1, 20, 30, 16, torch.float32)
    check_sdpa(q, k, v)
    assert calls[0][1][1].shape[2] == 1
    q, k, v = make(2, 4, 2, 20, 30, 16, torch.float32)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        sdpa(q, k, v)


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_scale(scale):
    check_sdpa(*make(2, 2, 2, 30, 40, 32, torch.bfloat16), scale=scale, is_causal=True)


# ---- Masks that run the dense kernels ---------------------------------------------------------------


def additive(mask, dtype=torch.float32, masked=float("-inf")):
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, masked)


def dense_mask_cases(seqlen_q, seqlen_k):
    """name: (mask, the options flash_ext.attention gets, the number of keys it gets: those some query sees),
    for masks on the CPU."""
    sq, sk = seqlen_q, seqlen_k
    bottom_right = causal(sq, sk, sk - sq)
    top_left = (dict(causal=True, window_size=(-1, -1)), sq) if sq <= sk else (
        dict(causal=False, window_size=(-1, sq - sk)), sk)
    return {
        "all_true": (torch.ones(sq, sk, dtype=torch.bool), dict(causal=False, window_size=(-1, -1)), sk),
        "top_left_causal": (causal(sq, sk), *top_left),
        "bottom_right_causal": (bottom_right, dict(causal=True, window_size=(-1, -1)), sk),
        "transformer_additive": (additive(bottom_right), dict(causal=True, window_size=(-1, -1)), sk),
        "sliding_window": (bottom_right & ~causal(sq, sk, sk - sq - 9), dict(causal=True, window_size=(8, -1)),
                           min(sk, sq + 8)),
        "batch_and_heads_dims": (bottom_right[None, None].expand(2, 4, sq, sk),
                                 dict(causal=True, window_size=(-1, -1)), sk),
    }


@parametrize_devices(
    cpu=dict(mask=list(dense_mask_cases(1, 1)), seqlens=[(30, 47), (47, 30)], dtype=[torch.bfloat16],
             head_dim=[32]),
    cuda=dict(mask=list(dense_mask_cases(1, 1)), seqlens=[(200, 300), (300, 200)], dtype=[torch.bfloat16],
              head_dim=[128]),
)
def test_masks_that_run_the_dense_kernels(device, mask, seqlens, dtype, head_dim, calls):
    """A mask whose rows are the same for every batch row runs one dense call, on the keys the mask uses."""
    attn_mask, options, keys = dense_mask_cases(*seqlens)[mask]
    q, k, v = make(2, 4, 4, *seqlens, head_dim, dtype, device)
    check_sdpa(q, k, v, attn_mask=attn_mask.to(device), scale=0.3)
    assert kinds(calls) == ["dense"]
    _, args, kwargs = calls[0]
    assert kwargs == dict(options, softmax_scale=0.3, dropout_p=0.0)
    assert args[1].shape[1] == keys


# ---- Masks that run the varlen kernels -------------------------------------------------------------


def padding_mask(form, lengths, seqlen_q, seqlen_k, device):
    """The masks of key padding, alone or with causal, as libraries build them (batch, 1, ., seqlen_k)."""
    side = "left" if "left" in form else "right"
    keys = padding(lengths, seqlen_k, side, device)
    if form.startswith("keys"):
        mask = keys[:, None, None, :]
        if form.endswith("expanded"):
            mask = mask.expand(-1, -1, seqlen_q, -1)
    else:  # causal: bottom-right, so that a cache of seqlen_k - seqlen_q keys precedes the queries
        mask = (causal(seqlen_q, seqlen_k, seqlen_k - seqlen_q, device) & keys[:, None, :])[:, None]
    return mask


# form: (the flash_ext calls it makes)
PADDING_FORMS = {
    "keys_right": ["varlen"],
    "keys_left": ["varlen"],
    "keys_left_expanded": ["varlen"],
    "causal_left": ["varlen"],  # transformers' generation mask
    "causal_right": ["varlen", "varlen"],  # transformers' training mask: the padded rows are a second call
}


@parametrize_devices(
    cpu=dict(form=list(PADDING_FORMS), seqlens=[(33, 33), (9, 40)], dtype=CPU_DTYPES),
    cuda=dict(form=list(PADDING_FORMS), seqlens=[(300, 300), (64, 400)], dtype=[torch.bfloat16]),
)
def test_padding_masks(device, form, seqlens, dtype, calls):
    """Key padding, alone and with causal, on both sides; a sequence without keys (its rows are 0) and a full
    one. The padded keys get exactly zero gradients."""
    seqlen_q, seqlen_k = seqlens
    lengths = [seqlen_k, seqlen_k // 2, 0, 3]
    head_dim = 32 if device == "cpu" else 128
    mask = padding_mask(form, lengths, seqlen_q, seqlen_k, device)
    q, k, v = make(len(lengths), 4, 2, seqlen_q, seqlen_k, head_dim, dtype, device)
    out, (dq, dk, dv) = check_sdpa(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.2)
    assert kinds(calls) == PADDING_FORMS[form]
    assert all(kwargs["softmax_scale"] == 0.2 for _, _, kwargs in calls)
    seen_by_none = ~mask.any(-2).squeeze(1)  # (batch, seqlen_k)
    assert not dk.transpose(1, 2)[seen_by_none].any() and not dv.transpose(1, 2)[seen_by_none].any()
    assert not out[2].any() and not dq[2].any()  # the sequence without keys


@pytest.mark.parametrize("masked", ["-inf", "finfo.min"])
@pytest.mark.parametrize("form", ["keys_right", "causal_left", "causal_right"])
def test_additive_padding_masks(form, masked, calls):
    """Additive float masks: 0 attends, -inf or torch.finfo(dtype).min masks (transformers' older masks).
    finfo.min needs a key in every row (else SDPA averages over all keys): no empty sequence here."""
    seqlen_q = seqlen_k = 25
    lengths = [25, 11, 1]
    mask = padding_mask(form, lengths, seqlen_q, seqlen_k, "cpu")
    if form == "causal_left" and masked == "finfo.min":  # the left-padded rows see no key: not for finfo.min
        mask = padding_mask("keys_left", lengths, seqlen_q, seqlen_k, "cpu")
    value = float("-inf") if masked == "-inf" else torch.finfo(torch.bfloat16).min
    q, k, v = make(3, 2, 2, seqlen_q, seqlen_k, 16, torch.bfloat16)
    check_sdpa(q, k, v, attn_mask=additive(mask, torch.bfloat16, value))
    assert set(kinds(calls)) == {"varlen"}


@parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=[torch.float16]))
def test_static_cache_and_sliding_window_with_left_padding(device, dtype, calls):
    """A chunk of queries over a static cache longer than the keys in use (the keys past the last query's
    position are masked), and a sliding window, both with left padding: one varlen call each."""
    seqlen_q, cache, used = (7, 64, 40) if device == "cpu" else (100, 512, 300)
    lengths = [used, used // 3, 5]
    keys = padding(lengths, used, "left", device)
    keys = torch.cat([keys, torch.zeros(3, cache - used, dtype=torch.bool, device=device)], 1)
    band = causal(seqlen_q, cache, used - seqlen_q, device)
    q, k, v = make(3, 4, 4, seqlen_q, cache, 64, dtype, device)
    check_sdpa(q, k, v, attn_mask=(band & keys[:, None])[:, None])
    window = band & ~causal(seqlen_q, cache, used - seqlen_q - 16, device)
    check_sdpa(q, k, v, attn_mask=(window & keys[:, None])[:, None])
    assert kinds(calls) == ["varlen", "varlen"]
    assert calls[1][2]["window_size"] == (15, -1) and calls[1][2]["causal"]


@parametrize_devices(
    cpu=dict(form=["keys_right", "keys_left", "causal_left"], seqlens=[(1, 40), (33, 33)], head_dim=[32]),
    cuda=dict(form=["keys_right", "causal_left"], seqlens=[(1, 400), (16, 400), (300, 300)], head_dim=[128, 96]),
)
def test_inference_reads_the_keys_in_place(device, form, seqlens, head_dim, calls):
    """Without gradients and dropout, a key range per batch row over every query row (padding, causal with left
    padding: generation) runs flash_ext.attention_with_kvcache's kernels on the keys where they are; causal with
    right padding still takes the varlen calls (its two bands do not cover every row)."""
    seqlen_q, seqlen_k = seqlens
    lengths = [seqlen_k, seqlen_k // 2, 0, 3]
    mask = padding_mask(form, lengths, seqlen_q, seqlen_k, device)
    q, k, v = make(len(lengths), 4, 2, seqlen_q, seqlen_k, head_dim, torch.bfloat16, device, layout="contiguous")
    with torch.no_grad():
        check_sdpa(q, k, v, attn_mask=mask, enable_gqa=True, backward=False)
    assert kinds(calls) == ["kvcache"]
    _, (_, k_used, v_used), _ = calls[0]
    assert k_used.data_ptr() == k.data_ptr() and v_used.data_ptr() == v.data_ptr()
    calls.clear()
    with torch.no_grad():
        check_sdpa(q, k, v, attn_mask=padding_mask("causal_right", lengths, seqlen_q, seqlen_k, device),
                   enable_gqa=True, backward=False)
    # One query row is only key padding.
    assert kinds(calls) == (["varlen", "varlen"] if seqlen_q > 1 else ["kvcache"])


@parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=[torch.bfloat16]))
def test_rows_that_see_no_key_are_zero(device, dtype):
    """Rows that see no key return 0 with zero gradients, as torch's SDPA (math backend, torch >= 2.5): the
    left-padded rows of a causal mask and the first row of a strictly causal one."""
    seqlen = 24
    q, k, v = make(2, 2, 2, seqlen, seqlen, 64, dtype, device)
    for mask in (padding_mask("causal_left", [seqlen, 10], seqlen, seqlen, device),
                 causal(seqlen, seqlen, -1, device)):
        out, (dq, _, _) = check_sdpa(q, k, v, attn_mask=mask)
        empty = ~mask.expand(2, 1, seqlen, seqlen).any(-1).squeeze(1)  # (batch, seqlen_q)
        assert empty.any()
        assert not out.transpose(1, 2)[empty].any() and not dq.transpose(1, 2)[empty].any()


@parametrize_devices(cpu=dict(seqlens=[(0, 5), (5, 0), (0, 0)]), cuda=dict(seqlens=[(0, 5), (5, 0)]))
def test_empty_sequences(device, seqlens):
    """No query or no key, with is_causal and with a mask: empty or zero results, like SDPA."""
    seqlen_q, seqlen_k = seqlens
    q, k, v = make(2, 2, 2, seqlen_q, seqlen_k, 16, torch.bfloat16, device)
    for options in (dict(), dict(is_causal=True),
                    dict(attn_mask=torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device))):
        out = sdpa(q, k, v, **options)
        assert out.shape == (2, 2, seqlen_q, 16) and not out.any()


def random_masks(count, seed=0):
    """(family, mask (batch, 1, seqlen_q, seqlen_k)) for random shapes: "band" is a supported form (a causal or
    windowed band at a random offset, with left padding, or with right padding and no left window side),
    "ranges" random key ranges per row, "pattern" random masks."""
    generator = torch.Generator().manual_seed(seed)

    def randint(low, high):
        return int(torch.randint(low, high + 1, (), generator=generator))

    for index in range(count):
        batch, seqlen_q, seqlen_k = randint(1, 4), randint(1, 12), randint(1, 12)
        i, j = torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)[None]
        family = ("band", "ranges", "pattern")[index % 3]
        if family == "band":
            side = ("left", "right")[randint(0, 1)]
            left = -1 if side == "right" or randint(0, 1) else randint(0, 6)
            right, offset = (-1 if randint(0, 3) == 0 else randint(0, 6)), randint(-5, 5)
            band = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
            if left >= 0:
                band &= j >= i + offset - left
            if right >= 0:
                band &= j <= i + offset + right
            keys = padding([randint(0, seqlen_k) for _ in range(batch)], seqlen_k, side)
            mask = band[None] & keys[:, None]
        elif family == "ranges":
            start = torch.randint(0, seqlen_k + 1, (batch, seqlen_q, 1), generator=generator)
            end = torch.randint(0, seqlen_k + 1, (batch, seqlen_q, 1), generator=generator)
            mask = (j >= start) & (j < end)
        else:
            mask = torch.rand(batch, seqlen_q, seqlen_k, generator=generator) > 0.3
        yield family, mask[:, None]


def test_random_masks_are_exact_or_rejected():
    """Every mask that is accepted gives SDPA's result; the supported forms are accepted."""
    accepted = {"band": 0, "ranges": 0, "pattern": 0}
    for family, mask in random_masks(90):
        batch, _, seqlen_q, seqlen_k = mask.shape
        q, k, v = make(batch, 2, 2, seqlen_q, seqlen_k, 8, torch.float32)
        try:
            out = sdpa(q, k, v, attn_mask=mask)
        except ValueError as error:
            assert family != "band", f"a supported mask is rejected: {error}\n{mask[:, 0].int()}"
            assert "supported attn_mask forms" in str(error)
            continue
        accepted[family] += 1
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        assert (out.double() - ref).abs().max() < 1e-5, mask[:, 0].int()
    assert accepted["band"] == 30 and accepted["ranges"] + accepted["pattern"] > 0, accepted


# ---- Masks that are rejected -------------------------------------------------------------------


def rejected_masks(seqlen_q, seqlen_k, batch, heads):
    generator = torch.Generator().manual_seed(0)
    blocks = torch.block_diag(*(torch.ones(n, n, dtype=torch.bool) for n in (6, 9, seqlen_q - 15)))
    per_head = causal(seqlen_q, seqlen_k)[None].repeat(heads, 1, 1)
    per_head[1] = causal(seqlen_q, seqlen_k, 3)
    return {
        "random": (torch.rand(seqlen_q, seqlen_k, generator=generator) > 0.5, "not one contiguous range of keys"),
        "bias": (torch.randn(seqlen_q, seqlen_k, generator=generator), "values other than 0, -inf"),
        "finfo_min_row": (additive(causal(seqlen_q, seqlen_k, -1), masked=torch.finfo(torch.float32).min),
                          "masks every key by the finite value"),
        "per_head": (per_head, "differs between heads"),
        "three_documents": (blocks, "follow no band"),
        "causal_right_padding_with_window": (
            ((causal(seqlen_q, seqlen_k) & ~causal(seqlen_q, seqlen_k, -4))[None]
             & padding([seqlen_k, 9], seqlen_k, "right")[:, None])[:, None],
            "follow no band"),
        "integer": (torch.ones(seqlen_q, seqlen_k, dtype=torch.int64), "bool or floating-point"),
        "wrong_shape": (torch.ones(seqlen_q + 1, seqlen_k, dtype=torch.bool), "does not broadcast"),
    }


@pytest.mark.parametrize("name", list(rejected_masks(30, 30, 2, 2)))
def test_unsupported_masks_are_rejected(name):
    q, k, v = make(2, 2, 2, 30, 30, 16, torch.float32)
    mask, message = rejected_masks(30, 30, 2, 2)[name]
    if name not in ("integer", "wrong_shape"):  # SDPA rejects these too; it runs the others
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with pytest.raises(ValueError, match=message) as error:
        sdpa(q, k, v, attn_mask=mask)
    if name not in ("integer", "wrong_shape"):
        assert "supported attn_mask forms" in str(error.value)


def test_mask_errors():
    q, k, v = make(2, 2, 2, 10, 12, 16, torch.float32)
    mask = torch.ones(10, 12, dtype=torch.bool)
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        sdpa(q, k, v, attn_mask=mask, is_causal=True)
    bias = torch.zeros(10, 12, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        sdpa(q, k, v, attn_mask=bias)
    with torch.no_grad():
        sdpa(q, k, v, attn_mask=bias)
    with pytest.raises(TypeError, match="attn_mask must be None or a torch.Tensor"):
        sdpa(q, k, v, attn_mask=[[True]])


# ---- Dropout ---------------------------------------------------------------------------------------


@parametrize_devices(
    cpu=dict(seqlens=[(40, 56), (56, 40)], dtype=[torch.bfloat16]),
    cuda=dict(seqlens=[(256, 300), (300, 256)], dtype=[torch.bfloat16]),
)
def test_dropout_is_flash_ext_dropout(device, seqlens, dtype):
    """With is_causal and dropout, the call is flash_ext.attention's with the same seed (bit for bit), and its
    output and gradients match SDPA with the call's own keep mask (flash_ext.testing), as a float64
    reference."""
    seqlen_q, seqlen_k, p = *seqlens, 0.2
    q, k, v = make(2, 4, 2, seqlen_q, seqlen_k, 64, dtype, device)
    torch.manual_seed(11)
    out = sdpa(q, k, v, is_causal=True, dropout_p=p, enable_gqa=True)
    # The same call through the testing helper: its rng_state gives the keep mask.
    torch.manual_seed(11)
    keys = min(seqlen_q, seqlen_k)
    if seqlen_q <= seqlen_k:
        options = dict(causal=True)
        k_used, v_used = k[:, :, :keys], v[:, :, :keys]
    else:
        options = dict(window_size=(-1, seqlen_q - seqlen_k))
        k_used, v_used = k, v
    direct, _, rng_state = attention_with_rng_state(q.transpose(1, 2), k_used.transpose(1, 2),
                                                    v_used.transpose(1, 2), dropout_p=p, **options)
    assert torch.equal(out, direct.transpose(1, 2))
    # Element (b, h, i, j) of the keep mask does not depend on the sequence lengths: the full mask applies.
    keep = dropout_keep_mask(rng_state, 2, 4, seqlen_q, seqlen_k, p)
    assert 0.7 < keep.double().mean() < 0.9
    torch.manual_seed(11)
    check_sdpa(q, k, v, is_causal=True, dropout_p=p, enable_gqa=True, keep=keep)


@parametrize_devices(cpu=dict(form=["keys_right", "causal_right"]), cuda=dict(form=["keys_right", "causal_right"]))
def test_dropout_with_padding_masks(device, form):
    """Dropout on the varlen paths: with uniform scores (q = 0) and value 1 on the keys a row sees, each output
    is (kept keys / seen keys) / (1 - p): its mean over all rows is 1 (within 6 standard deviations), and no
    masked key (value 1000) leaks in."""
    p, seqlen = 0.25, 48 if device == "cpu" else 256
    lengths = [seqlen, seqlen // 2, 7, seqlen - 1]
    mask = padding_mask(form, lengths, seqlen, seqlen, device)
    q = torch.zeros(4, 4, seqlen, 8, dtype=torch.bfloat16, device=device)
    k = torch.randn(4, 4, seqlen, 8, dtype=torch.bfloat16, device=device)
    v = torch.where(padding(lengths, seqlen, "right", device)[:, None, :, None], 1.0, 1000.0).to(torch.bfloat16)
    v = v.expand(4, 4, seqlen, 8)
    out = sdpa(q, k, v, attn_mask=mask, dropout_p=p)[..., 0].double()  # (batch, heads, seqlen_q)
    assert out.max() <= 1 / (1 - p) * (1 + 2**-7), "a masked key leaked in, or the scaling is off"
    seen = mask.expand(4, 1, seqlen, seqlen).sum(-1).double()  # keys each row sees
    kept_keys = (out * (1 - p) * seen).sum()
    trials = seen.sum() * 4  # (row, key) pairs, over the heads
    assert abs(kept_keys / trials - (1 - p)) < 6 * math.sqrt(p * (1 - p) / trials)
    assert (out != 1).double().mean() > 0.5, "dropout is not applied"


# ---- Shapes, layouts and copies ------------------------------------------------------------------------


SHAPES = {
    # name: shapes of query, key, value
    "2d": ((20, 16), (30, 16), (30, 16)),
    "3d": ((3, 20, 16), (3, 30, 16), (3, 30, 16)),
    "5d": ((2, 3, 4, 20, 16), (2, 3, 4, 30, 16), (2, 3, 4, 30, 16)),
    "batch_broadcast": ((2, 3, 4, 20, 16), (1, 3, 4, 30, 16), (2, 1, 4, 30, 16)),
    "key_rank_3": ((2, 4, 20, 16), (4, 30, 16), (4, 30, 16)),
}


@pytest.mark.parametrize("shapes", list(SHAPES))
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_shapes(shapes, is_causal):
    q, k, v = (torch.randn(shape) for shape in SHAPES[shapes])
    check_sdpa(q, k, v, is_causal=is_causal)


def test_3d_inputs_with_enable_gqa_and_a_mask():
    """For 3-D inputs SDPA's enable_gqa groups dimension 0 (dimension -3) as heads, and a mask broadcasts."""
    q, k, v = torch.randn(6, 20, 16), torch.randn(2, 25, 16), torch.randn(2, 25, 16)
    check_sdpa(q, k, v, enable_gqa=True, attn_mask=causal(20, 25, 5))


@pytest.mark.parametrize("layout", ["projection", "contiguous"])
def test_inputs_reach_the_kernels_without_a_copy(layout, calls):
    """(batch, seqlen, heads, head_dim).transpose(1, 2) and SDPA's contiguous layout are both strided views of
    flash_ext's layout: the dense call gets views of the inputs' storage, and the output is the transposed view
    of a contiguous (batch, seqlen_q, heads, head_dim) tensor."""
    q, k, v = make(2, 4, 2, 30, 40, 32, torch.bfloat16, layout=layout)
    out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    (_, (q_used, k_used, v_used), _), = calls
    for given, used in ((q, q_used), (k, k_used), (v, v_used)):
        assert used.data_ptr() == given.data_ptr() and used.stride() == given.transpose(1, 2).stride()
    assert out.transpose(1, 2).is_contiguous()


# ---- Bad inputs ------------------------------------------------------------------------------------------


def bad_inputs():
    q, k, v = make(2, 4, 2, 10, 12, 16, torch.float32)
    return [
        ((q.double(), k.double(), v.double()), {}, ValueError, "query has dtype torch.float64"),
        ((q, k.bfloat16(), v), {}, ValueError, "one dtype"),
        ((q, k, v[..., :8]), dict(enable_gqa=True), ValueError, "value's last dimension"),
        ((q, k[..., :8], v), dict(enable_gqa=True), ValueError, "key's last dimension"),
        ((q, k, v[:, :, :5]), dict(enable_gqa=True), ValueError, "same sequence length"),
        ((q[:, :3], k, v), dict(enable_gqa=True), ValueError, r"must be a multiple"),
        ((q, k, v[:, :1]), dict(enable_gqa=True), ValueError, "same number of heads"),
        ((q, k, v), dict(enable_gqa=True, scale=0.0), ValueError, "scale must be None"),
        ((q, k, v), dict(enable_gqa=True, scale=-1.0), ValueError, "scale must be None"),
        ((q, k, v), dict(enable_gqa=True, scale=float("inf")), ValueError, "scale must be None"),
        ((q, k, v), dict(enable_gqa=True, dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
        ((q, k, v), dict(enable_gqa=True, dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
        ((q, k, v), dict(enable_gqa=True, is_causal=1), TypeError, "is_causal must be a bool"),
        ((q, k, v), dict(enable_gqa="yes"), TypeError, "enable_gqa must be a bool"),
        ((q, k, v), dict(enable_gqa=True, dropout_p=torch.tensor(0.1)), TypeError, "dropout_p must be a real"),
        ((q, k, torch.randn(3, 2, 12, 16)), dict(enable_gqa=True), ValueError, "batch dimensions"),
        ((q.numpy(), k, v), {}, TypeError, "query must be a torch.Tensor"),
    ]


@pytest.mark.parametrize("args,kwargs,error,message", bad_inputs())
def test_bad_inputs_are_rejected(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        sdpa(*args, **kwargs)


@pytest.mark.cuda
def test_float32_on_cuda_is_rejected():
    q, k, v = make(1, 2, 2, 8, 8, 64, torch.float32, "cuda")
    with pytest.raises(ValueError, match="cast to float16 / bfloat16"):
        sdpa(q, k, v)
    mask = torch.ones(8, 8, dtype=torch.bool)  # on the CPU
    with pytest.raises(ValueError, match="attn_mask is on cpu"):
        sdpa(q.half(), k.half(), v.half(), attn_mask=mask)


@pytest.mark.slow
def test_torch_compile_fullgraph_without_a_mask():
    """No mask and is_causal read no tensor values: they compile without graph breaks."""
    q, k, v = make(2, 4, 2, 24, 40, 32, torch.float32)
    compiled = torch.compile(lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True), fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), sdpa(q, k, v, is_causal=True, enable_gqa=True), rtol=0, atol=0)
