#!/usr/bin/env python3
"""Train a small character-level GPT whose causal self-attention is flash_ext.attention.

    python examples/train_gpt.py --device cpu --steps 5     # a few seconds on a CPU
    python examples/train_gpt.py                            # on a GPU: bf16 autocast, 2000 steps
    python examples/train_gpt.py --attention sdpa           # the same model through PyTorch's SDPA
    python examples/train_gpt.py --kv-heads 6 --compile     # no GQA; under torch.compile

The text is examples/data/public_domain.txt (about 10 KB, see examples/README.md), one token per character;
the last 10% is held out for the validation loss. The model is GPT-2 shaped (token + learned position
embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP, the output layer tied to the
token embedding), with grouped-query attention when --kv-heads < --heads. flash_ext takes q, k, v as
(batch, seq, heads, head_dim) and reads k and v of fewer heads as they are; SDPA takes (batch, heads, seq,
head_dim), so that path transposes. The loss curve goes to --plot (a PNG; a CSV where matplotlib is not
installed). The run ends with a sample of generated text.
"""
import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

import flash_ext

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TEXT = os.path.join(HERE, "data", "public_domain.txt")

# Model and run sizes per device: the CPU preset finishes a few steps in seconds; the CUDA one is a small
# real run (9.6 M parameters, 16k tokens a step). Each is overridden by its command-line option.
PRESETS = {
    "cpu": dict(steps=200, batch_size=8, seq_len=64, dim=64, layers=2, heads=4, kv_heads=2, lr=3e-3),
    "cuda": dict(steps=2000, batch_size=64, seq_len=256, dim=384, layers=6, heads=6, kv_heads=2, lr=1e-3),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", choices=("flash_ext", "sdpa"), default="flash_ext",
                   help="flash_ext.attention, or torch.nn.functional.scaled_dot_product_attention (default flash_ext)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default cuda where available, else cpu)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="autocast dtype; float32 turns autocast off (default bfloat16 on CUDA, float32 on the CPU). "
                        "Parameters and optimizer state stay float32")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 200 on the CPU, 2000 on CUDA)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None, help="characters per training sequence")
    p.add_argument("--dim", type=int, default=None, help="model width (heads x head_dim)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads, a divisor of --heads (GQA; = --heads: plain multi-head attention)")
    p.add_argument("--dropout", type=float, default=0.0, help="attention and residual dropout (default 0)")
    p.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate")
    p.add_argument("--eval-every", type=int, default=None, help="steps between validation losses (default steps/10)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=DEFAULT_TEXT, help="training text, UTF-8 (default %(default)s)")
    p.add_argument("--plot", default="train_gpt_loss.png",
                   help="loss curve PNG (default %(default)s); without matplotlib a CSV of the same name")
    p.add_argument("--sample-chars", type=int, default=300, help="characters to generate at the end (0: none)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    args = p.parse_args(argv)

    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = PRESETS["cuda" if args.device.type == "cuda" else "cpu"]
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.type == "cuda" else "float32"
    args.eval_every = args.eval_every or max(1, args.steps // 10)

    for name in ("steps", "batch_size", "seq_len", "dim", "layers", "heads", "kv_heads", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        p.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.attention == "flash_ext" and args.device.type == "cuda" and args.dtype == "float32":
        p.error("flash_ext's CUDA kernels take float16 or bfloat16 inputs: use --dtype bfloat16 (or float16), "
                "or --attention sdpa for a float32 run")
    return args


# ---- the model ---------------------------------------------------------------------------------------


def sdpa_attention(q, k, v, dropout_p):
    """Causal attention through PyTorch's SDPA, in flash_ext's (batch, seq, heads, head_dim) layout."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants (batch, heads, seq, head_dim)
    gqa = {}
    if k.shape[1] != q.shape[1]:
        if SDPA_HAS_GQA:
            gqa = dict(enable_gqa=True)
        else:  # older torch: repeat k and v to q's heads (memory and time that enable_gqa saves)
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **gqa)
    return out.transpose(1, 2)


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, attention, dropout):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention, self.dropout = attention, dropout
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)  # k and v in one matmul
        self.wo = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim)
        # k and v are strided views of one projection; flash_ext reads them in place.
        k, v = self.wkv(x).view(batch, seq, 2, self.kv_heads, self.head_dim).unbind(2)
        dropout_p = self.dropout if self.training else 0.0
        if self.attention == "flash_ext":
            # seq_q = seq_k here, so flash_ext's bottom-right causal mask is SDPA's is_causal mask.
            out = flash_ext.attention(q, k, v, causal=True, dropout_p=dropout_p)
        else:
            out = sdpa_attention(q, k, v, dropout_p)
        return self.wo(out.reshape(batch, seq, -1))


class Block(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, attention, dropout):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, kv_heads, attention, dropout)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(torch.nn.Module):
    def __init__(self, vocab, seq_len, dim, layers, heads, kv_heads, attention, dropout):
        super().__init__()
        self.seq_len = seq_len
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq_len, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, kv_heads, attention, dropout) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2's init: N(0, 0.02), the projections into the residual stream scaled by depth.
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("wo.weight", "mlp.2.weight")) else 0.02
                torch.nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)

    def forward(self, idx):  # idx: (batch, seq) int64 -> logits (batch, seq, vocab)
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ---- data, schedule, output ------------------------------------------------------------------------------


class CharData:
    """A text as one int64 tensor of character ids, split 90/10 into training and validation."""

    def __init__(self, path, seq_len):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.index[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(ids))
        self.train, self.val = ids[:split], ids[split:]
        for name, part in (("training", self.train), ("validation", self.val)):
            if len(part) <= seq_len:
                raise ValueError(f"{path}: its {name} part has {len(part)} characters, fewer than --seq-len "
                                 f"{seq_len} + 1; use a longer text or a shorter --seq-len")

    def batch(self, batch_size, seq_len, generator, device):
        """Training inputs and targets (the inputs shifted by one), (batch_size, seq_len) each, at random offsets."""
        start = torch.randint(len(self.train) - seq_len, (batch_size,), generator=generator)
        window = self.train[start[:, None] + torch.arange(seq_len + 1)].to(device, non_blocking=True)
        return window[:, :-1], window[:, 1:]

    def val_windows(self, seq_len, device):
        """The validation part as consecutive windows (the same every time, so the curve is not sampling noise)."""
        start = torch.arange(0, len(self.val) - seq_len, seq_len)
        window = self.val[start[:, None] + torch.arange(seq_len + 1)].to(device)
        return window[:, :-1], window[:, 1:]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


def learning_rate(step, steps, peak):
    """Linear warm-up over the first 10% of the steps (at most 100), then cosine decay to peak / 10."""
    warmup = min(100, max(1, steps // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Progress:
    """tqdm's bar where tqdm is installed, else a printed line every ~5% of the steps."""

    def __init__(self, steps, quiet):
        self.steps, self.quiet, self.bar = steps, quiet, None
        self.every = max(1, steps // 20)
        if not quiet:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=steps, unit="step", dynamic_ncols=True)

    def update(self, step, done, fields):
        """step: the step just finished (0-based); done: steps since the last call; fields: name -> text."""
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(done)
        elif (step + 1) % self.every == 0 or step + 1 == self.steps:
            print(f"step {step + 1:>{len(str(self.steps))}}/{self.steps}  "
                  + "  ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def save_losses(path, losses, val, title, uniform):
    """The loss curve as a PNG at path; where matplotlib is missing, the numbers as a CSV beside it.
    Returns the path written."""
    try:
        import matplotlib
    except ImportError:
        csv = os.path.splitext(path)[0] + ".csv"
        val_at = dict(val)
        with open(csv, "w") as f:
            f.write("step,train_loss,val_loss\n")
            for step, loss in enumerate(losses, 1):
                f.write(f"{step},{loss:.6f},{'' if step not in val_at else f'{val_at[step]:.6f}'}\n")
        print(f"matplotlib is not installed: wrote the losses to {csv} instead of a plot")
        return csv
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, color="tab:blue", linewidth=0.8, alpha=0.8, label="training (each step)")
    if val:
        ax.plot(*zip(*val), color="tab:red", marker="o", markersize=3, label="validation (held-out 10%)")
    ax.axhline(uniform, color="gray", linestyle=":", label=f"uniform guess, ln(vocab) = {uniform:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@torch.no_grad()
def generate(model, data, n, device, autocast, generator, temperature=0.8):
    """n characters sampled after a newline, re-running the model on the last seq_len characters per character."""
    model.eval()
    ids = torch.tensor([[data.index.get("\n", 0)]], device=device)
    for _ in range(n):
        with autocast():
            logits = model(ids[:, -model.seq_len:])[:, -1].float()
        probs = torch.softmax(logits / temperature, dim=-1).cpu()
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator).to(device)], dim=1)
    return data.decode(ids[0, 1:].tolist())


# ---- training ------------------------------------------------------------------------------------------


def main(argv=None):
    """Train as the command line says; returns a dict: losses (the training loss of every step), val ((step,
    loss) pairs), sample (the generated text), tokens_per_s (training throughput) and output (the plot's path)."""
    args = parse_args(argv)
    device, dtype = args.device, DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    data = CharData(args.text, args.seq_len)
    model = GPT(len(data.chars), args.seq_len, args.dim, args.layers, args.heads, args.kv_heads, args.attention,
                args.dropout).to(device)
    forward = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 gradients need scaling

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    if not args.quiet:
        n_params = sum(p.numel() for p in model.parameters())
        path = args.attention
        if args.attention == "flash_ext":
            head_dim = args.dim // args.heads
            q = torch.empty(args.batch_size, args.seq_len, args.heads, head_dim, device=device, dtype=dtype)
            kv = torch.empty(args.batch_size, args.seq_len, args.kv_heads, head_dim, device=device, dtype=dtype)
            path = f"flash_ext: {flash_ext.kernel_path(q, kv, kv, causal=True)}"
        print(f"{len(data.train) + len(data.val)} characters, vocab {len(data.chars)}; {n_params / 1e6:.2f} M "
              f"parameters: {args.layers} layers, dim {args.dim}, {args.heads} q / {args.kv_heads} kv heads; "
              f"batch {args.batch_size} x {args.seq_len}, {args.steps} steps, {device} {args.dtype}")
        print(f"attention: {path}")

    generator = torch.Generator().manual_seed(args.seed)

    val_x, val_y = data.val_windows(args.seq_len, device)

    def val_loss():
        model.eval()
        total = 0.0
        with torch.no_grad():
            for x, y in zip(val_x.split(args.batch_size), val_y.split(args.batch_size)):
                with autocast():
                    logits = forward(x)
                total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        model.train()
        return total / val_y.numel()

    losses, val, pending = [], [], []
    progress = Progress(args.steps, args.quiet)
    train_time, tokens = 0.0, 0
    warm = None  # (tokens, time) at the first read-back: the rate leaves out the first steps' warm-up / compile

    def rate():
        if warm is not None and tokens > warm[0]:
            return (tokens - warm[0]) / (train_time - warm[1])
        return tokens / train_time if train_time > 0 else float("nan")
    model.train()
    for step in range(args.steps):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        x, y = data.batch(args.batch_size, args.seq_len, generator, device)
        with autocast():
            logits = forward(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        pending.append(loss.detach())  # read back in groups, so that the GPU does not wait every step
        last = step + 1 == args.steps
        if (step + 1) % progress.every == 0 or (step + 1) % args.eval_every == 0 or last:
            losses += torch.stack(pending).float().tolist()
            done = len(pending)
            pending.clear()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_time += time.perf_counter() - t0
            tokens += done * args.batch_size * args.seq_len
            warm = warm or (tokens, train_time)
            if (step + 1) % args.eval_every == 0 or last:
                val.append((step + 1, val_loss()))
            fields = {"loss": f"{losses[-1]:.3f}", "val": f"{val[-1][1]:.3f}" if val else "-"}
            fields["tok/s"] = f"{rate():,.0f}"
            progress.update(step, done, fields)
        else:
            train_time += time.perf_counter() - t0
    progress.close()

    tokens_per_s = rate()
    first = warm[0] // (args.batch_size * args.seq_len) + 1
    span = f"(steps {first}-{args.steps})" if first <= args.steps else "(all steps)"
    title = (f"char-level GPT on {os.path.basename(args.text)}: {args.attention}, {device} {args.dtype}, "
             f"{args.layers} layers, dim {args.dim}, {args.heads} q / {args.kv_heads} kv heads")
    output = save_losses(args.plot, losses, val, title, math.log(len(data.chars)))
    for name, loss in (("training", losses[-1]), ("validation", val[-1][1])):
        if not math.isfinite(loss):
            raise RuntimeError(f"the {name} loss is {loss} after {args.steps} steps (curve: {output}); "
                               "try a lower --lr")
    sample = ""
    if args.sample_chars > 0:
        sample = generate(model, data, args.sample_chars, device, autocast, generator)
    if not args.quiet:
        print(f"final loss: training {losses[-1]:.3f}, validation {val[-1][1]:.3f} (uniform guess "
              f"{math.log(len(data.chars)):.3f}); {tokens_per_s:,.0f} training tokens/s {span}; loss curve: {output}")
        if sample:
            print("sample:\n" + sample)
    return dict(losses=losses, val=val, sample=sample, tokens_per_s=tokens_per_s, output=output)


if __name__ == "__main__":
    main()
