"""flash_ext.integrations.transformers: tiny random-weight Llama (GQA), Mistral (a sliding window shorter
than the sequence) and Gemma 2 (softcap, sliding and full layers) models built locally (nothing is
downloaded), run with attn_implementation="fext" against transformers' own eager path.

The tolerance rule of tests/tolerance.py on whole models: flash_ext's logits, loss and parameter gradients
in float32 (CPU) or bfloat16 (CUDA, marked `cuda`) against the float64 eager model must be within 2x (3x
for gradients) of the error that the eager model makes at the same precision. Padded batches are compared
with each sequence run alone (float64 eager cannot run padded batches: its fully masked rows overflow to
NaN); packed sequences with eager's own packed-sequence masks; generate() must give eager's greedy tokens
(CPU) and per-step logits within the rule against the float64 model run on the generated sequences. Each
test also checks which flash_ext entry point ran (dense, varlen, kvcache), so that a fallback cannot pass.
Skipped without transformers.
"""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "AttentionMaskInterface"):
    pytest.skip(f"transformers {transformers.__version__} has no AttentionMaskInterface (register() refuses it)",
                allow_module_level=True)

import flash_ext  # noqa: E402
import flash_ext.integrations.transformers as flash_ext_hf  # noqa: E402
from devices import parametrize_devices  # noqa: E402
from tolerance import FWD_FACTOR, GRAD_FACTOR, assert_within_tolerance, magnitude  # noqa: E402

NAME = flash_ext_hf.register()
VOCAB = 96
REPO = Path(__file__).resolve().parents[1]

# Dtype of the models under test and head_dim per device: the CUDA decode kernel takes head dims 64/128/256.
DEVICES = parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=[torch.bfloat16]))
HEAD_DIM = {"cpu": 16, "cuda": 64}


# ---- models ----------------------------------------------------------------------------------------


def make_config(kind, head_dim, **overrides):
    heads_q, heads_kv = 4, 2
    common = dict(vocab_size=VOCAB, hidden_size=heads_q * head_dim, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=heads_q, num_key_value_heads=heads_kv, head_dim=head_dim,
                  max_position_embeddings=256, initializer_range=0.2, pad_token_id=0)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
    elif kind == "mistral":
        config = transformers.MistralConfig(sliding_window=8, **common)
    elif kind == "gemma2":
        # A softcap the random scores reach (they span a few units), a window shorter than the sequences.
        config = transformers.Gemma2Config(sliding_window=16, attn_logit_softcapping=2.0,
                                           query_pre_attn_scalar=head_dim, **common)
    else:
        raise ValueError(kind)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


MODEL_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM"}


def make_model64(kind, device, **overrides):
    """A random float64 eager model on device."""
    config = make_config(kind, HEAD_DIM[device], **overrides)
    model_class = getattr(transformers, MODEL_CLASSES[kind])
    return model_class._from_config(config, attn_implementation="eager", dtype=torch.float64).to(device)


def variant(model64, dtype, attn_implementation):
    """A copy of model64 in dtype, running attn_implementation."""
    model = copy.deepcopy(model64).to(dtype)
    model.set_attn_implementation(attn_implementation)
    assert model.config._attn_implementation == attn_implementation
    return model


@pytest.fixture
def paths(monkeypatch):
    """The flash_ext entry points the integration called, in order: (name, keyword arguments)."""
    calls = []
    for name in ("attention", "attention_varlen", "attention_with_kvcache"):
        original = getattr(flash_ext_hf._flash, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append((_name, kwargs))
            return _original(*args, **kwargs)

        monkeypatch.setattr(flash_ext_hf._flash, name, spy)
    return calls


def path_names(calls):
    return {name for name, _ in calls}


# ---- helpers ---------------------------------------------------------------------------------------


def lm_loss(logits, targets, valid):
    """Mean cross-entropy over the valid positions, in the logits' dtype."""
    return F.cross_entropy(logits[valid], targets[valid], reduction="sum") / valid.sum()


def logits_loss_grads(model, ids, targets, valid, **inputs):
    """logits at the valid positions (flattened), the loss and the gradient of every parameter."""
    logits = model(ids, use_cache=False, **inputs).logits
    loss = lm_loss(logits, targets, valid)
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss, params)
    return logits[valid].detach(), loss.detach(), dict(zip(names, grads))


def assert_model_within_tolerance(result, baseline, reference):
    """(logits, loss, grads) of flash_ext against the float64 reference, the budget set by the baseline."""
    for name, r, b, ref in zip(("logits", "loss"), result, baseline, reference):
        assert_within_tolerance(name, r, b, ref, FWD_FACTOR)
    for name, ref in reference[2].items():
        assert_within_tolerance(f"d({name})", result[2][name], baseline[2][name], ref, GRAD_FACTOR)


def padded_batch(lengths, side, device, generator=None):
    """Random token ids for sequences of the given lengths, padded to the longest on one side; the mask,
    and position ids counted from each sequence's first token (as generate() makes them)."""
    seqlen = max(lengths)
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long)
    for row, length in enumerate(lengths):
        if side == "left":
            mask[row, seqlen - length:] = 1
        else:
            mask[row, :length] = 1
    ids = torch.randint(1, VOCAB, (len(lengths), seqlen), generator=generator) * mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), position_ids.to(device)


def per_sequence_reference(model64, ids, mask, targets):
    """Each sequence of a padded batch run alone in float64: valid-position logits (flattened, in the
    batch's row-major order), the loss over them, and the parameter gradients."""
    valid = mask.bool()
    logits = torch.cat([model64(ids[row, valid[row]][None], use_cache=False).logits[0]
                        for row in range(ids.shape[0])])
    loss = F.cross_entropy(logits, targets[valid], reduction="sum") / valid.sum()
    names, params = zip(*model64.named_parameters())
    grads = torch.autograd.grad(loss, params)
    return logits.detach(), loss.detach(), dict(zip(names, grads))


# ---- registration ----------------------------------------------------------------------------------


def test_register_adds_the_attention_and_mask_functions():
    assert NAME == flash_ext_hf.ATTN_IMPLEMENTATION == "fext"
    assert transformers.AttentionInterface._global_mapping[NAME] is flash_ext_hf.attention_forward
    assert transformers.AttentionMaskInterface._global_mapping[NAME] is flash_ext_hf.key_padding_mask
    assert flash_ext_hf.register("fext_second_name") == "fext_second_name"  # again, under another name: allowed
    model = make_model64("llama", "cpu")
    model.set_attn_implementation("fext_second_name")
    assert model.config._attn_implementation == "fext_second_name"


@pytest.mark.parametrize("name, error", [
    ("flash_ext", ValueError),      # transformers would try to import it as a flash-attn package or Hub kernel
    ("my-FLASH", ValueError),
    ("org/repo", ValueError),       # a Hub kernel's pattern
    ("sdpa", ValueError),           # transformers' own
    ("", TypeError),
    (3, TypeError),
])
def test_register_rejects_unusable_names(name, error):
    with pytest.raises(error, match="name"):
        flash_ext_hf.register(name)


def test_register_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'flash_ext\[hf\]'"):
        flash_ext_hf.register()


def test_importing_flash_ext_does_not_import_transformers():
    code = ("import sys, flash_ext, flash_ext.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# ---- training: logits, loss, gradients -------------------------------------------------------------


@DEVICES
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_causal_lm_matches_eager(device, dtype, kind, paths):
    """No padding: logits, loss and gradients. Mistral's window (8) and Gemma 2's (16) are shorter than the
    sequence (24), so an off-by-one in the window changes the result; Gemma 2's softcap is reached."""
    model64 = make_model64(kind, device)
    ids = torch.randint(1, VOCAB, (2, 24), device=device)
    targets = torch.randint(0, VOCAB, (2, 24), device=device)
    valid = torch.ones_like(ids, dtype=torch.bool)
    reference = logits_loss_grads(model64, ids, targets, valid)
    baseline = logits_loss_grads(variant(model64, dtype, "eager"), ids, targets, valid)
    result = logits_loss_grads(variant(model64, dtype, NAME), ids, targets, valid)
    assert path_names(paths) == {"attention"}
    assert_model_within_tolerance(result, baseline, reference)


@DEVICES
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_padded_batch_matches_each_sequence_alone(device, dtype, kind, side, paths):
    """Training on a padded batch (the varlen path) and its inference forward (left padding: the cache path
    with cache_leftpad; right padding: varlen): valid positions against each sequence run alone."""
    model64 = make_model64(kind, device)
    ids, mask, position_ids = padded_batch([7, 20, 13], side, device)
    targets = torch.randint(0, VOCAB, ids.shape, device=device)
    valid = mask.bool()
    reference = per_sequence_reference(model64, ids, mask, targets)
    inputs = dict(attention_mask=mask, position_ids=position_ids)
    baseline = logits_loss_grads(variant(model64, dtype, "eager"), ids, targets, valid, **inputs)
    model = variant(model64, dtype, NAME)
    result = logits_loss_grads(model, ids, targets, valid, **inputs)
    assert path_names(paths) == {"attention_varlen"}
    assert_model_within_tolerance(result, baseline, reference)

    paths.clear()
    with torch.no_grad():
        logits = model(ids, use_cache=False, **inputs).logits[valid]
    assert path_names(paths) == {"attention_with_kvcache" if side == "left" else "attention_varlen"}
    assert_within_tolerance("logits (no_grad)", logits, baseline[0], reference[0], FWD_FACTOR)


@DEVICES
@pytest.mark.parametrize("given_as", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("rows", [1, 2])
def test_packed_sequences_match_eager(device, dtype, rows, given_as, paths):
    """Several sequences per row, told apart by position ids that restart (eager builds its block-diagonal
    mask from them) or by transformers' cu_seq_lens_* / max_length_* keywords (flattened over the batch)."""
    model64 = make_model64("mistral", device)
    lengths = [[5, 11, 8], [9, 15]][:rows]  # the sequences of each row, 24 tokens a row
    seqlen = 24
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(device)
    ids = torch.randint(1, VOCAB, (rows, seqlen), device=device)
    targets = torch.randint(0, VOCAB, (rows, seqlen), device=device)
    valid = torch.ones_like(ids, dtype=torch.bool)
    inputs = dict(position_ids=position_ids)
    reference = logits_loss_grads(model64, ids, targets, valid, **inputs)
    baseline = logits_loss_grads(variant(model64, dtype, "eager"), ids, targets, valid, **inputs)
    if given_as == "cu_seq_lens":
        flat = [n for row in lengths for n in row]
        cu = torch.tensor([0] + flat, device=device).cumsum(0)
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(flat), max_length_k=max(flat))
    result = logits_loss_grads(variant(model64, dtype, NAME), ids, targets, valid, **inputs)
    assert path_names(paths) == {"attention_varlen"}
    assert_model_within_tolerance(result, baseline, reference)


# ---- generation ------------------------------------------------------------------------------------


def check_generate(model64, dtype, cache, compile=False):
    """Greedy generate() with flash_ext on a left-padded batch, 14 new tokens. Its per-step logits against the
    float64 model run on each generated sequence alone (teacher forcing), within the rule whose budget is
    eager's error at the same precision on the same sequences. Returns (flash_ext's, eager's) generated
    sequences."""
    ids, mask, _ = padded_batch([5, 10], "left", model64.device)
    # min_new_tokens: no row stops early (the raw logits, compared below, are unaffected).
    options = dict(attention_mask=mask, max_new_tokens=14, min_new_tokens=14, do_sample=False,
                   cache_implementation=cache, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    with torch.no_grad():
        out = variant(model64, dtype, NAME).generate(ids, disable_compile=not compile, **options)
        eager_model = variant(model64, dtype, "eager")
        eager = eager_model.generate(ids, disable_compile=True, **options)
        prompt = ids.shape[1]
        logits = torch.stack(out.logits, 1)  # (batch, new tokens, vocab)
        full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, prompt:])], 1)
        position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)
        eager_logits = eager_model(out.sequences, attention_mask=full_mask, position_ids=position_ids,
                                   use_cache=False).logits[:, prompt - 1:-1]
        alone = [out.sequences[row, full_mask[row].bool()][None] for row in range(ids.shape[0])]
        reference = torch.stack([model64(sequence, use_cache=False).logits[0, -15:-1] for sequence in alone])
    assert_within_tolerance("generate logits", logits, eager_logits, reference, FWD_FACTOR,
                            scale=magnitude(reference))
    return out.sequences, eager.sequences


@DEVICES
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_generate_matches_eager(device, dtype, kind, cache, paths):
    """Generation past Mistral's window (8) and into Gemma 2's (16); static caches hold sliding layers in
    rolling buffers. Decode steps read the cache through attention_with_kvcache; on the CPU (float32) the
    greedy tokens must also equal eager's."""
    sequences, eager_sequences = check_generate(make_model64(kind, device), dtype, cache)
    assert "attention_with_kvcache" in path_names(paths)
    if device == "cpu":
        assert torch.equal(sequences, eager_sequences)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_generate_static_cache_compiled(kind):
    """generate() with a static cache on CUDA compiles the decode step (mode "reduce-overhead", CUDA graphs)
    unless told not to: the mask builder's host syncs break the graph there, and the result must still hold."""
    check_generate(make_model64(kind, "cuda"), torch.bfloat16, "static", compile=True)


# ---- training options ------------------------------------------------------------------------------


class _Module(torch.nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.is_causal = is_causal


def test_dropout_is_flash_ext_dropout(paths):
    """The layer's dropout reaches flash_ext: the same seed gives flash_ext.attention's exact output."""
    q, k, v = torch.randn(2, 4, 12, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    torch.manual_seed(7)
    out, weights = flash_ext_hf.attention_forward(_Module(True), q, k, v, None, dropout=0.25)
    torch.manual_seed(7)
    expected = flash_ext.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, dropout_p=0.25)
    assert weights is None
    assert torch.equal(out, expected)
    torch.manual_seed(7)
    assert not torch.equal(out, flash_ext_hf.attention_forward(_Module(True), q, k, v, None, dropout=0.0)[0])


def test_model_passes_attention_dropout_in_training_only(paths):
    model = variant(make_model64("llama", "cpu", attention_dropout=0.3), torch.float32, NAME)
    ids = torch.randint(1, VOCAB, (1, 10))
    model.train()
    model(ids, use_cache=False).logits.sum().backward()
    assert {kwargs["dropout_p"] for _, kwargs in paths} == {0.3}
    paths.clear()
    model.eval()
    model(ids, use_cache=False)
    assert {kwargs["dropout_p"] for _, kwargs in paths} == {0.0}


@pytest.mark.parametrize("window, seqlen_q", [(None, 9), (None, 4), (3, 9)])
def test_bidirectional_padded_matches_transformers_masks(window, seqlen_q):
    """Non-causal layers (encoders, and cross-attention when seqlen_q differs from seqlen_k): every query
    sees the real keys, within distance `window` as transformers' bidirectional sliding masks define it.
    Against SDPA with the 4-D mask transformers builds for the same case (float64; float32 the baseline), on
    the rows of real queries (with a window, padded query rows are zeros, as in the causal case)."""
    from transformers import masking_utils

    if not hasattr(masking_utils, "sliding_window_bidirectional_mask_function"):
        pytest.skip(f"transformers {transformers.__version__} builds no bidirectional sliding-window masks")
    batch, heads_q, heads_kv, seqlen_k, head_dim = 3, 4, 2, 9, 16
    key_mask = torch.ones(batch, seqlen_k, dtype=torch.bool)
    key_mask[0, :3] = False
    key_mask[2, 6:] = False
    pattern = (masking_utils.bidirectional_mask_function if window is None
               else masking_utils.sliding_window_bidirectional_mask_function(window))
    mask = flash_ext_hf.key_padding_mask(batch, seqlen_q, seqlen_k, mask_function=pattern, attention_mask=key_mask)
    assert torch.equal(mask, key_mask)
    mask4d = masking_utils.sdpa_mask(batch_size=batch, q_length=seqlen_q, kv_length=seqlen_k, mask_function=pattern,
                                     attention_mask=key_mask, allow_is_causal_skip=False,
                                     allow_is_bidirectional_skip=False)
    q = torch.randn(batch, heads_q, seqlen_q, head_dim)
    k, v = torch.randn(2, batch, heads_kv, seqlen_k, head_dim)

    def sdpa(*tensors):
        q_, k_, v_ = tensors
        out = F.scaled_dot_product_attention(q_, k_.repeat_interleave(2, 1), v_.repeat_interleave(2, 1),
                                             attn_mask=mask4d)
        return out.transpose(1, 2)

    out, _ = flash_ext_hf.attention_forward(_Module(False), q, k, v, mask, sliding_window=window)
    rows = mask4d[:, 0].any(-1)  # query rows that see a key
    if seqlen_q == seqlen_k:
        rows &= key_mask
    reference = sdpa(q.double(), k.double(), v.double())[rows]
    assert_within_tolerance("out", out[rows], sdpa(q, k, v)[rows], reference, FWD_FACTOR)


# ---- what is refused -------------------------------------------------------------------------------


def test_four_dimensional_mask_is_refused():
    model = variant(make_model64("llama", "cpu"), torch.float32, NAME)
    ids = torch.randint(1, VOCAB, (1, 6))
    mask4d = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="2-D"):
        model(ids, attention_mask=mask4d, use_cache=False)


def test_mask_patterns_flash_ext_cannot_express_are_refused():
    from types import SimpleNamespace

    with pytest.raises(NotImplementedError, match="or_mask_function"):
        flash_ext_hf.key_padding_mask(1, 4, 4, use_vmap=True)  # what transformers passes with custom overlays
    with pytest.raises(NotImplementedError, match="attention_chunk_size"):
        flash_ext_hf.key_padding_mask(1, 4, 4, config=SimpleNamespace(attention_chunk_size=8))
    assert flash_ext_hf.key_padding_mask(1, 4, 4, config=SimpleNamespace(attention_chunk_size=None)) is None


def test_unsupported_options_are_refused():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(NotImplementedError, match="bidirectional sliding window"):
        flash_ext_hf.attention_forward(_Module(False), q[:, :, :3], q, q, None, sliding_window=2)
    with pytest.raises(NotImplementedError, match="s_aux"):
        flash_ext_hf.attention_forward(_Module(True), q, q, q, None, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="sliding_window"):
        flash_ext_hf.attention_forward(_Module(True), q, q, q, None, sliding_window=0)
    with pytest.raises(ValueError, match="attention_mask"):
        flash_ext_hf.attention_forward(_Module(True), q, q, q, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        flash_ext_hf.attention_forward(_Module(True), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 5]))


@pytest.mark.cuda
def test_float32_on_cuda_says_what_to_do():
    q = torch.randn(1, 2, 5, 64, device="cuda")
    with pytest.raises(TypeError, match="bfloat16"):
        flash_ext_hf.attention_forward(_Module(True), q, q, q, None)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = flash_ext_hf.attention_forward(_Module(True), q, q, q, None)
    assert out.dtype == torch.bfloat16


# ---- the example -----------------------------------------------------------------------------------


def test_example_hf_generate_runs():
    example = REPO / "examples" / "hf_generate.py"
    if not example.exists():
        pytest.skip(f"{example} not found: run the tests from a checkout, or copy examples/ next to tests/")
    # One thread: the example's tiny matmuls run faster without a thread pool, most of all on a loaded machine.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(example), "--device", "cpu",
                             "--max-new-tokens", "8", "--steps", "1"], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tokens/s" in result.stdout
    assert result.stdout.count("same greedy tokens as sdpa: yes") == 2, result.stdout  # dynamic and static cache
