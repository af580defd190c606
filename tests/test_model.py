"""The model layers against PyTorch's own implementations, and properties of the whole Transformer."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from tinylm.model import (
    CausalSelfAttention,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    Transformer,
    causal_mask,
    scaled_dot_product_attention,
)
from tinylm.nn_utils import cross_entropy
from tinylm.optim import AdamW

TINY = dict(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(**{**TINY, **overrides})


# ---------------------------------------------------------------- layers


def test_linear_matches_torch_linear():
    torch.manual_seed(0)
    layer = Linear(24, 40)
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    assert layer.weight.shape == (40, 24)
    assert [name for name, _ in layer.named_parameters()] == ["weight"]


def test_linear_init_is_truncated_normal_with_the_stated_std():
    torch.manual_seed(0)
    d_in, d_out = 300, 500
    w = Linear(d_in, d_out).weight.detach()
    std = math.sqrt(2.0 / (d_in + d_out))
    assert w.abs().max() <= 3 * std + 1e-7
    # The std of a standard normal truncated at +-3 is sqrt(1 - 6 phi(3) / (2 Phi(3) - 1)).
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    truncated_std = std * math.sqrt(1 - 6 * phi3 / math.erf(3 / math.sqrt(2)))
    assert w.std().item() == pytest.approx(truncated_std, rel=0.01)
    assert w.mean().item() == pytest.approx(0.0, abs=0.01 * std)


def test_embedding_matches_torch_embedding():
    torch.manual_seed(0)
    emb = Embedding(50, 16)
    ids = torch.randint(0, 50, (4, 7))
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))
    assert emb.weight.abs().max() <= 3.0


@pytest.mark.parametrize("shape", [(8,), (3, 5, 8), (2, 3, 4, 8)])
def test_rmsnorm_matches_torch_rmsnorm(shape):
    torch.manual_seed(0)
    ours = RMSNorm(8, eps=1e-5)
    theirs = torch.nn.RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(8))
        theirs.weight.copy_(ours.weight)
    x = torch.randn(shape) * 3
    x_ours = x.clone().requires_grad_()
    x_theirs = x.clone().requires_grad_()
    torch.testing.assert_close(ours(x_ours), theirs(x_theirs))
    ours(x_ours).pow(2).sum().backward()
    theirs(x_theirs).pow(2).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)


def test_rmsnorm_computes_in_float32_and_returns_the_input_dtype():
    torch.manual_seed(0)
    norm = RMSNorm(64)
    reference = torch.nn.RMSNorm(64, eps=1e-5)
    x = (torch.randn(4, 64) * 100).to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    # Same as normalising the float32 values and rounding once at the end.
    expected = reference(x.float()).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula written out: x / sqrt(mean(x^2) + eps) * weight, in at least float32."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps) * weight).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("autocast", [False, True])
def test_rmsnorm_is_the_written_out_formula_bit_for_bit(dtype, autocast):
    """RMSNorm runs through F.rms_norm: on the CPU the same bits as the formula, forward and the
    gradients of the input and the gain (so the default run's bytes do not depend on which)."""
    torch.manual_seed(0)
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    norm = RMSNorm(96, eps=1e-5, dtype=weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96) * 0.3 + 1)
    x = (torch.randn(4, 7, 96) * 5).to(dtype).requires_grad_()
    upstream = torch.randn(4, 7, 96).to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ours = norm(x)
        reference = rms_norm_reference(x, norm.weight, 1e-5)
    assert ours.dtype == reference.dtype == dtype
    assert torch.equal(ours, reference)
    ours_grads = torch.autograd.grad(ours, (x, norm.weight), upstream)
    reference_grads = torch.autograd.grad(reference, (x, norm.weight), upstream)
    for mine, theirs in zip(ours_grads, reference_grads, strict=True):
        assert torch.equal(mine, theirs)


def test_swiglu_matches_the_formula():
    torch.manual_seed(0)
    ffn = SwiGLU(d_model=16, d_ff=40)
    x = torch.randn(2, 5, 16)
    w1, w2, w3 = ffn.w1.weight, ffn.w2.weight, ffn.w3.weight
    a = x @ w1.T
    expected = (a * torch.sigmoid(a) * (x @ w3.T)) @ w2.T
    torch.testing.assert_close(ffn(x), expected)
    assert w1.shape == (40, 16) and w3.shape == (40, 16) and w2.shape == (16, 40)


# ---------------------------------------------------------------- RoPE


def test_rope_rotates_consecutive_pairs_like_complex_multiplication():
    torch.manual_seed(0)
    theta, d_k, T = 10000.0, 8, 12
    rope = RotaryEmbedding(theta, d_k, max_seq_len=T)
    x = torch.randn(3, T, d_k)
    # Pair (x[2i], x[2i+1]) as the complex number x[2i] + i x[2i+1], multiplied by e^{i p theta_i}.
    freqs = theta ** (-torch.arange(0, d_k, 2, dtype=torch.float64) / d_k)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)
    rotation = torch.polar(torch.ones_like(angles), angles)
    as_complex = torch.view_as_complex(x.double().reshape(3, T, d_k // 2, 2))
    expected = torch.view_as_real(as_complex * rotation).reshape(3, T, d_k).float()
    torch.testing.assert_close(rope(x), expected)


def test_rope_dot_product_depends_only_on_position_offset():
    torch.manual_seed(0)
    d_k, max_len = 16, 64
    rope = RotaryEmbedding(10000.0, d_k, max_seq_len=max_len)
    q, k = torch.randn(d_k), torch.randn(d_k)

    def rotated_dot(m: int, n: int) -> torch.Tensor:
        q_m = rope(q[None], torch.tensor([m]))[0]
        k_n = rope(k[None], torch.tensor([n]))[0]
        return q_m @ k_n

    for m, n in [(5, 2), (9, 9), (3, 17), (40, 0)]:
        for shift in (1, 7, 20):
            torch.testing.assert_close(
                rotated_dot(m, n), rotated_dot(m + shift, n + shift), atol=1e-5, rtol=1e-5
            )
    # ...and it does depend on the offset (otherwise the test above would prove nothing).
    assert not torch.allclose(rotated_dot(5, 2), rotated_dot(5, 3), atol=1e-3)
    # A rotation keeps lengths.
    torch.testing.assert_close(rope(q[None], torch.tensor([13]))[0].norm(), q.norm())


def test_rope_default_positions_are_0_to_T_minus_1_and_buffers_are_not_saved():
    torch.manual_seed(0)
    rope = RotaryEmbedding(500.0, 8, max_seq_len=10)
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(rope(x), rope(x, torch.arange(6)))
    assert rope.state_dict() == {}


# ---------------------------------------------------------------- attention


def test_reference_attention_matches_torch_sdpa_with_a_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 5)
    mask = torch.rand(7, 9) > 0.3
    mask[:, 0] = True  # every query sees at least one key
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    )
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("fast", [True, False])
def test_attention_paths_match_torch_causal_sdpa(fast):
    torch.manual_seed(0)
    B, T, d_model, num_heads = 2, 10, 24, 3
    d_head = d_model // num_heads
    rope = RotaryEmbedding(10000.0, d_head, max_seq_len=16)
    attn = CausalSelfAttention(d_model, num_heads, rope=rope, use_fast_attention=fast)
    x = torch.randn(B, T, d_model, requires_grad=True)

    # The same computation spelled out with separate q, k, v weights and PyTorch's attention.
    w_q, w_k, w_v = attn.qkv_proj.weight.chunk(3, dim=0)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, T, num_heads, d_head).transpose(1, 2)

    q, k, v = heads(x @ w_q.T), heads(x @ w_k.T), heads(x @ w_v.T)
    out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
    expected = out.transpose(1, 2).reshape(B, T, d_model) @ attn.output_proj.weight.T

    actual = attn(x)
    torch.testing.assert_close(actual, expected)
    grad_actual = torch.autograd.grad(actual.sum(), x)[0]
    grad_expected = torch.autograd.grad(expected.sum(), x)[0]
    torch.testing.assert_close(grad_actual, grad_expected)


def test_causal_mask_is_lower_triangular():
    mask = causal_mask(4)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[i >= j for j in range(4)] for i in range(4)]


# ---------------------------------------------------------------- the Transformer


def test_transformer_shapes_and_any_length_up_to_context():
    model = tiny_model()
    for T in (1, 7, TINY["context_length"]):
        ids = torch.randint(0, TINY["vocab_size"], (3, T))
        assert model(ids).shape == (3, T, TINY["vocab_size"])


def test_transformer_refuses_sequences_longer_than_context():
    model = tiny_model()
    ids = torch.randint(0, TINY["vocab_size"], (1, TINY["context_length"] + 1))
    with pytest.raises(ValueError, match="context_length"):
        model(ids)


def test_transformer_is_causal():
    model = tiny_model().eval()
    torch.manual_seed(1)
    T = TINY["context_length"]
    ids = torch.randint(0, TINY["vocab_size"], (2, T))
    with torch.no_grad():
        logits = model(ids)
        for t in (0, 5, T - 2):
            changed = ids.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % TINY["vocab_size"]
            new_logits = model(changed)
            torch.testing.assert_close(new_logits[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(new_logits[:, t + 1], logits[:, t + 1])


def test_fast_and_reference_attention_give_the_same_model_output():
    model = tiny_model()
    ids = torch.randint(0, TINY["vocab_size"], (2, TINY["context_length"]))
    fast = model(ids)
    model.set_fast_attention(False)
    assert not model.layers[0].attn.use_fast_attention
    torch.testing.assert_close(model(ids), fast)


def test_parameter_names_and_config_rebuild_the_model():
    model = tiny_model(rope_theta=500.0)
    names = set(model.state_dict())
    expected = {"token_embeddings.weight", "ln_final.weight", "lm_head.weight"}
    for i in range(TINY["num_layers"]):
        for part in ("ln1", "attn.qkv_proj", "attn.output_proj", "ln2", "ffn.w1", "ffn.w2", "ffn.w3"):
            expected.add(f"layers.{i}.{part}.weight")
    assert names == expected
    options_off = dict(
        qk_norm=False,
        mlp="swiglu",
        logit_softcap=None,
        zero_init_output=False,
        tie_embeddings=False,
        value_embeddings=False,
        dropout=0.0,
        embedding_norm=False,
    )  # pad_vocab_to_multiple at 1 is left out: the checkpoints made before it existed are the same
    assert model.config == {**TINY, "rope_theta": 500.0, **options_off}
    rebuilt = Transformer(**model.config)
    rebuilt.load_state_dict(model.state_dict())
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    torch.testing.assert_close(rebuilt(ids), model(ids))
    d = TINY["d_model"]
    per_layer = 2 * d + 4 * d * d + 3 * d * TINY["d_ff"]
    total = 2 * TINY["vocab_size"] * d + d + TINY["num_layers"] * per_layer
    assert model.num_parameters() == total


def test_rope_theta_changes_the_output():
    ids = torch.randint(0, TINY["vocab_size"], (1, 12))
    a = tiny_model(rope_theta=10000.0)
    b = tiny_model(rope_theta=10.0)
    b.load_state_dict(a.state_dict())
    assert not torch.allclose(a(ids), b(ids))


def test_model_runs_in_bfloat16():
    model = tiny_model(dtype=torch.bfloat16)
    logits = model(torch.randint(0, TINY["vocab_size"], (2, 8)))
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits.float()).all()


def test_model_overfits_one_batch():
    torch.manual_seed(0)
    model = Transformer(vocab_size=100, context_length=32, d_model=64, num_layers=2, num_heads=4, d_ff=128)
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    tokens = torch.randint(0, 100, (4, 33))
    x, y = tokens[:, :-1], tokens[:, 1:]
    start = time.perf_counter()
    for _ in range(300):
        loss = cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if loss.item() < 0.1:
            break
    assert loss.item() < 0.1, f"loss still {loss.item():.3f} after 300 steps"
    assert time.perf_counter() - start < 60


def test_model_runs_under_bfloat16_autocast():
    model = tiny_model()
    ids = torch.randint(0, TINY["vocab_size"], (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
        loss = cross_entropy(logits, ids)
    assert loss.dtype == torch.float32
    loss.backward()
    assert model.lm_head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(logits.float(), model(ids), atol=0.1, rtol=0.1)


# ---------------------------------------------------------------- the KV cache


@pytest.mark.parametrize("fast", [True, False])
def test_kv_cache_gives_the_logits_of_the_full_forward(fast):
    """Prefill, then one position at a time, then several at once: the logits of one full forward."""
    model = tiny_model(rope_theta=100.0).eval()
    model.set_fast_attention(fast)
    T = TINY["context_length"]
    ids = torch.randint(0, TINY["vocab_size"], (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(batch_size=2)
        pieces, start = [], 0
        for end in (5, 6, 7, 8, 13, T):  # 5 positions, three single ones, 5 at once, the rest
            pieces.append(model(ids[:, start:end], kv_cache=cache))
            start = end
    assert cache.length == T
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="cached"):
        model(ids[:, :1], kv_cache=cache)


def test_training_forward_compiles_as_one_graph():
    """forward(ids) without a cache has no branch the compiler cannot see through."""
    model = tiny_model()
    ids = torch.randint(0, TINY["vocab_size"], (2, TINY["context_length"]))
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # fullgraph: a graph break is an error
    torch.testing.assert_close(compiled(ids), model(ids))


@pytest.mark.parametrize(
    "options", [{}, {"logit_softcap": 15.0, "tie_embeddings": True}], ids=["plain", "softcap-tied"]
)
def test_the_loss_region_compiles_whole_and_is_the_eager_loss(options):
    """Transformer.output_loss (ln_final, head, soft-cap, our chunked cross-entropy), as
    train.compile compiles it: one graph forward and backward (fullgraph: a graph break is an
    error; aot_eager traces the backward too), no recompilation for new targets, and the eager
    loss and gradients under bf16 autocast; forward(ids, targets=) is that loss."""
    import torch._dynamo

    torch.manual_seed(0)
    model = Transformer(**{**TINY, **options})
    hidden = torch.randn(2, TINY["context_length"], TINY["d_model"])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model.output_loss, fullgraph=True, backend="aot_eager")
    for seed in (1, 2):
        targets = torch.randint(
            0, TINY["vocab_size"], (2, TINY["context_length"]), generator=torch.Generator().manual_seed(seed)
        )
        results = []
        for region in (compiled, model.output_loss):
            leaf = hidden.clone().requires_grad_()
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = region(leaf, targets)
            loss.backward()
            results.append((loss, leaf.grad, model.lm_head.weight.grad))
        assert results[0][0].dtype == torch.float32
        for mine, eager in zip(*results, strict=True):
            assert torch.equal(mine, eager)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the second targets reuse it
    ids = torch.randint(0, TINY["vocab_size"], (2, TINY["context_length"]))
    torch.testing.assert_close(
        model(ids, targets=targets), cross_entropy(model(ids), targets), rtol=0, atol=0
    )


# ------------------------------------------------------------------------------------------------
# Activation checkpointing

EVERY_OPTION = dict(
    vocab_size=50,
    context_length=16,
    d_model=32,
    num_layers=3,
    num_heads=2,
    d_ff=48,
    qk_norm=True,
    value_embeddings=True,
    tie_embeddings=True,
    embedding_norm=True,
    logit_softcap=10.0,
    dropout=0.1,
)


def gradients_and_recomputations(model, ids, mode, dtype=None) -> tuple[list[torch.Tensor], int]:
    """The gradients of one backward under `mode` (the same RNG state every time), and how many
    block forwards ran: the model's own plus the recomputations."""
    calls = []
    handles = [layer.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model.layers]
    model.set_activation_checkpointing(mode)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        logits = model(ids)
    cross_entropy(logits, ids.roll(-1, dims=1)).backward()
    for handle in handles:
        handle.remove()
    return [p.grad.clone() for p in model.parameters()], len(calls)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_activation_checkpointing_recomputes_blocks_and_keeps_the_gradients_exactly(dtype):
    torch.manual_seed(0)
    model = Transformer(**EVERY_OPTION)
    model.train()
    ids = torch.randint(0, 50, (3, 16))
    plain, forwards = gradients_and_recomputations(model, ids, "none", dtype)
    assert forwards == 3
    for mode, recomputed in (("full", 3), ("selective", 2)):  # selective: blocks 0 and 2
        grads, forwards = gradients_and_recomputations(model, ids, mode, dtype)
        assert forwards == 3 + recomputed, mode
        assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True)), mode
    model.set_activation_checkpointing("full")
    model.eval()
    with torch.no_grad():  # where autograd does not record there is nothing to recompute
        checkpointed = model(ids)
        model.set_activation_checkpointing("none")
        assert torch.equal(checkpointed, model(ids))


def test_activation_checkpointing_saves_activation_memory():
    """Fewer bytes saved for backward with every block recomputed (torch's saved-tensor hooks count
    them, each storage once), about half with every second one."""
    torch.manual_seed(0)
    model = Transformer(vocab_size=50, context_length=64, d_model=64, num_layers=4, num_heads=4, d_ff=176)
    ids = torch.randint(0, 50, (8, 64))

    def saved_bytes(mode: str) -> int:
        model.set_activation_checkpointing(mode)
        storages = {}

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids).sum()
        return sum(storages.values())

    none, selective, full = (saved_bytes(mode) for mode in ("none", "selective", "full"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert full - weights < 0.25 * (none - weights)  # each block keeps only its input
    assert 0.35 < (selective - weights) / (none - weights) < 0.75


def test_an_unknown_activation_checkpointing_mode_is_refused():
    model = Transformer(vocab_size=50, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=24)
    with pytest.raises(ValueError, match=r"activation checkpointing: 'some' is not one of \['none'"):
        model.set_activation_checkpointing("some")


@pytest.mark.slow
def test_activation_checkpointing_of_compiled_blocks_keeps_their_gradients():
    torch.manual_seed(0)
    model = Transformer(**{**EVERY_OPTION, "dropout": 0.0})  # compiled dropout draws its own masks
    for block in model.layers:
        block.compile()
    ids = torch.randint(0, 50, (3, 16))
    plain, _ = gradients_and_recomputations(model, ids, "none")
    for mode in ("full", "selective"):
        grads, _ = gradients_and_recomputations(model, ids, mode)
        assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True)), mode


@pytest.mark.parametrize("seq_len", [5, 128, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_causal_attention_matches_torch_sdpa_either_side_of_the_matmul_path(seq_len, dtype):
    """At most MATMUL_ATTENTION_MAX_LENGTH positions on the CPU, matmuls and a float32 softmax;
    beyond, the fused kernel: both against F.scaled_dot_product_attention in float64."""
    from tinylm.model.attention import MATMUL_ATTENTION_MAX_LENGTH, fast_causal_attention

    assert MATMUL_ATTENTION_MAX_LENGTH == 128
    torch.manual_seed(seq_len)
    q, k, v = (torch.randn(2, 3, seq_len, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    out = fast_causal_attention(q, k, v)
    out.float().square().sum().backward()
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*exact, is_causal=True)
    expected.square().sum().backward()
    tol = dict(rtol=5e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), expected, **tol)
    for ours, reference in zip((q, k, v), exact, strict=True):
        torch.testing.assert_close(ours.grad.double(), reference.grad, **tol)
