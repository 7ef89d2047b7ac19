"""Small CUDA cases for compute-sanitizer (memcheck, racecheck): forward and backward (both dQ
paths), ragged tiles, causal with seqlen_q != seqlen_k, GQA, a padded head dim, and head dims on
both sides of the backward's split at 128; then scripts/sanitize_decode.py (the decode kernels). Checks results too, so a clean sanitizer report on a
wrong answer does not pass.

    compute-sanitizer --tool memcheck  python3 scripts/sanitize.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize.py [--only forward,decode]

--only: a comma list of the groups to run (dense, forward, features, decode; default all): racecheck takes
minutes over all of them. --head-dims 64,128: only the dense cases of those head dims.
"""
import argparse
import os
import runpy
import time

import torch

import flash_ext
from flash_ext.reference import attention_ref, attention_varlen_ref

GROUPS = ("dense", "forward", "features", "decode")
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--only", default=",".join(GROUPS), help="comma list of groups: " + ", ".join(GROUPS))
parser.add_argument("--head-dims", help="comma list: only the dense group's cases of these head dims (default all)")
args = parser.parse_args()
groups = set(args.only.split(","))
head_dims = None if args.head_dims is None else {int(d) for d in args.head_dims.split(",")}
if not groups <= set(GROUPS):
    parser.error(f"--only: unknown group(s) {sorted(groups - set(GROUPS))}; expected some of {', '.join(GROUPS)}")

torch.manual_seed(0)
cases = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal
    (1, 129, 77, 4, 2, 64, True),
    (1, 150, 330, 2, 2, 64, False),  # 6 key blocks: the forward's K buffers alternate and wrap
    (2, 17, 200, 2, 1, 128, False),
    (1, 200, 17, 2, 2, 59, True),
    (1, 65, 130, 2, 2, 256, True),
    (1, 300, 260, 2, 2, 128, True),  # forward warps skip masked key blocks above their rows
    (1, 512, 200, 4, 2, 128, False),  # the dK/dV walks run split in pieces (TailSplit), crossing query heads
    (1, 260, 900, 2, 1, 128, False),  # sm90 forward (Hopper): 8 key blocks through its 3 TMA buffers
    (1, 700, 300, 4, 2, 128, True),  # sm90 dK/dV (Hopper): 11 query blocks through its 2 buffers, GQA
    (1, 700, 300, 4, 2, 64, True),  # sm90 dK/dV at hd64: 6 blocks of 128 queries through its 2 buffers, GQA
    (1, 100, 2200, 8, 8, 64, False),  # sm90 dK/dV: 18 key blocks x 8 kv heads = 144 walks for <= 132 CTAs
    (1, 64, 3200, 16, 16, 64, False),  # sm90 dK/dV: 400 walks, ~3 per CTA (its buffers and tile slots reused)
    (3, 4096, 300, 4, 1, 64, False),  # deterministic sm90 dK/dV: tiles in groups of 2 (batch, kv head) pairs, then 1
]
# Cases run with the sm80 kernels on Hopper too (sm90_kernels(False)): the split walks are theirs.
SM80_CASES = {(1, 512, 200, 4, 2, 128, False)}


def check_case(batch, sq, sk, hq, hkv, hd, causal):
    """Forward and both backward dQ paths of one case against the float64 reference."""
    case = (batch, sq, sk, hq, hkv, hd, causal)
    q = torch.randn(batch, sq, hq, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, sk, hkv, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, sk, hkv, hd, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(batch, sq, hq, hd, device="cuda", dtype=torch.bfloat16)
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*ref_inputs, causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout.double())
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out = flash_ext.attention(*inputs, causal=causal)
    err = (out.double() - ref).abs().max().item()
    assert err < 0.05, f"case {case}: forward max error {err}"
    for deterministic in (False, True):
        out = flash_ext.attention(*inputs, causal=causal, deterministic=deterministic)
        grads = torch.autograd.grad(out, inputs, dout)
        for name, grad, ref_grad in zip(("dq", "dk", "dv"), grads, ref_grads):
            err = (grad.double() - ref_grad).abs().max().item()
            bound = 0.05 * max(1.0, ref_grad.abs().max().item())
            assert err < bound, f"case {case}, deterministic={deterministic}: {name} error {err}"


for case in cases if "dense" in groups else []:
    if head_dims is not None and case[5] not in head_dims:
        continue
    started = time.monotonic()
    with flash_ext.testing.sm90_kernels(case not in SM80_CASES):
        check_case(*case)
    # Under racecheck a case takes seconds to minutes: the times show which one a timeout cut short.
    print(f"case {case} ok in {time.monotonic() - started:.1f} s", flush=True)

# The persistent sm90 forward: more tiles than 132 CTAs, so CTAs take several tiles from the counter through the
# same buffers (hd256: its one Q buffer); rows that see no key (window, or causal with seqlen_q > seqlen_k) give
# tiles written as empty between the others. Forward only (a backward under racecheck takes minutes).
# Softcap and ALiBi (the kernel's kExtras instantiation): one case with both.
forward_cases = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, window, softcap and ALiBi
    (1, 1100, 700, 16, 8, 128, (64, 0), False),
    (2, 2100, 700, 8, 4, 128, (-1, 0), False),
    (1, 1100, 600, 16, 8, 256, (-1, 0), False),
    (2, 1100, 600, 8, 8, 64, (-1, -1), False),
    (2, 1100, 700, 8, 4, 128, (-1, 0), True),
]
for *shape, window, score_mods in forward_cases if "forward" in groups else []:
    started = time.monotonic()
    batch, sq, sk, hq, hkv, hd = shape
    q = torch.randn(batch, sq, hq, hd, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, sk, hkv, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mods = dict(softcap=20.0, alibi_slopes=torch.rand(batch, hq, device="cuda") * 0.05) if score_mods else {}
    ref, _ = attention_ref(q.double(), k.double(), v.double(), window_size=window, **mods)
    out = flash_ext.attention(q, k, v, window_size=window, **mods)
    err = (out.double() - ref).abs().max().item()  # rows that see no key: 0 in both
    case = (*shape, window, score_mods)
    assert err < 0.05, f"persistent forward {case}: max error {err}"
    print(f"forward case {case} ok in {time.monotonic() - started:.1f} s", flush=True)

# A variable-length batch in the persistent forward: 40 sequences (more than the 32 its tile numbering sums per
# step), empty ones among them, causal.
if "forward" in groups:
    lengths_q, lengths_k = [0, 1, 129, 300] * 10, [5, 0, 300, 129] * 10
    cu_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lengths_k).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    q = torch.randn(sum(lengths_q), 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths_k), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = flash_ext.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    ref, _ = attention_varlen_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True)
    err = (out.double() - ref).abs().max().item()
    assert err < 0.05, f"persistent forward, varlen: max error {err}"
    print("forward case varlen x 40 ok", flush=True)

def check_features():
    """Sliding window + softcap + ALiBi on a dense batch, a variable-length batch with a window (sequences of
    length 0 and 1 included), and dropout: forward and backward with both dQ paths."""
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
    feature_cases = [
        dict(dense=True, features=dict(window_size=(40, 8), softcap=30.0, alibi_slopes=slopes)),
        dict(dense=False, features=dict(window_size=(33, -1))),
    ]
    # Dropout: checked against the reference with the call's keep mask below (rng_state from the call).
    for case in feature_cases:
        features = case["features"]
        if case["dense"]:
            q = torch.randn(2, 150, 4, 64, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(2, 190, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            run = lambda *t, **kw: flash_ext.attention(*t, **kw)  # noqa: E731
            reference = lambda *t: attention_ref(*t, **features)[0]  # noqa: E731
        else:
            lengths_q, lengths_k = [70, 0, 1, 130], [90, 5, 1, 64]
            cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), device="cuda", dtype=torch.int32)
            cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), device="cuda", dtype=torch.int32)
            q = torch.randn(sum(lengths_q), 4, 128, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(sum(lengths_k), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            run = lambda *t, **kw: flash_ext.attention_varlen(*t, cu_q, cu_k, max(lengths_q), max(lengths_k), **kw)  # noqa
            reference = lambda *t: attention_varlen_ref(*t, cu_q, cu_k, **features)[0]  # noqa: E731
        dout = torch.randn_like(q)
        ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
        ref_grads = torch.autograd.grad(reference(*ref_inputs), ref_inputs, dout.double())
        inputs = [t.requires_grad_() for t in (q, k, v)]
        for deterministic in (False, True):
            out = run(*inputs, deterministic=deterministic, **features)
            grads = torch.autograd.grad(out, inputs, dout)
            for name, grad, ref_grad in zip(("dq", "dk", "dv"), grads, ref_grads):
                err = (grad.double() - ref_grad).abs().max().item()
                assert err < 0.05 * max(1.0, ref_grad.abs().max().item()), f"{features}: {name} error {err}"
    from flash_ext.testing import attention_with_rng_state, dropout_keep_mask

    q = torch.randn(2, 150, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 190, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    inputs = [t.requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    for deterministic in (False, True):
        out, _, rng_state = attention_with_rng_state(*inputs, causal=True, dropout_p=0.2, deterministic=deterministic)
        keep = dropout_keep_mask(rng_state, 2, 4, 150, 190, 0.2).cuda()
        ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*ref_inputs, causal=True, dropout_p=0.2, dropout_mask=keep)
        ref_grads = torch.autograd.grad(ref, ref_inputs, dout.double())
        assert (out.double() - ref).abs().max().item() < 0.05, "dropout forward"
        for name, grad, ref_grad in zip(("dq", "dk", "dv"), torch.autograd.grad(out, inputs, dout), ref_grads):
            err = (grad.double() - ref_grad).abs().max().item()
            assert err < 0.05 * max(1.0, ref_grad.abs().max().item()), f"dropout: {name} error {err}"



if "features" in groups:
    check_features()

torch.cuda.synchronize()
print(f"sanitize: groups {sorted(groups)} ok")
if "decode" in groups:
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sanitize_decode.py"), run_name="__main__")
