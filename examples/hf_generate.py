"""Greedy generation with a Hugging Face transformers model running flash_ext's attention.

A tiny random-weight Llama (GQA, built locally: nothing is downloaded) generates from a left-padded batch
with a dynamic cache and with a static cache. Decode steps read the cache in place through
flash_ext.attention_with_kvcache (on CUDA, head dims 64/128/256: the split-KV decode kernel). Prints the
generation rate of each and whether the greedy tokens equal those of transformers' sdpa attention.

    python examples/hf_generate.py --device cpu --max-new-tokens 8
    python examples/hf_generate.py --device cuda --max-new-tokens 256 --batch 8 --steps 5

Needs transformers (pip install 'flash_ext[hf]').
"""
import argparse
import time

import torch

import flash_ext.integrations.transformers as flash_ext_hf


def tiny_llama(device, dtype, layers, head_dim):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads_q, heads_kv = 4, 2
    config = LlamaConfig(vocab_size=512, hidden_size=heads_q * head_dim, intermediate_size=4 * heads_q * head_dim,
                         num_hidden_layers=layers, num_attention_heads=heads_q, num_key_value_heads=heads_kv,
                         head_dim=head_dim, max_position_embeddings=4096, initializer_range=0.2, pad_token_id=0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()


def left_padded_prompts(batch, prompt_len, vocab, device, generator):
    """Prompts of different lengths (prompt_len down to half of it), padded on the left as generate() wants."""
    lengths = torch.linspace(prompt_len, max(1, prompt_len // 2), batch).round().long()
    mask = (torch.arange(prompt_len)[None] >= prompt_len - lengths[:, None]).long()
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=generator) * mask
    return ids.to(device), mask.to(device)


def timed_generate(model, ids, mask, max_new_tokens, cache, steps, compile):
    """The generated tokens and the best rate (new tokens per second, over the batch) of `steps` timed runs
    after one warm-up run. compile=False keeps generate() from compiling the decode step (it does so with a
    static cache on CUDA)."""
    options = dict(attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                   do_sample=False, cache_implementation=cache, pad_token_id=0, disable_compile=not compile)
    with torch.inference_mode():
        tokens = model.generate(ids, **options)
        best = float("inf")
        for _ in range(steps):
            if ids.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, **options)
            if ids.is_cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    return tokens[:, ids.shape[1]:], ids.shape[0] * max_new_tokens / best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed generate() runs (the best is reported)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--compile", action="store_true",
                        help="let generate() compile the static-cache decode step (CUDA)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    name = flash_ext_hf.register()
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = tiny_llama(device, dtype, args.layers, args.head_dim)
    ids, mask = left_padded_prompts(args.batch, args.prompt_len, model.config.vocab_size, device, generator)
    print(f"{args.layers}-layer random Llama, head_dim {args.head_dim}, {dtype}, {device}: batch {args.batch}, "
          f"prompts up to {args.prompt_len} tokens (left-padded), {args.max_new_tokens} new tokens")

    model.set_attn_implementation("sdpa")
    sdpa_tokens, sdpa_rate = timed_generate(model, ids, mask, args.max_new_tokens, "dynamic", args.steps, args.compile)
    print(f"  {'sdpa, dynamic cache':24s}{sdpa_rate:10.1f} tokens/s")
    model.set_attn_implementation(name)
    for cache in ("dynamic", "static"):
        tokens, rate = timed_generate(model, ids, mask, args.max_new_tokens, cache, args.steps, args.compile)
        same = "yes" if torch.equal(tokens, sdpa_tokens) else "no"
        label = f"flash_ext, {cache} cache"
        print(f"  {label:24s}{rate:10.1f} tokens/s   same greedy tokens as sdpa: {same}")
    print("  first sequence's new tokens:", tokens[0].tolist())


if __name__ == "__main__":
    main()
