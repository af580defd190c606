"""The model options (Transformer's recipe keys) against the same math written in plain PyTorch.

`reference_logits` is the whole forward pass recomputed from the model's weights (by state-dict name)
with torch.nn.functional only: F.embedding, F.rms_norm, F.linear, F.scaled_dot_product_attention or
the softmax written out, F.silu / F.relu, torch.tanh, nn.Dropout, and RoPE as complex multiplication.
Every model is moved off its initialisation first (`jitter`), so RMSNorm gains are not 1, zero-initialised
weights are not 0 and the value gates not 0.5: an option applied in the wrong place shows.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tinylm.config import ConfigError, ModelConfig, from_dict
from tinylm.model import ModelOptions, Transformer

TINY = dict(
    vocab_size=64, context_length=16, d_model=32, num_layers=3, num_heads=4, d_ff=24, rope_theta=500.0
)
OFF = dict(
    qk_norm=False,
    mlp="swiglu",
    logit_softcap=None,
    zero_init_output=False,
    tie_embeddings=False,
    value_embeddings=False,
    dropout=0.0,
    embedding_norm=False,
    pad_vocab_to_multiple=1,
)
ALL_ON = dict(
    qk_norm=True,
    mlp="relu2",
    logit_softcap=3.0,
    zero_init_output=True,
    tie_embeddings=True,
    value_embeddings=True,
    dropout=0.2,
    embedding_norm=True,
    pad_vocab_to_multiple=48,
)
EPS = 1e-5  # every RMSNorm's


def build(seed: int = 0, **options) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(**{**TINY, **options})


def jitter(model: Transformer, seed: int = 1, scale: float = 0.2) -> Transformer:
    """Add noise to every parameter (once to a tied one), as training would move them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def token_ids(batch: int = 2, seq_len: int = TINY["context_length"], seed: int = 5) -> torch.Tensor:
    return torch.randint(TINY["vocab_size"], (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as complex multiplication: pair (x[2i], x[2i+1]) at position p times e^(i p theta^(-2i/d))."""
    T, d = x.shape[-2:]
    angles = torch.outer(torch.arange(T, dtype=torch.float64), theta ** (-torch.arange(0, d, 2) / d))
    rotation = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2)


def reference_logits(
    model: Transformer,
    ids: torch.Tensor,
    weights: dict[str, torch.Tensor] | None = None,
    dropout: float = 0.0,
    fused: bool = True,
) -> torch.Tensor:
    """The forward pass of `model` (its config, its weights or `weights`) in plain PyTorch.

    dropout > 0: drawn in the model's order (per layer: attention probabilities, attention branch,
    MLP branch) from the global generator; fused: F.scaled_dot_product_attention, else the softmax
    written out.
    """
    c = model.config
    w = dict(model.state_dict()) if weights is None else weights
    d, H = c["d_model"], c["num_heads"]
    d_head = d // H
    B, T = ids.shape
    drop = nn.Dropout(dropout)
    x = F.embedding(ids, w["token_embeddings.weight"])
    if c["embedding_norm"]:
        x = F.rms_norm(x, (d,), w["embedding_norm.weight"], EPS)
    for i in range(c["num_layers"]):
        p = f"layers.{i}."
        h = F.rms_norm(x, (d,), w[p + "ln1.weight"], EPS)
        q, k, v = F.linear(h, w[p + "attn.qkv_proj.weight"]).view(B, T, 3, H, d_head).permute(2, 0, 3, 1, 4)
        if c["qk_norm"]:
            q = F.rms_norm(q, (d_head,), w[p + "attn.q_norm.weight"], EPS)
            k = F.rms_norm(k, (d_head,), w[p + "attn.k_norm.weight"], EPS)
        q, k = rope(q, c["rope_theta"]), rope(k, c["rope_theta"])
        if p + "attn.value_embedding.weight" in w:
            ve = F.embedding(ids, w[p + "attn.value_embedding.weight"]).view(B, T, H, d_head).transpose(1, 2)
            v = v + w[p + "attn.value_gate"] * ve
        if fused:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            scores = (q @ k.transpose(-2, -1) / math.sqrt(d_head)).masked_fill(
                ~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")
            )
            out = drop(torch.softmax(scores, dim=-1)) @ v
        out = out.transpose(1, 2).reshape(B, T, d)
        x = x + drop(F.linear(out, w[p + "attn.output_proj.weight"]))
        h = F.rms_norm(x, (d,), w[p + "ln2.weight"], EPS)
        if c["mlp"] in ("swiglu", "geglu"):
            act = F.silu if c["mlp"] == "swiglu" else F.gelu
            mlp = F.linear(
                act(F.linear(h, w[p + "ffn.w1.weight"])) * F.linear(h, w[p + "ffn.w3.weight"]),
                w[p + "ffn.w2.weight"],
            )
        else:
            mlp = F.linear(F.relu(F.linear(h, w[p + "ffn.w_in.weight"])) ** 2, w[p + "ffn.w_out.weight"])
        x = x + drop(mlp)
    logits = F.linear(F.rms_norm(x, (d,), w["ln_final.weight"], EPS), w["lm_head.weight"])
    logits = logits[..., : c["vocab_size"]]  # the padding rows' logits are no prediction
    if c["logit_softcap"] is not None:
        logits = c["logit_softcap"] * torch.tanh(logits / c["logit_softcap"])
    return logits


# ---------------------------------------------------------------- every option off


def test_every_option_at_its_default_is_the_plain_model_draw_for_draw():
    plain = build(seed=3)
    after_plain = torch.rand(4)  # the generator's state after construction
    defaults = build(seed=3, **OFF)
    assert torch.equal(torch.rand(4), after_plain)
    assert list(plain.state_dict()) == list(defaults.state_dict())
    for (name, a), b in zip(plain.state_dict().items(), defaults.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ids = token_ids()
    assert torch.equal(plain(ids), defaults(ids))
    # A capability off (declared left_out_at) is not recorded: older checkpoints' configs are alike.
    assert defaults.config == {**TINY, **{k: v for k, v in OFF.items() if k != "pad_vocab_to_multiple"}}
    assert Transformer(**defaults.config).options == defaults.options


def test_every_option_off_draws_the_plain_initialisation_in_its_order():
    """The plain model's initialisation written out: the embedding (std 1), then per layer qkv_proj,
    output_proj, w1, w2, w3 (std sqrt(2 / (d_in + d_out))), then the head, each a normal truncated at
    3 std; every RMSNorm gain 1."""
    torch.manual_seed(7)
    model = Transformer(**TINY, **OFF)
    after_model = torch.rand(4)

    def draw(d_out: int, d_in: int, std: float) -> torch.Tensor:
        return nn.init.trunc_normal_(torch.empty(d_out, d_in), 0.0, std, -3 * std, 3 * std)

    def linear(d_in: int, d_out: int) -> torch.Tensor:
        return draw(d_out, d_in, math.sqrt(2 / (d_in + d_out)))

    V, d, d_ff = TINY["vocab_size"], TINY["d_model"], TINY["d_ff"]
    torch.manual_seed(7)
    expected = {"token_embeddings.weight": draw(V, d, 1.0)}
    for i in range(TINY["num_layers"]):
        expected[f"layers.{i}.ln1.weight"] = torch.ones(d)
        expected[f"layers.{i}.attn.qkv_proj.weight"] = linear(d, 3 * d)
        expected[f"layers.{i}.attn.output_proj.weight"] = linear(d, d)
        expected[f"layers.{i}.ln2.weight"] = torch.ones(d)
        expected[f"layers.{i}.ffn.w1.weight"] = linear(d, d_ff)
        expected[f"layers.{i}.ffn.w2.weight"] = linear(d_ff, d)
        expected[f"layers.{i}.ffn.w3.weight"] = linear(d, d_ff)
    expected["ln_final.weight"] = torch.ones(d)
    expected["lm_head.weight"] = linear(d, V)
    assert torch.equal(torch.rand(4), after_model)
    state = model.state_dict()
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_the_config_rebuilds_a_model_with_every_option():
    model = jitter(build(**ALL_ON)).eval()
    rebuilt = Transformer(**model.config)
    assert model.config == {**TINY, **ALL_ON}
    rebuilt.load_state_dict(model.state_dict())
    ids = token_ids()
    assert torch.equal(rebuilt.eval()(ids), model(ids))


# ---------------------------------------------------------------- each option's math


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"qk_norm": True},
        {"mlp": "relu2"},
        {"mlp": "geglu"},
        {"logit_softcap": 3.0},
        {"tie_embeddings": True},
        {"value_embeddings": True},
        {"value_embeddings": True, "num_layers": 2},
        {"embedding_norm": True},
        {"zero_init_output": True, "dropout": 0.2},  # in eval mode: no dropout
        {"pad_vocab_to_multiple": 48},
        {"pad_vocab_to_multiple": 48, "tie_embeddings": True},
        ALL_ON,
    ],
    ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()) or "plain",
)
@pytest.mark.parametrize("fused", [True, False])
def test_the_forward_pass_is_the_plain_pytorch_one(options, fused):
    model = jitter(build(**options)).eval()
    model.set_fast_attention(fused)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_the_softcap_bounds_the_logits():
    model = jitter(build(logit_softcap=2.0), scale=1.0)
    logits = model(token_ids())
    assert logits.abs().max() <= 2.0
    assert logits.abs().max() > 1.9  # the logits were large: the cap acted


def test_value_embeddings_go_to_every_other_layer_counting_from_the_last():
    for num_layers in (2, 3, 4, 5):
        model = build(value_embeddings=True, num_layers=num_layers)
        with_table = [i for i, block in enumerate(model.layers) if block.attn.value_embedding is not None]
        assert with_table == list(range(num_layers - 1, -1, -2))[::-1], num_layers
        for i in with_table:
            attn = model.layers[i].attn
            assert attn.value_embedding.weight.shape == (TINY["vocab_size"], TINY["d_model"])
            assert attn.value_gate.shape == () and attn.value_gate.item() == 0.5


def test_relu2_hidden_width_is_three_halves_of_d_ff_rounded_up():
    d = TINY["d_model"]
    for d_ff in (24, 25):
        relu2, swiglu = build(mlp="relu2", d_ff=d_ff), build(d_ff=d_ff)
        width = math.ceil(1.5 * d_ff)
        assert relu2.layers[0].ffn.w_in.weight.shape == (width, d)
        assert relu2.layers[0].ffn.w_out.weight.shape == (d, width)
        extra = TINY["num_layers"] * (2 * width * d - 3 * d_ff * d)
        assert relu2.num_parameters() == swiglu.num_parameters() + extra
    assert extra == TINY["num_layers"] * d  # odd d_ff: one more hidden unit's two vectors per layer


# ---------------------------------------------------------------- initialisation


@pytest.mark.parametrize("mlp", ["swiglu", "relu2", "geglu"])
def test_zero_init_output_zeroes_two_projections_and_leaves_every_other_draw(mlp):
    zeroed = build(seed=4, mlp=mlp, zero_init_output=True)
    after_zeroed = torch.rand(4)  # the generator's state after construction
    plain = build(seed=4, mlp=mlp)
    assert torch.equal(torch.rand(4), after_zeroed)
    down = "ffn.w_out.weight" if mlp == "relu2" else "ffn.w2.weight"
    zero_names = {
        f"layers.{i}.{name}" for i in range(TINY["num_layers"]) for name in ("attn.output_proj.weight", down)
    }
    plain_state = plain.state_dict()
    for name, tensor in zeroed.state_dict().items():
        if name in zero_names:
            assert not tensor.any(), name
            assert plain_state[name].abs().min() > 0, name  # drawn, then zeroed
        else:
            assert torch.equal(tensor, plain_state[name]), name
    assert len(zero_names) == 2 * TINY["num_layers"]


def test_the_tied_matrix_starts_as_the_untied_head_and_every_other_parameter_as_untied():
    tied, untied = build(seed=6, tie_embeddings=True), build(seed=6)
    tied_state, untied_state = tied.state_dict(), untied.state_dict()
    assert list(tied_state) == list(untied_state)
    assert torch.equal(tied_state["token_embeddings.weight"], untied_state["lm_head.weight"])
    for name, tensor in untied_state.items():
        if name != "token_embeddings.weight":
            assert torch.equal(tied_state[name], tensor), name
    # As a head, std-1 rows would give logits of std sqrt(d_model); the shared matrix gives small ones.
    assert tied(token_ids()).std() < 1.0


def test_the_tied_head_is_one_parameter_trained_by_both_uses():
    model = jitter(build(tie_embeddings=True))
    assert model.lm_head.weight is model.token_embeddings.weight
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "token_embeddings.weight" in names
    V, d = TINY["vocab_size"], TINY["d_model"]
    assert model.num_parameters() == build().num_parameters() - V * d
    ids = token_ids(seq_len=TINY["context_length"] + 1)
    x, y = ids[:, :-1], ids[:, 1:]
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    # The same forward with the two uses as two separate tensors: the shared gradient is their sum.
    weights = {name: t.clone().requires_grad_() for name, t in model.state_dict().items()}
    as_input, as_head = weights["token_embeddings.weight"], weights["lm_head.weight"]
    F.cross_entropy(reference_logits(model, x, weights).flatten(0, 1), y.flatten()).backward()
    assert as_input.grad.abs().sum() > 0 and as_head.grad.abs().sum() > 0
    torch.testing.assert_close(model.lm_head.weight.grad, as_input.grad + as_head.grad)


def test_a_tied_state_dict_loads_into_a_model_of_the_same_config(tmp_path):
    model = jitter(build(tie_embeddings=True)).eval()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    rebuilt = Transformer(**model.config)
    rebuilt.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
    assert rebuilt.lm_head.weight is rebuilt.token_embeddings.weight
    ids = token_ids()
    assert torch.equal(rebuilt.eval()(ids), model(ids))


# ---------------------------------------------------------------- the KV cache


def option_combinations() -> list[dict]:
    choices = dict(
        qk_norm=[False, True],
        mlp=["swiglu", "relu2"],
        logit_softcap=[None, 3.0],
        zero_init_output=[False, True],
        tie_embeddings=[False, True],
        value_embeddings=[False, True],
        dropout=[0.0, 0.2],
        embedding_norm=[False, True],
    )
    return [dict(zip(choices, values, strict=True)) for values in itertools.product(*choices.values())]


def test_the_kv_cache_gives_the_full_forward_with_every_combination_of_options():
    small = dict(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=16)
    ids = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(2))
    combinations = option_combinations()
    assert len(combinations) == 2**8
    with torch.no_grad():
        for options in combinations:
            torch.manual_seed(0)
            model = jitter(Transformer(**small, **options)).eval()
            full = model(ids)
            cache = model.new_kv_cache(batch_size=2)
            pieces = [model(ids[:, a:b], kv_cache=cache) for a, b in ((0, 3), (3, 4), (4, 5), (5, 8))]
            torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5, msg=str(options))


def test_the_reference_attention_path_with_a_cache_gives_the_full_forward_with_every_option():
    model = jitter(build(**ALL_ON)).eval()
    model.set_fast_attention(False)
    ids = token_ids()
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(batch_size=2)
        pieces = [model(ids[:, a:b], kv_cache=cache) for a, b in ((0, 7), (7, 8), (8, 16))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- dropout


@pytest.mark.parametrize("fused", [True, False])
def test_dropout_in_training_is_the_plain_pytorch_dropout_of_the_same_generator_state(fused):
    model = jitter(build(dropout=0.3, value_embeddings=True, qk_norm=True)).train()
    model.set_fast_attention(fused)
    ids = token_ids()
    torch.manual_seed(11)
    logits = model(ids)
    torch.manual_seed(11)
    expected = reference_logits(model, ids, dropout=0.3, fused=fused)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, reference_logits(model, ids), atol=1e-3)  # dropout acted


def test_dropout_differs_run_to_run_in_training_and_is_off_in_eval():
    model = jitter(build(dropout=0.2)).train()
    ids = token_ids()
    first, second = model(ids), model(ids)
    assert not torch.allclose(first, second, atol=1e-3)
    model.eval()
    without = build(dropout=0.0).eval()
    without.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(ids), model(ids))
        assert torch.equal(model(ids), without(ids))
        model.set_fast_attention(False)
        without.set_fast_attention(False)
        assert torch.equal(model(ids), without(ids))


# ---------------------------------------------------------------- compile and autocast


def test_the_forward_with_every_option_compiles_as_one_graph():
    """No option adds a branch the compiler cannot see through (fullgraph: a graph break is an error)."""
    model = jitter(build(**ALL_ON)).eval()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    ids = token_ids()
    torch.testing.assert_close(compiled(ids), model(ids))


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_logits_and_gradients_with_every_option():
    eager = jitter(build(**ALL_ON)).eval()  # eval: the dropout masks of eager and compiled code differ
    compiled = Transformer(**eager.config)
    compiled.load_state_dict(eager.state_dict())
    compiled.eval()
    for block in compiled.layers:
        block.compile()
    ids = token_ids()
    for model in (eager, compiled):
        model(ids).square().mean().backward()
    torch.testing.assert_close(compiled(ids), eager(ids), rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bfloat16_autocast_runs_every_option_close_to_float32():
    model = jitter(build(**ALL_ON))
    ids = token_ids(seq_len=TINY["context_length"] + 1)
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())  # training: dropout on
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    model.eval()
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x)
        assert low.dtype == torch.bfloat16
        torch.testing.assert_close(low.float(), model(x), rtol=0.05, atol=0.05)


# ---------------------------------------------------------------- refused values


REFUSED = [
    ("mlp", "gelu", r"is not one of \['swiglu', 'relu2', 'geglu'\]"),
    ("logit_softcap", 0.0, "> 0"),
    ("logit_softcap", -5.0, "> 0"),
    ("dropout", 1.0, "1"),
    ("dropout", -0.1, "0"),
    ("pad_vocab_to_multiple", 0, ">= 1"),
]


@pytest.mark.parametrize(("key", "value", "why"), REFUSED)
def test_a_refused_value_names_its_key_in_the_config_and_the_constructor(key, value, why):
    with pytest.raises(ConfigError, match=rf"^model\.{key}: .*{why}"):
        from_dict({"model": {key: value}})
    with pytest.raises(ValueError, match=rf"^{key}: .*{why}"):
        build(**{key: value})


def test_value_embeddings_need_two_layers():
    with pytest.raises(ConfigError, match=r"^model\.value_embeddings: needs model\.num_layers >= 2"):
        from_dict({"model": {"value_embeddings": True, "num_layers": 1}})
    with pytest.raises(ValueError, match=r"^value_embeddings: needs num_layers >= 2 .*got 1$"):
        build(value_embeddings=True, num_layers=1)
    from_dict({"model": {"value_embeddings": True, "num_layers": 2}})


def test_each_option_is_declared_once_for_the_config_and_the_model():
    # The config's model section is the sizes plus ModelOptions' own fields (the same declarations),
    # and a model built from the default config has every option at the config's default.
    option_fields = {f.name: f for f in dataclasses.fields(ModelOptions)}
    config_fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    assert all(config_fields[name] is declared for name, declared in option_fields.items())
    model = build()
    assert dataclasses.asdict(model.options) == {name: getattr(ModelConfig(), name) for name in option_fields}
    assert set(Transformer.CONFIG_KEYS) == {"vocab_size", *config_fields}
    assert set(build(**ALL_ON).config) == set(Transformer.CONFIG_KEYS)  # every option on is recorded
    # The one object reaches every block and its attention.
    model = build(qk_norm=True, dropout=0.25)
    assert model.options.qk_norm and model.options.dropout == 0.25
    for block in model.layers:
        assert block.attn.q_norm is not None and block.attn.dropout == 0.25 and block.dropout.p == 0.25
    with pytest.raises(TypeError, match="unknown option 'qk_norms'"):
        build(qk_norms=True)


def test_a_tied_head_has_no_learning_rate_of_its_own():
    raw = {"model": {"tie_embeddings": True}, "train": {"optimizer": "muon", "head_lr": 0.01}}
    with pytest.raises(ConfigError, match=r"^train\.head_lr: with model\.tie_embeddings"):
        from_dict(raw)
    raw["train"]["head_lr"] = None
    from_dict(raw)


# ---------------------------------------------------------------- the padded vocabulary


def test_padding_rows_never_reach_the_logits_the_loss_or_their_gradients():
    padded = jitter(build(pad_vocab_to_multiple=48))
    V = TINY["vocab_size"]
    assert padded.lm_head.weight.shape[0] == padded.token_embeddings.weight.shape[0] == 96
    with torch.no_grad():  # rows no token looks up and no prediction reads: any value at all
        padded.lm_head.weight[V:] = 1e4
        padded.token_embeddings.weight[V:] = float("nan")
    plain = build()
    plain.load_state_dict(
        {
            name: t[:V] if name in ("lm_head.weight", "token_embeddings.weight") else t
            for name, t in padded.state_dict().items()
        }
    )
    ids, targets = token_ids(seed=5), token_ids(seed=6)
    logits = padded(ids)
    assert logits.shape == (*ids.shape, V)
    torch.testing.assert_close(logits, plain(ids), rtol=1e-6, atol=1e-6)
    loss = padded(ids, targets=targets)
    torch.testing.assert_close(loss, F.cross_entropy(plain(ids).reshape(-1, V), targets.reshape(-1)))
    loss.backward()
    assert torch.equal(padded.lm_head.weight.grad[V:], torch.zeros(96 - V, TINY["d_model"]))
    assert torch.equal(padded.token_embeddings.weight.grad[V:], torch.zeros(96 - V, TINY["d_model"]))
    assert padded.lm_head.weight.grad[:V].abs().sum() > 0


def test_sampling_from_a_padded_model_gives_only_tokens_of_the_vocabulary():
    from tinylm.generating import generate, generate_reference

    model = jitter(build(pad_vocab_to_multiple=48)).eval()
    with torch.no_grad():
        model.lm_head.weight[TINY["vocab_size"] :] = 100.0  # would win every draw if it were a logit
    for sampler in (generate, generate_reference):
        generator = torch.Generator().manual_seed(0)
        ids = sampler(model, [1, 2, 3], 40, TINY["context_length"], generator=generator)
        assert len(ids) == 40 and max(ids) < TINY["vocab_size"]


def test_the_flops_count_the_padded_head_that_is_multiplied():
    from tinylm.flops import matmul_weights

    padded, plain = build(pad_vocab_to_multiple=48), build()
    matmuls = {
        name: model.lm_head.weight.numel()
        + sum(p.numel() for n, p in model.layers.named_parameters() if p.dim() == 2)
        for name, model in (("padded", padded), ("plain", plain))
    }
    assert matmul_weights(padded.config) == matmuls["padded"] == matmuls["plain"] + 32 * TINY["d_model"]
    assert matmul_weights(plain.config) == matmuls["plain"]
