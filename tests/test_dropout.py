"""Dropout's random numbers: Philox4x32-10 against its published known-answer vectors, the element
mapping of csrc/common/philox.h (recomputed here in plain Python), the drop rate, independence from the
shapes, reproducibility after torch.manual_seed and that dropout is never on by default (these two on
the CPU and on CUDA). (That forward and backward use the same mask is tested in test_features.py: both
match the reference only with the call's own mask.)"""
import pytest
import torch

import flash_ext
from devices import parametrize_devices
from flash_ext.testing import attention_varlen_with_rng_state, attention_with_rng_state, dropout_keep_mask
from make_inputs import make_qkv, make_varlen_qkv

MASK32 = 0xFFFFFFFF


def philox4x32_10(counter, key):
    """Philox4x32 with 10 rounds (Salmon et al., SC'11), written from the paper's definition."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
        product0, product1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((product1 >> 32) ^ c1 ^ k0) & MASK32, product1 & MASK32, \
            ((product0 >> 32) ^ c3 ^ k1) & MASK32, product0 & MASK32
    return c0, c1, c2, c3


# Random123's known-answer vectors for philox4x32_10: (counter, key, result).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32, MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_python_philox_known_answers(counter, key, expected):
    assert philox4x32_10(counter, key) == expected


def keep_by_the_documented_mapping(seed, offset, batch_head, row, col, dropout_p):
    """csrc/common/philox.h's mapping, step by step."""
    stream = (offset + batch_head) & 0xFFFFFFFFFFFFFFFF
    counter = (col // 8, row, stream & MASK32, stream >> 32)
    key = (seed & MASK32, seed >> 32)
    word = philox4x32_10(counter, key)[col % 8 // 2]
    bits = (word >> (16 * (col % 2))) & 0xFFFF
    return bits >= int(dropout_p * 2**16)


@pytest.mark.parametrize("seed,offset", [(0, 0), (42, 4), (2**64 - 5, 2**32 + 12), (0x0123456789ABCDEF, 2**64 - 1)])
def test_keep_mask_follows_the_documented_mapping(seed, offset):
    batch, heads, seqlen_q, seqlen_k, dropout_p = 2, 3, 5, 19, 0.4
    mask = dropout_keep_mask((seed, offset), batch, heads, seqlen_q, seqlen_k, dropout_p)
    assert mask.dtype == torch.bool and mask.shape == (batch, heads, seqlen_q, seqlen_k)
    for b in range(batch):
        for h in range(heads):
            for i in range(seqlen_q):
                expected = [keep_by_the_documented_mapping(seed, offset, b * heads + h, i, j, dropout_p)
                            for j in range(seqlen_k)]
                assert mask[b, h, i].tolist() == expected, (b, h, i)


def test_dropped_fraction_is_p():
    """Over 2^23 elements the dropped fraction is within 1% (absolute) of p, overall and per head."""
    dropout_p = 0.17
    mask = dropout_keep_mask(torch.tensor([1234, 8]), 4, 8, 512, 512, dropout_p)
    dropped = 1 - mask.double().mean().item()
    assert abs(dropped - dropout_p) < 0.01, dropped
    per_head = 1 - mask.double().mean(dim=(2, 3))
    assert (per_head - dropout_p).abs().max() < 0.01, per_head
    # No structure along the columns (8 columns share one Philox call): each residue mod 8 drops p.
    per_residue = 1 - mask.view(4, 8, 512, 64, 8).double().mean(dim=(0, 1, 2, 3))
    assert (per_residue - dropout_p).abs().max() < 0.01, per_residue


def test_dropout_p_zero_keeps_everything():
    assert dropout_keep_mask(torch.tensor([5, 0]), 1, 2, 30, 30, 0.0).all()


def test_keep_mask_does_not_depend_on_the_sequence_lengths():
    rng_state = torch.tensor([99, 16])
    small = dropout_keep_mask(rng_state, 2, 3, 10, 21, 0.3)
    large = dropout_keep_mask(rng_state, 2, 3, 40, 50, 0.3)
    assert torch.equal(small, large[:, :, :10, :21])
    assert not torch.equal(small, dropout_keep_mask(torch.tensor([99, 17]), 2, 3, 10, 21, 0.3))


def run_with_dropout(q, k, v, dout, *, gradients, **kwargs):
    leaves = [t.detach().clone().requires_grad_(gradients) for t in (q, k, v)]
    out, lse, rng_state = attention_with_rng_state(*leaves, **kwargs)
    grads = torch.autograd.grad(out, leaves, dout) if gradients else ()
    return (out.detach(), lse, rng_state, *grads)


@parametrize_devices(
    cpu=dict(setup=[dict(shape=(2, 80, 96, 4, 2, 32), causal=True, dropout_p=0.17, gradients=True)]),
    # Forward only: the default CUDA backward sums dQ with atomics, so its bits need not repeat.
    cuda=dict(setup=[dict(shape=(2, 300, 300, 4, 4, 64), causal=False, dropout_p=0.2, gradients=False)]),
)
def test_bitwise_reproducible_after_manual_seed(device, setup):
    """The same torch.manual_seed gives the same rng_state and the same results, bit for bit; the next call
    (the generator has moved on) draws another mask."""
    q, k, v = make_qkv(*setup["shape"], torch.bfloat16, device=device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=device)
    options = dict(causal=setup["causal"], dropout_p=setup["dropout_p"], gradients=setup["gradients"])
    torch.manual_seed(7)
    first = run_with_dropout(q, k, v, dout, **options)
    second_call = run_with_dropout(q, k, v, dout, **options)  # the generator has moved on
    torch.manual_seed(7)
    again = run_with_dropout(q, k, v, dout, **options)
    for name, a, b in zip(("out", "lse", "rng_state", "dq", "dk", "dv"), first, again):
        assert torch.equal(a, b), f"{name} differs after the same torch.manual_seed"
    assert not torch.equal(first[2], second_call[2]), "two calls drew the same rng_state"
    assert not torch.equal(first[0], second_call[0]), "two calls dropped the same elements"


def test_varlen_dropout_reproducible_after_manual_seed():
    q, k, v, cu_q, cu_k = make_varlen_qkv([7, 0, 40], [9, 3, 33], 2, 1, 16, torch.float32)
    results = []
    for _ in range(2):
        torch.manual_seed(3)
        results.append(attention_varlen_with_rng_state(q, k, v, cu_q, cu_k, 40, 33, dropout_p=0.3))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@parametrize_devices(cpu=dict(dtype=[torch.float32], head_dim=[16], seqlen=[40]),
                     cuda=dict(dtype=[torch.float16], head_dim=[64], seqlen=[16]))
def test_no_dropout_unless_asked(device, dtype, head_dim, seqlen):
    """The default is dropout_p = 0: the output is the undropped one, rng_state is zeros (on q's device) and
    the device's generator is not advanced (eval code that forgets to pass dropout_p gets no silent dropout)."""
    q, k, v = make_qkv(1, seqlen, seqlen, 2, 2, head_dim, dtype, device=device)
    get_state = torch.cuda.get_rng_state if device == "cuda" else torch.get_rng_state
    generator_state = get_state()
    out, _, rng_state = attention_with_rng_state(q, k, v)
    assert torch.equal(get_state(), generator_state)
    assert rng_state.device == q.device and torch.equal(rng_state.cpu(), torch.zeros(2, dtype=torch.int64))
    assert torch.equal(out, flash_ext.attention(q, k, v, dropout_p=0.0))
