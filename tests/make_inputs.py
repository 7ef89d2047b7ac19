"""Random q, k, v in the (batch, seqlen, heads, head_dim) layout, in several memory layouts.

Values are always fresh randn draws (never zeros): a kernel that ignores an input cannot pass.
"""
import torch

# contiguous        plain row-major tensor
# transposed        a (batch, heads, seqlen, head_dim) tensor viewed as (batch, seqlen, heads, head_dim)
# last_dim_strided  every other element of a larger tensor: the last dim has stride 2
# offset_by_3       a contiguous view that starts 3 elements into its storage (misaligned on CUDA)
# offset_by_8       a contiguous view that starts 8 elements into its storage (16-byte aligned for 16-bit dtypes)
LAYOUTS = ("contiguous", "transposed", "last_dim_strided", "offset_by_3", "offset_by_8")


def make_tensor(batch, seqlen, heads, head_dim, dtype, device="cpu", layout="contiguous"):
    shape = (batch, seqlen, heads, head_dim)
    options = dict(dtype=dtype, device=device)
    if layout == "contiguous":
        return torch.randn(shape, **options)
    if layout == "transposed":
        return torch.randn(batch, heads, seqlen, head_dim, **options).transpose(1, 2)
    if layout == "last_dim_strided":
        t = torch.randn(*shape, 2, **options)[..., 0]
        assert t.stride(-1) == 2
        return t
    if layout.startswith("offset_by_"):
        offset = int(layout.removeprefix("offset_by_"))
        numel = batch * seqlen * heads * head_dim
        t = torch.randn(offset + numel, **options)[offset:].view(shape)
        assert t.storage_offset() == offset
        return t
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device="cpu", layout="contiguous"):
    """q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim)."""
    q = make_tensor(batch, seqlen_q, heads_q, head_dim, dtype, device, layout)
    k = make_tensor(batch, seqlen_k, heads_kv, head_dim, dtype, device, layout)
    v = make_tensor(batch, seqlen_k, heads_kv, head_dim, dtype, device, layout)
    return q, k, v


def cu_seqlens(lengths, device="cpu"):
    """int32 prefix sums [0, l0, l0 + l1, ...] of the sequence lengths."""
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def make_varlen_qkv(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, device="cpu"):
    """Packed q: (sum(lengths_q), heads_q, head_dim); k, v: (sum(lengths_k), heads_kv, head_dim); and
    cu_seqlens_q, cu_seqlens_k."""
    options = dict(dtype=dtype, device=device)
    q = torch.randn(sum(lengths_q), heads_q, head_dim, **options)
    k = torch.randn(sum(lengths_k), heads_kv, head_dim, **options)
    v = torch.randn(sum(lengths_k), heads_kv, head_dim, **options)
    return q, k, v, cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)


def alibi_slopes(batch, heads, per_batch, device="cpu"):
    """The usual geometric ALiBi slopes 2^(-8 (h + 1) / heads), float32 (heads,); (batch, heads), varied per
    batch row, when per_batch."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float32, device=device) / heads)
    if not per_batch:
        return slopes
    return slopes[None] * torch.rand(batch, 1, device=device) * 2
