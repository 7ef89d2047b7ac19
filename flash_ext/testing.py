"""Helpers for testing code that uses flash_ext.

The exact dropout keep mask of a call, so that a plain-PyTorch reference (flash_ext.reference) can
apply the same mask:

    out, lse, rng_state = flash_ext.testing.attention_with_rng_state(q, k, v, dropout_p=0.1)
    keep = flash_ext.testing.dropout_keep_mask(rng_state, batch, heads_q, seqlen_q, seqlen_k, 0.1)
    out_ref, lse_ref = flash_ext.reference.attention_ref(q, k, v, dropout_p=0.1, dropout_mask=keep)

Process-wide settings of the CUDA path, as context managers that restore the previous setting:

    with flash_ext.testing.sm90_kernels(False):    # the sm80 kernels only, also on an H100 / H200
        ...
    with flash_ext.testing.poison_scratch(True):   # NaN-filled backward scratch (a test aid)
        ...

The environment variables FLASH_EXT_DISABLE_SM90=1 and FLASH_EXT_DEBUG_POISON_SCRATCH=1 give the
initial settings; they are read once, when flash_ext loads.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence, Tuple, Union

import torch
from torch import Tensor

from .interface import _as_bool, _attention, _attention_varlen

__all__ = ["attention_with_rng_state", "attention_varlen_with_rng_state", "dropout_keep_mask", "sm90_kernels",
           "poison_scratch"]


def attention_with_rng_state(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor, Tensor]:
    """flash_ext.attention(q, k, v, **kwargs) (without return_lse), returning (out, lse, rng_state):
    rng_state is int64 [seed, offset] of the dropout mask, zeros without dropout. Differentiable like
    flash_ext.attention."""
    return _attention(q, k, v, **kwargs)


def attention_varlen_with_rng_state(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int,
                                    **kwargs: Any) -> Tuple[Tensor, Tensor, Tensor]:
    """flash_ext.attention_varlen(...) returning (out, lse, rng_state), as attention_with_rng_state."""
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def dropout_keep_mask(rng_state: Union[Tensor, Sequence[int]], batch: int, heads_q: int, seqlen_q: int,
                      seqlen_k: int, dropout_p: float) -> Tensor:
    """The keep mask (True = kept) of a call that returned rng_state: bool (batch, heads_q, seqlen_q,
    seqlen_k) on the CPU. rng_state is that int64 tensor [seed, offset], or a (seed, offset) pair of
    Python ints (seed in 0..2^64-1).

    Computed by the Philox function of csrc/common/philox.h, which the CPU path uses and the CUDA
    kernels are to use: element (b, h, i, j) depends only on (seed, offset, b * heads_q + h, i, j).
    For attention_varlen, batch is the number of sequences and seqlen_* the longest lengths;
    sequence b's mask is mask[b, :, :len_q(b), :len_k(b)]."""
    if not isinstance(rng_state, torch.Tensor):
        # int64 holds the 64 bits of the unsigned seed and offset.
        rng_state = torch.tensor([value - 2**64 if value >= 2**63 else value for value in rng_state],
                                 dtype=torch.int64)
    return torch.ops.flash_ext.dropout_keep_mask(rng_state.cpu(), batch, heads_q, seqlen_q, seqlen_k,
                                                 float(dropout_p))


def _setting_op(name: str):
    op = getattr(torch.ops.flash_ext, name, None)
    if op is None:
        raise RuntimeError(f"flash_ext: this build of flash_ext has no torch.ops.flash_ext.{name} op; rebuild it "
                           "from a source tree that has it")
    return op


@contextlib.contextmanager
def _setting(name: str, argument: str, enabled: Any) -> Iterator[None]:
    enabled = _as_bool(argument, enabled)
    op = _setting_op(name)
    previous = op(enabled)
    try:
        yield
    finally:
        op(previous)


def sm90_kernels(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, the CUDA calls may take the sm90 (wgmma + TMA) kernels (enabled=True, the default
    setting unless FLASH_EXT_DISABLE_SM90=1) or only the sm80 ones (enabled=False), which run on every GPU
    from sm_80 on. A process-wide setting (torch.ops.flash_ext.set_sm90_enabled), restored on exit; it
    changes which kernels run, not what they compute."""
    return _setting("set_sm90_enabled", "enabled", enabled)


def poison_scratch(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, the CUDA backward fills its fp32 dQ accumulator with NaN before use (enabled=True),
    so that a row whose zeroing is missed shows as NaN in dq instead of passing on a fresh allocation's
    zeros. A process-wide test aid (torch.ops.flash_ext.set_poison_scratch), restored on exit; off unless
    FLASH_EXT_DEBUG_POISON_SCRATCH=1."""
    return _setting("set_poison_scratch", "enabled", enabled)
