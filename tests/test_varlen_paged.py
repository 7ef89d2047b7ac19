"""flash_ext.attention_varlen with block_table / seqused_k (paged keys, forward only) on the CPU and on CUDA
(float16 / bfloat16; parameters marked `cuda`).

Every call is checked against the float64 reference (attention_varlen_ref with the same block_table /
seqused_k, on CPU copies; tests/tolerance.py's rule), for NaN-free outputs (on CUDA after NaN-poisoning the
allocator for the op's allocations), and bit for bit against attention_varlen on the used keys packed
(gather_varlen_keys): the paged path is the varlen forward on gathered keys. The inputs make a leak visible:
pages are shuffled, block 0 and the other unused blocks of the pool, the unused slots of used pages and the keys
past seqused_k are NaN, and block_table entries past each sequence's pages are -1. Also: page sizes 16..256,
seqused_k shorter and longer than cu_seqlens_k's lengths, empty sequences, options in combinations, strided
inputs, pages shared between sequences, a chunked prefill against full attention and against
attention_with_kvcache, bad inputs (op and fake alike), the forward-only error, meta tensors, opcheck,
torch.compile, and (CUDA) capture in a CUDA graph with the index values changed between replays."""
import math

import pytest
import torch

import flash_ext
from bad_inputs import all_of, replace_arg, set_kwargs
from cuda_poison import padded_head_dim
from devices import CAUSAL, named, parametrize_devices
from flash_ext.reference import attention_ref, attention_varlen_ref, gather_varlen_keys
from flash_ext.testing import attention_varlen_with_rng_state
from make_inputs import cu_seqlens
from tolerance import FWD_FACTOR, assert_forward_within_tolerance, assert_within_tolerance, reference_options

CUDA_DTYPES = [torch.float16, torch.bfloat16]
INDEX_ARGUMENTS = ("block_table", "seqused_k")


def make_case(*, lengths_q=(3, 1, 0, 5), lengths_k=(7, 0, 20, 33), seqused=None, page_size=16, heads_q=4,
              heads_kv=2, head_dim=32, dtype=torch.float32, extra_blocks=3, extra_columns=1, alibi=None,
              device="cpu", **options):
    """(args, kwargs) of one attention_varlen call: args = [q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k], max_seqlen_k the longest used key count. Made on the CPU, then moved to device.

    page_size=None: k and v packed (total_k rows); with seqused, the keys of each span past seqused[b] are NaN.
    Otherwise a pool of pages: sequence b gets ceil(max(lengths_k[b], seqused[b]) / page_size) pages drawn in a
    shuffled order from blocks 1.., block 0 and `extra_blocks` - 1 more left unused; everything in the pool
    but the keys a sequence uses is NaN; each block_table row ends with `extra_columns` or more entries of -1."""
    batch = len(lengths_q)
    used = list(lengths_k) if seqused is None else list(seqused)
    q = torch.randn(sum(lengths_q), heads_q, head_dim, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    kwargs = dict(options)
    nan = float("nan")
    if page_size is None:
        k, v = (torch.randn(sum(lengths_k), heads_kv, head_dim, dtype=dtype) for _ in range(2))
        for b in range(batch):
            k[int(cu_k[b]) + used[b]:int(cu_k[b + 1])] = nan
            v[int(cu_k[b]) + used[b]:int(cu_k[b + 1])] = nan
    else:
        assert extra_blocks >= 1, "block 0 is always an unused block"
        pages = [math.ceil(max(lengths_k[b], used[b]) / page_size) for b in range(batch)]
        num_blocks = sum(pages) + extra_blocks
        order = (torch.randperm(num_blocks - 1) + 1).tolist()
        table = torch.full((batch, max(pages, default=0) + extra_columns), -1, dtype=torch.int32)
        k, v = (torch.full((num_blocks, page_size, heads_kv, head_dim), nan, dtype=dtype) for _ in range(2))
        for b in range(batch):
            blocks = torch.tensor(order[:pages[b]], dtype=torch.long)
            order = order[pages[b]:]
            table[b, :pages[b]] = blocks.int()
            positions = torch.arange(used[b])
            where = (blocks[positions // page_size], positions % page_size)
            k[where] = torch.randn(used[b], heads_kv, head_dim, dtype=dtype)
            v[where] = torch.randn(used[b], heads_kv, head_dim, dtype=dtype)
        kwargs["block_table"] = table
    if seqused is not None:
        kwargs["seqused_k"] = torch.tensor(used, dtype=torch.int32)
    if alibi == "per_head":
        kwargs["alibi_slopes"] = torch.rand(heads_q)
    elif alibi == "per_batch":
        kwargs["alibi_slopes"] = torch.rand(batch, heads_q)
    args = [q, k, v, cu_q, cu_k, max(lengths_q, default=0), max(used, default=0)]
    return [to(a, device) for a in args], {name: to(value, device) for name, value in kwargs.items()}


def to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def case(device, dtype, /, **options):
    """make_case on device; a dtype (the CUDA grids) overrides the options' own."""
    return make_case(**{**options, **({} if dtype is None else {"dtype": dtype})}, device=device)


def packed_rows(k, cu_seqlens_k, max_seqlen_k, kwargs):
    """The rows of the packed keys the CUDA path allocates: batch * min(max_seqlen_k, max_blocks * page_size),
    or min(total_k, batch * max_seqlen_k) without block_table."""
    batch, table = len(cu_seqlens_k) - 1, kwargs.get("block_table")
    if table is None:
        return min(k.shape[0], batch * max_seqlen_k)
    return batch * min(max_seqlen_k, table.shape[1] * k.shape[1])


def poison_allocator(q, k, cu_seqlens_k, max_seqlen_k, kwargs):
    """Frees NaN-filled (0xFF) blocks of the sizes of the CUDA path's allocations (packed k / v, their padded
    copies, out, lse), so that anything the op fails to write shows as NaN."""
    element, (total_q, heads_q, head_dim), heads_kv = q.element_size(), q.shape, k.shape[-2]
    rows, padded = packed_rows(k, cu_seqlens_k, max_seqlen_k, kwargs), padded_head_dim(head_dim)
    sizes = [rows * heads_kv * head_dim * element, rows * heads_kv * padded * element,
             total_q * heads_q * padded * element, total_q * heads_q * head_dim * element, heads_q * total_q * 4]
    blocks = [torch.full((max(1, n),), 0xFF, dtype=torch.uint8, device=q.device) for n in sizes for _ in range(2)]
    del blocks


def index_kwargs(kwargs):
    return {name: kwargs[name] for name in INDEX_ARGUMENTS if name in kwargs}


def check_call(args, kwargs):
    """One call: shapes, no NaN, the float64 reference by the tolerance rule, and (without dropout) bitwise
    attention_varlen on the used keys packed. Returns (out, lse)."""
    q, k, v, cu_q, cu_k, max_q, max_k = args
    if q.is_cuda:
        poison_allocator(q, k, cu_k, max_k, kwargs)
    with torch.no_grad():
        out, lse, rng_state = attention_varlen_with_rng_state(*args, **kwargs)
    total_q, heads_q, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.is_contiguous()
    assert lse.shape == (heads_q, total_q) and lse.dtype == torch.float32 and lse.device == q.device
    assert not torch.isnan(out).any(), f"out has {torch.isnan(out).sum().item()} NaN elements"
    assert not torch.isnan(lse).any(), f"lse has {torch.isnan(lse).sum().item()} NaN elements"

    cpu = {name: to(value, "cpu") for name, value in kwargs.items()}
    features = {name: value for name, value in cpu.items() if name not in INDEX_ARGUMENTS}
    options = reference_options(features, rng_state, len(cu_q) - 1, heads_q, max_q, max_k)
    assert_forward_within_tolerance(out, lse, attention_varlen_ref, *(to(a, "cpu") for a in args[:5]),
                                    **index_kwargs(cpu), **options)

    if kwargs.get("dropout_p", 0.0) == 0:
        k_used, v_used, cu_used = gather_varlen_keys(k, v, cu_k, **index_kwargs(kwargs))
        with torch.no_grad():
            out_varlen, lse_varlen = flash_ext.attention_varlen(q, k_used, v_used, cu_q, cu_used.to(q.device), max_q,
                                                                max_k, return_lse=True,
                                                                **{n: kwargs[n] for n in features})
        assert torch.equal(out, out_varlen), "out differs from attention_varlen on the gathered keys"
        assert torch.equal(lse, lse_varlen), "lse differs from attention_varlen on the gathered keys"
    return out, lse


# ---- Page sizes, seqused_k, empty sequences ---------------------------------------------------------------

PAGE_SIZES = [16, 32, 64, 128, 256]


@parametrize_devices(
    cpu=dict(page_size=PAGE_SIZES, causal=CAUSAL, dtype=[None]),
    cuda=dict(page_size=PAGE_SIZES, causal=CAUSAL, dtype=CUDA_DTYPES),
)
def test_page_sizes(device, page_size, causal, dtype):
    """Key counts 0, 1, and either side of one and two pages; a sequence with more queries than keys."""
    p = page_size
    check_call(*case(device, dtype, page_size=p, lengths_q=(2, 5, 3, 1, 4, 6),
                     lengths_k=(0, 1, p - 1, p, p + 1, 2 * p + 3), causal=causal))


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_pages_of_whole_key_blocks(head_dim, page_size, causal):
    """Pages that hold whole key blocks of the sm90 forward (128 keys, 64 at head dim 256) are read in place
    through the block table (other pages, and other GPUs, gather): key counts at and around block and page edges,
    with and without seqused_k, GQA; bitwise the output of attention_varlen on the gathered keys (check_call)."""
    p = page_size
    shapes = dict(head_dim=head_dim, heads_q=8, heads_kv=2, lengths_q=(130, 5, 64, 1, 200), causal=causal)
    check_call(*case("cuda", torch.bfloat16, page_size=p, lengths_k=(0, 1, 127, 129, 2 * p + 3), **shapes))
    check_call(*case("cuda", torch.bfloat16, page_size=p, lengths_k=(3, 0, 128, 300, 2 * p),
                     seqused=(3, 64, 127, 300, 2 * p - 1), **shapes))


SEQUSED = {
    # With block_table: seqused_k[b] keys through the pages, whatever cu_seqlens_k says.
    "paged_shorter": dict(lengths_k=(20, 16, 40, 9), seqused=(5, 16, 0, 9)),
    "paged_longer": dict(lengths_k=(3, 0, 17, 1), seqused=(19, 33, 17, 40)),
    "paged_page_edges": dict(page_size=8, lengths_k=(30, 30, 30, 30), seqused=(7, 8, 9, 24)),
    "paged_all_zero": dict(lengths_k=(4, 5, 6, 7), seqused=(0, 0, 0, 0)),
    # Without: rows cu_seqlens_k[b] .. cu_seqlens_k[b] + seqused_k[b] - 1 of the packed k, v.
    "packed_shorter": dict(page_size=None, lengths_k=(20, 16, 40, 9), seqused=(5, 16, 0, 3)),
    "packed_equal": dict(page_size=None, lengths_k=(7, 0, 20, 33), seqused=(7, 0, 20, 33)),
    "packed_all_zero": dict(page_size=None, lengths_k=(4, 5, 6, 7), seqused=(0, 0, 0, 0)),
}


@parametrize_devices(
    cpu=dict(options=[named(o, n) for n, o in SEQUSED.items()], causal=CAUSAL, dtype=[None]),
    cuda=dict(options=[named(o, n) for n, o in SEQUSED.items()], causal=CAUSAL, dtype=CUDA_DTYPES),
)
def test_seqused_k(device, options, causal, dtype):
    out, lse = check_call(*case(device, dtype, causal=causal, **options))
    if all(n == 0 for n in options["seqused"]):
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


EMPTY = {
    "no_keys": dict(lengths_q=(3, 2), lengths_k=(0, 0)),
    "no_queries": dict(lengths_q=(0, 0), lengths_k=(5, 17)),
    "batch_0": dict(lengths_q=(), lengths_k=()),
    "one_empty_sequence": dict(lengths_q=(0,), lengths_k=(0,)),
    "some_empty": dict(lengths_q=(0, 4, 0, 2), lengths_k=(0, 0, 9, 18)),
    "packed_no_keys": dict(page_size=None, lengths_q=(3, 2), lengths_k=(0, 0), seqused=(0, 0)),
    "packed_batch_0": dict(page_size=None, lengths_q=(), lengths_k=(), seqused=()),
}


@parametrize_devices(
    cpu=dict(options=[named(o, n) for n, o in EMPTY.items()], dtype=[None]),
    cuda=dict(options=[named(o, n) for n, o in EMPTY.items()], dtype=[torch.bfloat16]),
)
def test_empty_sequences(device, options, dtype):
    check_call(*case(device, dtype, causal=True, **options))


# ---- Options, alone and combined --------------------------------------------------------------------------

OPTIONS = {
    "causal": dict(causal=True),
    "window": dict(window_size=(5, 2)),
    "window_causal": dict(window_size=(6, -1), causal=True),
    "softcap": dict(softcap=2.5),
    "alibi_per_head": dict(alibi="per_head"),
    "alibi_per_batch": dict(alibi="per_batch", causal=True),
    "softmax_scale": dict(softmax_scale=0.3),
    "mqa": dict(heads_q=6, heads_kv=1),
    "mha": dict(heads_q=3, heads_kv=3),
    "gqa_4": dict(heads_q=8, heads_kv=2, causal=True),
    "head_dim_1": dict(head_dim=1),
    "head_dim_24": dict(head_dim=24, causal=True),
    "head_dim_59": dict(head_dim=59, window_size=(4, 0)),
    "head_dim_64": dict(head_dim=64, causal=True),
    "head_dim_128": dict(head_dim=128, heads_q=8, heads_kv=2, causal=True),
    "head_dim_256": dict(head_dim=256, heads_q=2, heads_kv=1),
    "page_size_1": dict(page_size=1),
    "page_size_5": dict(page_size=5, causal=True),
    "no_extra_columns": dict(extra_columns=0),
    "dropout": dict(dropout_p=0.3, causal=True),
    "bf16": dict(dtype=torch.bfloat16, causal=True),
    "fp16": dict(dtype=torch.float16, alibi="per_head"),
    "causal-window-softcap-alibi-gqa-seqused": dict(causal=True, window_size=(9, 0), softcap=3.0, alibi="per_batch",
                                                    heads_q=8, heads_kv=2, lengths_k=(12, 30, 5, 40),
                                                    seqused=(10, 33, 0, 40)),
    "window-softcap-alibi-mqa-page32": dict(page_size=32, window_size=(3, 3), softcap=1.5, alibi="per_head",
                                            heads_q=4, heads_kv=1, lengths_q=(8, 1, 16, 2),
                                            lengths_k=(70, 1, 16, 65)),
    "causal-alibi-softcap-packed-seqused": dict(page_size=None, causal=True, alibi="per_head", softcap=4.0,
                                                lengths_k=(12, 30, 5, 40), seqused=(12, 7, 1, 22)),
    "bf16-causal-window-alibi-gqa-page64": dict(dtype=torch.bfloat16, page_size=64, causal=True, window_size=(40, 0),
                                                alibi="per_batch", heads_q=6, heads_kv=2,
                                                lengths_q=(9, 0, 30, 4), lengths_k=(130, 7, 30, 64)),
    "fp16-softcap-head_dim_96-seqused_longer": dict(dtype=torch.float16, softcap=2.0, head_dim=96, causal=True,
                                                    lengths_k=(2, 3, 4, 5), seqused=(40, 3, 17, 16)),
}
# On CUDA the grid's dtypes (float16, bfloat16) replace the options' own.
CUDA_OPTIONS = {name: o for name, o in OPTIONS.items() if name not in ("bf16", "fp16")}


@parametrize_devices(
    cpu=dict(options=[named(o, n) for n, o in OPTIONS.items()], dtype=[None]),
    cuda=dict(options=[named(o, n) for n, o in CUDA_OPTIONS.items()], dtype=CUDA_DTYPES),
)
def test_options(device, options, dtype):
    check_call(*case(device, dtype, **options))


# ---- Layouts ----------------------------------------------------------------------------------------------

@parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=CUDA_DTYPES))
def test_strided_inputs(device, dtype):
    """A block table and seqused_k that are views with strides, page pools whose heads are every other head of
    a larger pool, q transposed from (heads, total, head_dim): used as they are, same results."""
    args, kwargs = case(device, dtype, lengths_k=(7, 0, 20, 33), seqused=(7, 0, 18, 33), causal=True)
    q, k, v = args[:3]
    table = kwargs["block_table"]
    wide = torch.full((table.shape[0], 2 * table.shape[1] + 3), 12345, dtype=torch.int32, device=device)
    wide[:, 3::2] = table
    used = torch.zeros(2 * len(kwargs["seqused_k"]), dtype=torch.int32, device=device)
    used[::2] = kwargs["seqused_k"]
    pools = []
    for pool in (k, v):
        big = torch.full((*pool.shape[:2], 2 * pool.shape[2], pool.shape[3]), float("nan"), dtype=dtype,
                         device=device)
        big[:, :, ::2] = pool
        pools.append(big[:, :, ::2])
    strided_q = q.transpose(0, 1).contiguous().transpose(0, 1)
    strided_kwargs = dict(kwargs, block_table=wide[:, 3::2], seqused_k=used[::2])
    assert not strided_kwargs["block_table"].is_contiguous() and not pools[0].is_contiguous()
    out, lse = check_call([strided_q, *pools, *args[3:]], strided_kwargs)
    with torch.no_grad():
        expected = flash_ext.attention_varlen(*args, return_lse=True, **kwargs)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


@parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=[torch.bfloat16]))
def test_shared_pages(device, dtype):
    """Sequences sharing their first pages (prefix caching): more keys used than the pool holds, and
    cu_seqlens_k[-1] unrelated to its size."""
    page_size, heads_kv, head_dim = 16, 2, 32
    pool = [torch.randn(4, page_size, heads_kv, head_dim, dtype=dtype, device=device) for _ in range(2)]
    table = torch.tensor([[0, 1, 2], [0, 1, 3], [0, 1, 2]], dtype=torch.int32, device=device)
    lengths_q, lengths_k = (4, 6, 1), (40, 48, 33)
    q = torch.randn(sum(lengths_q), 4, head_dim, dtype=dtype, device=device)
    assert sum(lengths_k) > pool[0].shape[0] * page_size
    check_call([q, *pool, cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device), 6, 48],
               dict(block_table=table, causal=True))


@parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=CUDA_DTYPES))
def test_max_seqlen_larger_than_needed(device, dtype):
    (q, k, v, cu_q, cu_k, max_q, max_k), kwargs = case(device, dtype, causal=True, seqused=(3, 0, 21, 30))
    with torch.no_grad():
        tight = flash_ext.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    out, _ = check_call([q, k, v, cu_q, cu_k, max_q + 7, max_k + 100], kwargs)
    assert torch.equal(out, tight)


# ---- Chunked prefill --------------------------------------------------------------------------------------

@parametrize_devices(cpu=dict(page_size=[16, 256], dtype=[torch.float32]),
                     cuda=dict(page_size=[16, 256], dtype=CUDA_DTYPES))
def test_chunked_prefill_matches_full_attention(device, page_size, dtype):
    """Each sequence's last chunk of queries over its whole context in pages, causal: the rows of full causal
    attention over the whole sequence (the reference, float64) that belong to the chunk."""
    heads_q, heads_kv, head_dim = 4, 2, 64
    contexts, chunks = (50, 300, 17, 129), (10, 1, 17, 64)
    pages = [math.ceil(n / page_size) for n in contexts]
    order = torch.randperm(sum(pages) + 2) + 1
    table = torch.full((len(contexts), max(pages)), -1, dtype=torch.int32)
    pools = [torch.full((sum(pages) + 3, page_size, heads_kv, head_dim), float("nan"), dtype=dtype) for _ in range(2)]
    keys, values, queries = [], [], []
    for b, (n, chunk) in enumerate(zip(contexts, chunks)):
        blocks, order = order[:pages[b]], order[pages[b]:]
        table[b, :pages[b]] = blocks.int()
        k_b, v_b = (torch.randn(n, heads_kv, head_dim, dtype=dtype) for _ in range(2))
        where = (blocks[torch.arange(n) // page_size], torch.arange(n) % page_size)
        pools[0][where], pools[1][where] = k_b, v_b
        keys.append(k_b)
        values.append(v_b)
        queries.append(torch.randn(chunk, heads_q, head_dim, dtype=dtype))
    q = torch.cat(queries)
    with torch.no_grad():
        out, lse = flash_ext.attention_varlen(q.to(device), *(p.to(device) for p in pools),
                                              cu_seqlens(chunks, device), cu_seqlens(contexts, device), max(chunks),
                                              max(contexts), causal=True, block_table=table.to(device),
                                              return_lse=True)
    start = 0
    for b, (n, chunk) in enumerate(zip(contexts, chunks)):
        full_q = torch.cat([torch.randn(n - chunk, heads_q, head_dim, dtype=dtype), queries[b]])[None]
        ref = [attention_ref(full_q, keys[b][None], values[b][None], causal=True, upcast=upcast)
               for upcast in (True, False)]
        rows = slice(n - chunk, n)
        for name, result, (ref64, lowp) in (
                ("out", out[start:start + chunk], (ref[0][0][0, rows], ref[1][0][0, rows])),
                ("lse", lse[:, start:start + chunk], (ref[0][1][0, :, rows], ref[1][1][0, :, rows]))):
            assert_within_tolerance(f"{name} of sequence {b}", result, lowp, ref64, FWD_FACTOR)
        start += chunk


@parametrize_devices(cpu=dict(head_dim=[32], dtype=[torch.float32]),
                     cuda=dict(head_dim=[32, 128], dtype=[torch.bfloat16]))
def test_reads_the_pages_attention_with_kvcache_writes(device, head_dim, dtype):
    """A chunk appended to paged caches by attention_with_kvcache, then the same chunk's queries through
    attention_varlen over the same pages (chunked prefill with uniform chunks): the same attention (on the CPU
    bit for bit; on CUDA both within the reference's tolerance), and the reference's."""
    batch, chunk, page_size, heads_q, heads_kv = 3, 5, 16, 4, 2
    cached = torch.tensor([0, 14, 40], dtype=torch.int32)
    table = (torch.randperm(batch * 4) + 1).view(batch, 4).int()
    k_cache, v_cache = (torch.randn(batch * 4 + 1, page_size, heads_kv, head_dim, dtype=dtype) for _ in range(2))
    q, k_new, v_new = (torch.randn(batch, chunk, h, head_dim, dtype=dtype) for h in (heads_q, heads_kv, heads_kv))
    k_cache, v_cache, q, k_new, v_new, table, cached = (t.to(device) for t in (k_cache, v_cache, q, k_new, v_new,
                                                                              table, cached))
    with torch.no_grad():
        out_cache = flash_ext.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached,
                                                     block_table=table, causal=True)
    lengths = (cached + chunk).tolist()
    args = [q.flatten(0, 1), k_cache, v_cache, cu_seqlens([chunk] * batch, device), cu_seqlens(lengths, device),
            chunk, max(lengths)]
    out, _ = check_call(args, dict(block_table=table, causal=True))
    if device == "cpu":
        assert torch.equal(out, out_cache.flatten(0, 1))
    else:
        scale = out_cache.abs().max().item()
        assert (out.float() - out_cache.flatten(0, 1).float()).abs().max().item() <= 4 * 2**-8 * scale


# ---- Errors -----------------------------------------------------------------------------------------------

I32 = dict(dtype=torch.int32)


def _packed(args, kwargs):
    """The packed (no block_table) variant: k, v (total_k, heads_kv, head_dim) with seqused_k."""
    (q, k, v, cu_q, cu_k, max_q, max_k), packed = make_case(page_size=None, seqused=(7, 0, 18, 33))
    args[:] = [q, k, v, cu_q, cu_k, max_q, max_k]
    kwargs.clear()
    kwargs.update(packed)


# Checks that read no index value: the op and its fake raise alike. The base call is make_case() (paged, batch 4,
# page 16, blocks 0..num_blocks-1, k and v (num_blocks, 16, 2, 32), q (9, 4, 32)).
STATIC_ERRORS = {
    "block_table_int64": (set_kwargs(block_table=torch.zeros(4, 4, dtype=torch.long)), "block_table must be int32, got Long"),
    "block_table_1d": (set_kwargs(block_table=torch.zeros(4, **I32)),
                       "block_table must have shape (batch, max_blocks) with batch = 4, got [4]"),
    "block_table_3d": (set_kwargs(block_table=torch.zeros(4, 3, 1, **I32)),
                       "block_table must have shape (batch, max_blocks) with batch = 4, got [4, 3, 1]"),
    "block_table_fewer_rows": (set_kwargs(block_table=torch.zeros(3, 4, **I32)),
                               "block_table must have shape (batch, max_blocks) with batch = 4, got [3, 4]"),
    "block_table_more_rows": (set_kwargs(block_table=torch.zeros(5, 4, **I32)),
                              "block_table must have shape (batch, max_blocks) with batch = 4, got [5, 4]"),
    "seqused_k_int64": (set_kwargs(seqused_k=torch.zeros(4, dtype=torch.long)), "seqused_k must be int32, got Long"),
    "seqused_k_float": (set_kwargs(seqused_k=torch.zeros(4)), "seqused_k must be int32, got Float"),
    "seqused_k_2d": (set_kwargs(seqused_k=torch.zeros(4, 1, **I32)), "seqused_k must have shape (batch,) = (4,), got [4, 1]"),
    "seqused_k_length": (set_kwargs(seqused_k=torch.zeros(3, **I32)), "seqused_k must have shape (batch,) = (4,), got [3]"),
    "packed_seqused_k_length": (all_of(_packed, set_kwargs(seqused_k=torch.zeros(5, **I32))),
                                "seqused_k must have shape (batch,) = (4,), got [5]"),
    "k_3d_with_block_table": (replace_arg(1, lambda k: k[0]),
                              "with block_table, k must be a page pool of 4 dimensions (num_blocks, page_size, "
                              "heads_kv, head_dim), got 3"),
    "v_5d_with_block_table": (replace_arg(2, lambda v: v[None]), "with block_table, v must be a page pool of 4 dimensions"),
    "k_4d_without_block_table": (all_of(_packed, replace_arg(1, lambda k: k[None]), replace_arg(2, lambda v: v[None])),
                                 "k must have 3 dimensions (total_k, heads_kv, head_dim) for attention_varlen"),
    "q_4d": (replace_arg(0, lambda q: q[None]), "q must have 3 dimensions (total_q, heads_q, head_dim)"),
    "pools_differ_in_page_size": (replace_arg(2, lambda v: v[:, :8]), "k and v must have the same shape"),
    "pools_differ_in_blocks": (replace_arg(2, lambda v: v[:-1]), "k and v must have the same shape"),
    "pool_head_dim": (all_of(replace_arg(1, lambda k: k[..., :16]), replace_arg(2, lambda v: v[..., :16])),
                      "k has head_dim 16 but q has head_dim 32"),
    "pool_heads": (all_of(replace_arg(1, lambda k: k.repeat(1, 1, 3, 1)), replace_arg(2, lambda v: v.repeat(1, 1, 3, 1))),
                   "heads_q (q.size(1) = 4) must be a multiple of heads_kv (k.size(2) = 6)"),
    "pool_no_heads": (all_of(replace_arg(1, lambda k: k[:, :, :0]), replace_arg(2, lambda v: v[:, :, :0])),
                      "k and v have 0 heads (k.size(2)) but q has 4"),
    "pool_dtype": (all_of(replace_arg(1, lambda k: k.double()), replace_arg(2, lambda v: v.double())),
                   "k has dtype Double but q has Float"),
    "v_pool_dtype": (replace_arg(2, lambda v: v.half()), "v has dtype Half but q has Float"),
    "page_size_0": (all_of(replace_arg(1, lambda k: k[:, :0]), replace_arg(2, lambda v: v[:, :0])),
                    "with block_table, k.size(1) is the page size and must be >= 1, got 0"),
    "cu_seqlens_k_int64": (replace_arg(4, lambda cu: cu.long()), "cu_seqlens_k must be int32, got Long"),
    "cu_seqlens_k_length": (replace_arg(4, lambda cu: cu[:3]), "cu_seqlens_k has 3 entries but cu_seqlens_q has 5"),
    "max_seqlen_k_negative": (replace_arg(6, lambda m: -1), "max_seqlen_k must be in 0..2^31-1, got -1"),
    "alibi_shape": (set_kwargs(alibi_slopes=torch.ones(3)), "alibi_slopes must have shape (heads_q,) = (4,) or "
                                                      "(batch, heads_q) = (4, 4)"),
    "window": (set_kwargs(window_size=(-3, 0)), "window_size[0]"),
    "softcap": (set_kwargs(softcap=-1.0), "softcap must be 0 (off) or a finite positive number"),
}
# Checks of the index values: the CPU op only (CUDA leaves them to the caller).
VALUE_ERRORS = {
    "block_out_of_range": (lambda a, kw: kw["block_table"].__setitem__((2, 1), a[1].shape[0]),
                           "block_table[2][1] = {blocks} is not a block of k (0..{last})"),
    "block_negative": (lambda a, kw: kw["block_table"].__setitem__((3, 2), -1),
                       "block_table[3][2] = -1 is not a block of k (0..{last})"),
    "seqused_negative": (set_kwargs(seqused_k=torch.tensor([1, -1, 2, 3], **I32)),
                         "seqused_k[1] = -1 must be in 0..64 (max_blocks * page_size"),
    "seqused_past_the_pages": (set_kwargs(seqused_k=torch.tensor([1, 0, 65, 3], **I32)),
                               "seqused_k[2] = 65 must be in 0..64 (max_blocks * page_size"),
    "packed_seqused_past_the_span": (all_of(_packed, set_kwargs(seqused_k=torch.tensor([7, 1, 18, 33], **I32))),
                                     "seqused_k[1] = 1 must be in 0..0 (the keys of sequence b in k"),
    "packed_total_k": (all_of(_packed, replace_arg(4, lambda cu: cu - torch.tensor([0, 0, 0, 0, 1], **I32))),
                       "cu_seqlens_k[-1] must equal total_k (k.size(0)) = 60, got 59"),
    "cu_seqlens_past_the_pages": (all_of(replace_arg(4, lambda cu: torch.tensor([0, 7, 7, 27, 97], **I32)),
                                        replace_arg(6, lambda m: 70)),
                                  "sequence 3 has 70 keys (from cu_seqlens_k) but a row of block_table holds 4 pages "
                                  "of 16 keys"),
    "cu_seqlens_k_decreasing": (replace_arg(4, lambda cu: torch.tensor([0, 7, 6, 26, 59], **I32)),
                                "cu_seqlens_k must be non-decreasing"),
    "cu_seqlens_k_start": (replace_arg(4, lambda cu: cu + 1), "cu_seqlens_k[0] must be 0"),
    "max_seqlen_k_short": (replace_arg(6, lambda m: 32),
                           "sequence 3 has length 33 (from cu_seqlens_k) but max_seqlen_k is 32"),
    "max_seqlen_k_short_seqused": (set_kwargs(seqused_k=torch.tensor([7, 0, 40, 3], **I32)),
                                   "sequence 2 uses 40 keys (seqused_k) but max_seqlen_k is 33"),
    "cu_seqlens_q_end": (replace_arg(3, lambda cu: torch.tensor([0, 3, 4, 4, 8], **I32)),
                         "cu_seqlens_q[-1] must equal total_q (q.size(0)) = 9, got 8"),
    "max_seqlen_q_short": (replace_arg(5, lambda m: 4), "max_seqlen_q must be at least the longest sequence"),
}
# The Python types (the interface).
TYPE_ERRORS = {
    "block_table_list": (set_kwargs(block_table=[[0]]), "block_table must be a torch.Tensor"),
    "seqused_k_list": (set_kwargs(seqused_k=[1, 2, 3, 4]), "seqused_k must be a torch.Tensor"),
    "max_seqlen_k_float": (replace_arg(6, lambda m: 33.0), "max_seqlen_k must be an int"),
}


def bad_call(modify):
    args, kwargs = make_case()
    modify(args, kwargs)
    return args, kwargs


def expected_message(message, args):
    blocks = args[1].shape[0]
    return message.format(blocks=blocks, last=blocks - 1)


@pytest.mark.parametrize("modify,message", [*STATIC_ERRORS.values(), *VALUE_ERRORS.values()],
                         ids=[*STATIC_ERRORS, *VALUE_ERRORS])
def test_bad_inputs(modify, message):
    args, kwargs = bad_call(modify)
    with pytest.raises(RuntimeError) as raised, torch.no_grad():
        flash_ext.attention_varlen(*args, **kwargs)
    assert expected_message(message, args) in str(raised.value) and "flash_ext" in str(raised.value)


@pytest.mark.parametrize("modify,message", TYPE_ERRORS.values(), ids=TYPE_ERRORS.keys())
def test_bad_types(modify, message):
    args, kwargs = bad_call(modify)
    with pytest.raises(TypeError, match=message):
        flash_ext.attention_varlen(*args, **kwargs)


@pytest.mark.parametrize("modify", [m for m, _ in STATIC_ERRORS.values()], ids=STATIC_ERRORS.keys())
def test_fake_raises_like_the_op(modify):
    args, kwargs = bad_call(modify)
    with pytest.raises(RuntimeError) as real, torch.no_grad():
        flash_ext.attention_varlen(*args, **kwargs)
    with pytest.raises(RuntimeError) as fake, torch.no_grad():
        flash_ext.attention_varlen(*(to(a, "meta") for a in args), **{n: to(a, "meta") for n, a in kwargs.items()})
    assert str(fake.value) == str(real.value).replace(" on cpu", " on meta")


@parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=[torch.bfloat16]))
def test_unused_block_table_entries_are_not_read(device, dtype):
    """Entries past a sequence's used pages may hold anything (here out-of-range block numbers)."""
    args, kwargs = case(device, dtype, seqused=(7, 0, 17, 33))
    table = kwargs["block_table"]
    table[table < 0] = 10**6
    table[1] = -5  # a sequence without keys reads no entry
    table[2, 2:] = 10**6  # 17 keys: pages 0 and 1
    check_call(args, kwargs)


@pytest.mark.cuda
def test_wrong_device():
    args, kwargs = make_case(seqused=(7, 0, 20, 33), device="cuda", dtype=torch.bfloat16)
    for name in INDEX_ARGUMENTS:
        bad = dict(kwargs, **{name: kwargs[name].cpu()})
        with pytest.raises(RuntimeError, match=f"flash_ext: {name} is on cpu but q is on cuda:0"), torch.no_grad():
            flash_ext.attention_varlen(*args, **bad)


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "packed_seqused"])
def test_cuda_cuts_counts_past_the_contract(paged):
    """CUDA reads no index value on the host: a key count past max_seqlen_k (or, without block_table, past the
    sequence's span of k) is cut there, with no error and no read outside the packed batch."""
    options = dict(lengths_k=(16, 0, 32, 48), dtype=torch.bfloat16, device="cuda", causal=True)
    args, kwargs = make_case(**options, **({} if paged else dict(page_size=None, seqused=(16, 0, 32, 48))))
    cut = dict(kwargs, seqused_k=torch.tensor([16, 0, 32, 40], dtype=torch.int32, device="cuda"))
    with torch.no_grad():
        expected = flash_ext.attention_varlen(*args[:6], 40, **cut)
        if paged:  # max_seqlen_k 40 < 48 keys of sequence 3 (from cu_seqlens_k)
            result = flash_ext.attention_varlen(*args[:6], 40, **kwargs)
        else:  # seqused_k[1] = 5 > its span of 0 keys, seqused_k[3] = 48 > max_seqlen_k
            over = dict(kwargs, seqused_k=torch.tensor([16, 5, 32, 48], dtype=torch.int32, device="cuda"))
            result = flash_ext.attention_varlen(*args[:6], 40, **over)
    torch.cuda.synchronize()
    assert torch.equal(result, expected)


@parametrize_devices(
    cpu=dict(argument=list(INDEX_ARGUMENTS), index=[0, 1, 2], dtype=[torch.float32]),
    cuda=dict(argument=list(INDEX_ARGUMENTS), index=[0, 1, 2], dtype=[torch.bfloat16]),
)
def test_requires_grad_is_rejected(device, argument, index, dtype):
    """Forward only: q, k or v requiring grad with grad mode on is an error naming the index argument; under
    no_grad / inference_mode, or without requires_grad, the call runs."""
    if argument == "block_table":
        args, kwargs = case(device, dtype)
    else:
        args, kwargs = case(device, dtype, page_size=None, seqused=(7, 0, 18, 33))
    args[index] = args[index].clone().requires_grad_()
    name = "qkv"[index]
    with pytest.raises(RuntimeError, match=f"attention_varlen with {argument} is forward only .* but {name} requires "
                                           "grad"):
        flash_ext.attention_varlen(*args, **kwargs)
    with torch.no_grad():
        flash_ext.attention_varlen(*args, **kwargs)
    with torch.inference_mode():
        flash_ext.attention_varlen(*args, **kwargs)
    args[index] = args[index].detach()
    out = flash_ext.attention_varlen(*args, **kwargs)
    assert not out.requires_grad


# ---- torch.compile, meta, opcheck -------------------------------------------------------------------------

def test_meta_inputs_give_shapes():
    args, kwargs = make_case(seqused=(1, 2, 3, 4))
    out, lse = flash_ext.attention_varlen(*(to(a, "meta") for a in args), return_lse=True,
                                          **{n: to(a, "meta") for n, a in kwargs.items()})
    assert out.shape == args[0].shape and out.device.type == "meta" and lse.shape == (4, 9)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "packed_seqused"])
def test_opcheck(paged):
    args, kwargs = make_case(**({} if paged else dict(page_size=None, seqused=(7, 0, 18, 33))),
                             alibi="per_head")
    op_args = (*args, kwargs.get("block_table"), kwargs.get("seqused_k"), 0.2, True, False, -1, 0, 0.0,
               kwargs["alibi_slopes"], 0.0)
    torch.library.opcheck(torch.ops.flash_ext.varlen_paged_fwd, op_args, test_utils=("test_schema", "test_faketensor"))


@parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=[torch.bfloat16]))
def test_torch_compile_fullgraph(device, dtype):
    torch._dynamo.reset()
    args, kwargs = case(device, dtype, seqused=(7, 0, 18, 33), causal=True, alibi="per_head")

    def step(q, k, v, cu_q, cu_k, block_table, seqused_k):
        out, lse = flash_ext.attention_varlen(q, k, v, cu_q, cu_k, args[5], args[6], return_lse=True,
                                              block_table=block_table, seqused_k=seqused_k, causal=True,
                                              alibi_slopes=kwargs["alibi_slopes"])
        return out * 2, lse

    inputs = (*args[:5], kwargs["block_table"], kwargs["seqused_k"])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager, result = step(*inputs), compiled(*inputs)
    for a, b in zip(eager, result):
        assert torch.equal(a, b)


# ---- CUDA graphs ------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "packed_seqused"])
def test_cuda_graph_replay_with_new_index_values(paged):
    """The call has no host sync: it is captured in a CUDA graph, then replayed after block_table,
    seqused_k and cu_seqlens_k are changed in place; each replay matches an eager call bit for bit."""
    options = dict(lengths_k=(7, 0, 20, 33), seqused=(7, 0, 20, 33), causal=True, dtype=torch.bfloat16,
                   device="cuda", head_dim=128, heads_q=8, heads_kv=2)
    args, kwargs = make_case(**options, **({} if paged else dict(page_size=None)))
    static_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    static_kwargs = {n: a.clone() if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.stream(stream):
        flash_ext.attention_varlen(*static_args, **static_kwargs)  # warm-up
        with torch.cuda.graph(graph, stream=stream):
            out, lse = flash_ext.attention_varlen(*static_args, return_lse=True, **static_kwargs)
    torch.cuda.current_stream().wait_stream(stream)

    variants = [dict(seqused_k=torch.tensor([7, 0, 20, 33], dtype=torch.int32)),
                dict(seqused_k=torch.tensor([1, 0, 17, 30], dtype=torch.int32))]
    if paged:
        flipped = kwargs["block_table"].clone()
        flipped[[0, 2]] = flipped[[2, 0]]  # sequences 0 and 2 swap their pages (20 keys fit sequence 0's too)
        variants.append(dict(block_table=flipped, seqused_k=torch.tensor([20, 0, 7, 33], dtype=torch.int32)))
        # With seqused_k, cu_seqlens_k's lengths do not matter.
        variants.append(dict(cu_seqlens_k=torch.tensor([0, 1, 1, 2, 3], dtype=torch.int32)))
    call_args, call_kwargs = list(args), dict(kwargs)  # the eager calls' inputs, changed as the static ones
    for variant in variants:
        for name, value in variant.items():
            value = value.cuda()
            if name == "cu_seqlens_k":
                static_args[4].copy_(value)
                call_args[4] = value
            else:
                static_kwargs[name].copy_(value)
                call_kwargs[name] = value
        graph.replay()
        eager = check_call(call_args, call_kwargs)
        torch.cuda.synchronize()
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1]), f"replay differs from eager: {variant}"
