"""flash_ext as an attention implementation of Hugging Face transformers.

    import flash_ext.integrations.transformers as flash_ext_hf

    name = flash_ext_hf.register()                 # "fext"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name, dtype=torch.bfloat16)

register() adds two functions under one name: attention_forward to transformers' AttentionInterface (what
each attention layer calls) and key_padding_mask to its AttentionMaskInterface (what the model calls once
per forward to build the mask handed to every layer). The name contains no "flash": transformers takes an
attn_implementation containing "flash" for a flash-attn package or Hub kernel and tries to import it when
the model is created, which fails for flash_ext.

What a layer call computes (query (batch, heads_q, seqlen_q, head_dim), key and value (batch, heads_kv,
seqlen_k, head_dim), as transformers passes them; returns (out (batch, seqlen_q, heads_q, head_dim), None)):

- no padding: flash_ext.attention, causal as the module (or an `is_causal` keyword) says; masks align
  bottom-right, so queries that follow cached keys (generation with a DynamicCache) need nothing else.
- padding (a 2-D mask from key_padding_mask): the real tokens are packed, run through
  flash_ext.attention_varlen, and scattered back; padded query rows get zeros.
- packed sequences (batch rows holding several sequences, no mask): from transformers' cu_seq_lens_q /
  cu_seq_lens_k / max_length_q / max_length_k keywords (DataCollatorWithFlattening with
  return_flash_attn_kwargs=True) when given, else from position_ids of shape (batch, seqlen) (a new
  sequence wherever a position is not the previous one + 1, as transformers' own masks decide; the shared
  (1, seqlen) row that models make for batch > 1 is not read): flash_ext.attention_varlen.
- inference (nothing requires grad, no dropout) with cached keys (seqlen_q < seqlen_k, or a static cache's
  buffer) or with rows padded on the left only (as generate() pads them): flash_ext.attention_with_kvcache
  on the keys transformers' cache returns, read in place (on CUDA, head dims 64/128/256, the split-KV
  decode kernel), padding through cache_leftpad. transformers' Cache.update has already appended the new
  keys, so attention_with_kvcache's own append (and rotary) is not used. Other padding takes the varlen path.
- sliding_window w: causal layers see the w most recent keys, themselves included (window (w - 1, 0));
  bidirectional ones the keys within distance w (window (w, w)), as transformers' masks define them.
- softcap (Gemma 2's attn_logit_softcapping), dropout (the layer's attention_dropout in training), GQA
  (k and v are never repeated) and `scaling` pass through to flash_ext.

Not supported, with an error: 4-D masks (user-built or a model's own), attention sinks (s_aux),
position_bias, chunked attention (configs with attention_chunk_size, Llama 4), and masks that overlay
custom patterns on the causal one (or_mask_function / and_mask_function: multimodal models' bidirectional
image blocks).

Host syncs: the mask builder reads the cache's length when a static cache is in use and checks whether a
2-D mask has padding (once per forward); a layer call with padding, or with (batch, seqlen) position_ids
and no mask (batch 1 included), reads lengths from the device (once per layer), as transformers'
flash-attention path does; under torch.compile each is a graph break.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import interface as _flash

__all__ = ["ATTN_IMPLEMENTATION", "register", "attention_forward", "key_padding_mask"]

ATTN_IMPLEMENTATION = "fext"

_BUILTIN_NAMES = ("eager", "sdpa", "flex_attention", "paged|eager")


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Registers flash_ext with transformers under `name` and returns it, for
    `from_pretrained(..., attn_implementation=name)` (or `model.set_attn_implementation(name)`).

    Registering again (any number of times, under any number of names) is allowed. transformers is
    imported here, not when flash_ext or this module is imported.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"flash_ext.integrations.transformers.register: name must be a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(
            f"flash_ext.integrations.transformers.register: name must not contain 'flash', got {name!r}: "
            "transformers takes an attn_implementation containing 'flash' for a flash-attn package or a Hub kernel "
            f"and fails to create the model; use the default {ATTN_IMPLEMENTATION!r} or another name")
    if "/" in name or ":" in name or "|" in name or name in _BUILTIN_NAMES:
        raise ValueError(
            f"flash_ext.integrations.transformers.register: name {name!r} is taken by transformers (a built-in "
            "implementation, or the 'org/repo' / 'paged|' patterns of Hub kernels); choose a plain new name")
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "flash_ext.integrations.transformers.register needs the transformers package, which is not installed: "
            "pip install 'flash_ext[hf]' (or pip install transformers)") from error
    mask_interface = getattr(transformers, "AttentionMaskInterface", None)
    if mask_interface is None:
        raise ImportError(
            f"flash_ext.integrations.transformers.register needs transformers.AttentionMaskInterface, which "
            f"transformers {transformers.__version__} lacks (it builds 4-D masks inside each model); upgrade "
            "transformers")
    transformers.AttentionInterface.register(name, attention_forward)
    mask_interface.register(name, key_padding_mask)
    return name


# ---- the mask builder ------------------------------------------------------------------------------


def key_padding_mask(batch_size: int, q_length: Optional[int] = None, kv_length: Optional[int] = None,
                     q_offset: Any = 0, kv_offset: int = 0, mask_function: Any = None,
                     attention_mask: Optional[Tensor] = None, **kwargs: Any) -> Optional[Tensor]:
    """transformers' mask-interface function for flash_ext: None, or a bool (batch, L) mask of the keys a layer
    call gets: True for a real token, False for padding.

    attention_mask (batch, tokens seen so far, cached and new) is transformers' 2-D padding mask; its last
    columns are the layer call's keys. For causal masks, L is the number of keys the cache has written
    (q_offset + q_length - kv_offset, at most kv_length): a static cache hands the layer its whole buffer, and
    the layer call uses its first L rows. For bidirectional ones (encoders, cross-attention) L = kv_length.
    None means all kv_length keys are real. transformers versions that pass cache_position (the queries'
    positions) instead of q_length and q_offset are served too.
    """
    if q_length is None:
        cache_position = kwargs["cache_position"]
        q_length, q_offset = cache_position.shape[0], (cache_position[0] if cache_position.numel() else 0)
    if getattr(kwargs.get("config"), "attention_chunk_size", None) is not None:
        raise NotImplementedError(
            "flash_ext (transformers integration): chunked attention (config.attention_chunk_size) is not supported: "
            "flash_ext's masks are causal, sliding-window and padding masks; use attn_implementation='sdpa'")
    if kwargs.get("use_vmap"):
        raise NotImplementedError(
            "flash_ext (transformers integration): this model overlays a custom pattern on the causal mask "
            "(or_mask_function / and_mask_function, e.g. bidirectional image tokens), which flash_ext's padding "
            "and window masks cannot express; use attn_implementation='sdpa' for it")
    written = kv_length
    if _is_causal_pattern(mask_function):
        written = min(kv_length, int(q_offset) + q_length - kv_offset)  # q_offset: a tensor for static caches
    if attention_mask is None:
        if written == kv_length:
            return None
        device = kwargs.get("device") or (q_offset.device if isinstance(q_offset, Tensor) else None)
        return torch.ones(batch_size, written, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:
        return attention_mask  # a 4-D mask of the caller's: attention_forward explains why it refuses it
    if attention_mask.shape[-1] < written:
        raise ValueError(
            f"flash_ext (transformers integration): the 2-D attention_mask covers {attention_mask.shape[-1]} tokens, "
            f"but the layers attend to {written} keys; pass a mask over every token seen so far (cached and new)")
    # The mask's last column and the last written key are both the newest token. Aligning them (rather than
    # counting kv_offset from the mask's start) also leaves a mask of this function unchanged when it comes
    # back as the input: generate() builds the masks of compileable caches ahead and the model builds again.
    mask = attention_mask.to(torch.bool)[:, attention_mask.shape[-1] - written:]
    if written == kv_length and bool(mask.all()):
        return None
    return mask


def _is_causal_pattern(mask_function: Any) -> bool:
    """Whether transformers' mask predicate keeps query 0 from key 1 (causal, sliding-window causal, chunked)
    rather than letting it see it (bidirectional, cross-attention). Without a predicate: causal."""
    if mask_function is None:
        return True
    zero, one = torch.tensor(0), torch.tensor(1)
    try:
        return not bool(mask_function(zero, zero, zero, one))
    except (IndexError, RuntimeError, TypeError):  # a predicate over tensors this probe does not fit
        return True


# ---- the attention function ------------------------------------------------------------------------


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      **kwargs: Any) -> Tuple[Tensor, None]:
    """transformers' attention-interface function for flash_ext (see the module docstring).

    query: (batch, heads_q, seqlen_q, head_dim); key, value: (batch, heads_kv, seqlen_k, head_dim(_v)).
    attention_mask: None or the bool (batch, L) mask of key_padding_mask, L <= seqlen_k.
    Keywords read: is_causal (else module.is_causal, else True), deterministic (else
    torch.are_deterministic_algorithms_enabled()), position_ids, cu_seq_lens_q / cu_seq_lens_k /
    max_length_q / max_length_k; others (use_cache, output_attentions, ...) are ignored.
    Returns (out (batch, seqlen_q, heads_q, head_dim_v), None): no attention weights.
    """
    for unsupported in ("s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"flash_ext (transformers integration): {unsupported} is not supported; use "
                                      "attn_implementation='eager' or 'sdpa' for this model")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"flash_ext (transformers integration): {name} must be a 4-D tensor (batch, heads, "
                             f"seqlen, head_dim), got {_flash._describe(t)}")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    options = dict(causal=is_causal, softmax_scale=scaling, window_size=_window(sliding_window, is_causal),
                   softcap=0.0 if softcap is None else softcap)
    dropout_p = 0.0 if dropout is None else float(dropout)

    # flash_ext's layout is (batch, seqlen, heads, head_dim): transposed views, read in place.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v = _cast_for_cuda(q, k, v)
    head_dim_v = v.shape[-1]
    if head_dim_v != q.shape[-1]:
        v = _pad_value(v, q.shape[-1])

    if not is_causal and sliding_window is not None and q.shape[1] != k.shape[1]:
        # transformers places such queries at positions 0 .. seqlen_q - 1 of the keys (top-left); flash_ext's
        # windows are bottom-right aligned. No model has windowed cross-attention.
        raise NotImplementedError("flash_ext (transformers integration): a bidirectional sliding window needs as many "
                                  f"queries as keys, got seqlen_q {q.shape[1]} and seqlen_k {k.shape[1]}")
    mask = _check_mask(attention_mask, q.shape[0], k.shape[1])
    if mask is not None and mask.shape[1] < k.shape[1]:  # a static cache's unwritten rows
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    inference = dropout_p == 0.0 and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))

    if mask is not None:
        out = _padded(q, k, v, mask, inference, options, dropout_p, deterministic)
    else:
        packing = _packing(kwargs, q.shape[0], q.shape[1], k.shape[1], q.device)
        if packing is not None:
            out = _packed(q, k, v, packing, options, dropout_p, deterministic)
        elif inference and q.shape[1] < k.shape[1]:
            out = _flash.attention_with_kvcache(q, k, v, **options)
        else:
            out = _flash.attention(q, k, v, dropout_p=dropout_p, deterministic=deterministic, **options)
    if head_dim_v != out.shape[-1]:
        out = out[..., :head_dim_v]
    return out, None


def _window(sliding_window: Any, causal: bool) -> Tuple[int, int]:
    """flash_ext's window_size for transformers' sliding_window: a causal query sees keys q - w + 1 .. q
    (w keys, itself included); a bidirectional one keys with |q - k| <= w."""
    if sliding_window is None:
        return (-1, -1)
    window = _flash._as_int("sliding_window", sliding_window)
    if window < 1:
        raise ValueError(f"flash_ext (transformers integration): sliding_window must be None or >= 1, got {window}")
    return (window - 1, 0) if causal else (window, window)


def _cast_for_cuda(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """float32 on CUDA runs in the autocast dtype when autocast is on (the CUDA kernels take float16 and
    bfloat16 only); without autocast it is an error that says what to do."""
    if q.device.type != "cuda" or q.dtype != torch.float32:
        return q, k, v
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return q.to(dtype), k.to(dtype), v.to(dtype)
    raise TypeError("flash_ext (transformers integration): the CUDA kernels take float16 or bfloat16, but the "
                    "attention inputs are float32; load the model with dtype=torch.bfloat16 (or torch.float16), or "
                    "run it under torch.autocast('cuda', dtype=torch.bfloat16)")


def _pad_value(v: Tensor, head_dim: int) -> Tensor:
    """v zero-padded to q's head_dim (models whose value head dim is smaller, e.g. MLA); the extra output
    columns are zeros and are cut off again."""
    if v.shape[-1] > head_dim:
        raise ValueError(f"flash_ext (transformers integration): the value head dim ({v.shape[-1]}) must not exceed "
                         f"the query / key head dim ({head_dim})")
    return torch.nn.functional.pad(v, (0, head_dim - v.shape[-1]))


def _check_mask(attention_mask: Any, batch: int, seqlen_k: int) -> Optional[Tensor]:
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        raise TypeError("flash_ext (transformers integration): attention_mask must be None or a tensor, got "
                        f"{_flash._describe(attention_mask)}")
    if attention_mask.dim() != 2:
        raise ValueError(
            "flash_ext (transformers integration): attention_mask must be None or a 2-D (batch, seqlen_k) padding "
            f"mask, got shape {tuple(attention_mask.shape)}: flash_ext computes causal, sliding-window and padding "
            "masks itself and takes no arbitrary 4-D masks. Pass the 2-D padding mask to the model (it builds the "
            "rest), or use attn_implementation='sdpa' for a custom mask")
    if attention_mask.shape[0] != batch or attention_mask.shape[1] > seqlen_k:
        raise ValueError("flash_ext (transformers integration): attention_mask has shape "
                         f"{tuple(attention_mask.shape)}; expected (batch={batch}, at most seqlen_k={seqlen_k})")
    return attention_mask.to(torch.bool)


def _cu_seqlens(lengths: Tensor) -> Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _max_length(lengths: Tensor) -> int:
    return int(lengths.max()) if lengths.numel() else 0


def _padded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, inference: bool, options: dict, dropout_p: float,
            deterministic: bool) -> Tensor:
    """Attention with a (batch, seqlen_k) key padding mask; the queries are the last seqlen_q positions."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    if seqlen_q > seqlen_k:
        raise ValueError(f"flash_ext (transformers integration): with a padding mask, seqlen_q ({seqlen_q}) must not "
                         f"exceed the number of keys ({seqlen_k})")
    key_lengths = mask.sum(-1, dtype=torch.int32)
    if inference:
        # Rows padded on the left only (as generate() pads) are a cache with cache_leftpad: read in place.
        leftpad = (mask.cumsum(-1) == 0).sum(-1, dtype=torch.int32)
        if bool((key_lengths == seqlen_k - leftpad).all()):
            seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=q.device)
            return _flash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad, **options)
    k_packed, v_packed = k[mask], v[mask]
    restricted = options["causal"] or options["window_size"] != (-1, -1)
    if restricted:
        # Positions matter: a query row is a token of the sequence (the last seqlen_q ones), padding or not.
        query_mask = mask[:, seqlen_k - seqlen_q:]
        q_packed = q[query_mask]
        query_lengths = query_mask.sum(-1, dtype=torch.int32)
    else:
        # Every query sees every real key (also cross-attention, whose queries are not among the keys).
        q_packed = q.reshape(batch * seqlen_q, heads_q, head_dim)
        query_lengths = torch.full((batch,), seqlen_q, dtype=torch.int32, device=q.device)
    out = _flash.attention_varlen(q_packed, k_packed, v_packed, _cu_seqlens(query_lengths), _cu_seqlens(key_lengths),
                                  _max_length(query_lengths), _max_length(key_lengths), dropout_p=dropout_p,
                                  deterministic=deterministic, **options)
    if not restricted:
        return out.view(batch, seqlen_q, heads_q, head_dim)
    return out.new_zeros(batch, seqlen_q, heads_q, head_dim).index_put((query_mask,), out)


def _packing(kwargs: dict, batch: int, seqlen_q: int, seqlen_k: int,
             device: torch.device) -> Optional[Tuple[Tensor, Tensor, int, int]]:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) over the batch's tokens flattened, when
    rows hold several sequences; None when each row is one sequence."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    given = [kwargs.get(name) for name in names]
    if any(value is not None for value in given):
        missing = [name for name, value in zip(names, given) if value is None]
        if missing:
            raise ValueError("flash_ext (transformers integration): packed sequences need all of "
                             f"{', '.join(names)}; missing {', '.join(missing)}")
        cu_q, cu_k, max_q, max_k = given
        return (cu_q.to(device=device, dtype=torch.int32), cu_k.to(device=device, dtype=torch.int32), int(max_q),
                int(max_k))
    # Only position ids with a row per batch row are read: models make a single shared row, (1, seqlen), when
    # none are passed, and skipping it keeps batches of plain rows free of a host sync (and of a graph break
    # under torch.compile).
    position_ids = kwargs.get("position_ids")
    if (not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.shape != (batch, seqlen_q)
            or seqlen_q != seqlen_k or seqlen_q < 2):
        return None
    positions = position_ids.to(device)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    first = starts.flatten().nonzero().flatten()
    cu = torch.cat([first, first.new_tensor([batch * seqlen_q])]).to(torch.int32)
    longest = _max_length(cu[1:] - cu[:-1])
    return cu, cu, longest, longest


def _packed(q: Tensor, k: Tensor, v: Tensor, packing: Tuple[Tensor, Tensor, int, int], options: dict,
            dropout_p: float, deterministic: bool) -> Tensor:
    batch, seqlen_q, heads_q, head_dim = q.shape
    flat = [t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v)]
    out = _flash.attention_varlen(*flat, *packing, dropout_p=dropout_p, deterministic=deterministic, **options)
    return out.view(batch, seqlen_q, heads_q, head_dim)
