"""Hugging Face export: transformers loads the folder with no code of ours and computes what we compute.

The reference is transformers itself (AutoTokenizer, AutoModelForCausalLM, LlamaForCausalLM.generate and
its RoPE), loaded only from the exported folder, never from the hub.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may reach the hub

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MODEL, SPECIALS, mixed_text
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tinylm.checkpoint import CheckpointError, Manifest, load_model
from tinylm.export import ExportError, export_hf, interleaved_to_halves
from tinylm.generating import generate, generate_reference
from tinylm.model import RotaryEmbedding, Transformer
from tinylm.pretrain import state as state_lib
from tinylm.pretrain.publish import publish as publish_run
from tinylm.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
}


@pytest.fixture(scope="module")
def exported(tiny_lm, tmp_path_factory) -> Path:
    return export_hf(tiny_lm["checkpoints"], tiny_lm["tokenizer"], tmp_path_factory.mktemp("export") / "hf")


@pytest.fixture(scope="module")
def ours(tiny_lm):
    model, _ = load_model(tiny_lm["checkpoints"])
    return model.eval(), Tokenizer.load(tiny_lm["tokenizer"])


@pytest.fixture(scope="module")
def theirs(exported):
    return AutoModelForCausalLM.from_pretrained(exported).eval(), AutoTokenizer.from_pretrained(exported)


def test_the_folder_is_a_llama_with_our_sizes_and_token_ids(exported, ours, theirs):
    model, tokenizer = ours
    hf_model, hf_tokenizer = theirs
    assert {p.name for p in exported.iterdir()} == FILES
    assert isinstance(hf_model, LlamaForCausalLM)
    c, hc = model.config, hf_model.config
    assert (
        hc.vocab_size,
        hc.hidden_size,
        hc.intermediate_size,
        hc.num_hidden_layers,
        hc.num_attention_heads,
        hc.num_key_value_heads,
        hc.max_position_embeddings,
    ) == (
        c["vocab_size"],
        c["d_model"],
        c["d_ff"],
        c["num_layers"],
        c["num_heads"],
        c["num_heads"],
        c["context_length"],
    )
    assert not hc.tie_word_embeddings and hf_model.dtype == torch.float32
    # eps is too small to show in the logits test: check that transformers uses ours
    assert {m.variance_epsilon for m in hf_model.modules() if hasattr(m, "variance_epsilon")} == {
        model.ln_final.eps
    }
    eot = tokenizer.special_ids["<|endoftext|>"]
    assert hc.bos_token_id == hc.eos_token_id == hf_tokenizer.eos_token_id == hf_tokenizer.bos_token_id == eot
    assert hf_model.generation_config.eos_token_id == eot
    assert len(hf_tokenizer) == len(tokenizer.vocab)


def test_the_tokenizer_gives_our_ids_and_decodes_back(ours, theirs):
    _, tokenizer = ours
    _, hf_tokenizer = theirs
    rng = random.Random(1)
    texts = [mixed_text(rng, n) for n in (5, 50, 400)]  # words, other scripts, emoji, whitespace runs
    texts += [
        "",
        " ",
        "  \n\n\t  x  ",
        "<|endoftext|><|endoftext|>",
        "a<|pad|>b<|endoftext|> c",
        "it's 'Twas THEY'LL",
        "\u00a0\u3000\u2028\x1c\x85",
        "👨‍👩‍👧🇫🇷❤️e\u0301",
        "١٢٣ Ⅻ ½ ǅ",
        "<|endoftext",
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert hf_tokenizer(text)["input_ids"] == ids, text
        assert hf_tokenizer.decode(ids) == text
    assert {t: hf_tokenizer.convert_tokens_to_ids(t) for t in SPECIALS} == tokenizer.special_ids


def test_logits_equal_ours_within_1e4_up_to_a_full_context(ours, theirs):
    model, _ = ours
    hf_model, _ = theirs
    generator = torch.Generator().manual_seed(0)
    T = model.context_length
    batches = [torch.randint(model.vocab_size, (1, n), generator=generator) for n in (1, 9, 40, T)]
    batches.append(torch.randint(model.vocab_size, (3, T), generator=generator))
    with torch.no_grad():
        for ids in batches:
            expected, actual = model(ids), hf_model(ids).logits
            assert (actual - expected).abs().max() <= 1e-4, ids.shape
    assert expected.std() > 1.0  # the trained model's logits are far from uniform


def test_greedy_generation_gives_the_same_50_ids(ours, theirs):
    model, tokenizer = ours
    hf_model, _ = theirs
    eot = tokenizer.special_ids["<|endoftext|>"]
    prompt = tokenizer.encode("the queen spoke 東京 ")
    assert len(prompt) + 50 <= model.context_length  # transformers' generate does not crop the context
    ids = generate(model, prompt, 50, model.context_length, 0.0, 1.0, eot)
    assert ids == generate_reference(model, prompt, 50, model.context_length, 0.0, 1.0, eot)
    assert len(ids) == 50 and eot not in ids  # both would stop after <|endoftext|>; neither drew it
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=50, do_sample=False)
    assert out[0, len(prompt) :].tolist() == ids


def test_rope_rows_permuted_make_llamas_rotate_half_of_our_interleaved_pairs():
    num_heads, d_head, T = 2, 8, 11
    config = LlamaConfig(
        hidden_size=num_heads * d_head,
        num_attention_heads=num_heads,
        head_dim=d_head,
        rope_theta=300.0,
        max_position_embeddings=T,
    )
    x = torch.randn(1, num_heads, T, d_head)
    # interleaved_to_halves reorders rows of a projection; rows of the identity give the feature order
    order = interleaved_to_halves(torch.eye(d_head), 1).argmax(dim=1)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(T)[None])
    hf_rotated, _ = apply_rotary_pos_emb(x[..., order], x[..., order], cos, sin)
    ours_rotated = RotaryEmbedding(300.0, d_head, T)(x)
    torch.testing.assert_close(hf_rotated, ours_rotated[..., order], rtol=0, atol=1e-5)


def test_the_cli_export_is_byte_identical_and_replaces_an_old_folder(tiny_lm, exported, tmp_path):
    """A second export, by the CLI in another process, writes the same bytes."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    proc = export_cli(tiny_lm["checkpoints"], tiny_lm["tokenizer"], out)
    assert proc.returncode == 0, proc.stderr
    assert f"[export] step {tiny_lm['step']} -> {out} (float32)" in proc.stderr
    assert {p.name for p in out.iterdir()} == FILES
    for name in FILES:
        assert (out / name).read_bytes() == (exported / name).read_bytes(), name
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left


def export_cli(checkpoints: Path, tokenizer: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tinylm",
            "export",
            "--tokenizer",
            str(tokenizer),
            "--checkpoint-dir",
            str(checkpoints),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_bfloat16_export_loads_as_bfloat16_and_computes_our_rounded_model(tiny_lm, ours, tmp_path):
    out = export_hf(tiny_lm["checkpoints"], tiny_lm["tokenizer"], tmp_path / "hf", dtype="bfloat16")
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model, _ = ours
    rounded = Transformer(**model.config)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    ids = torch.randint(
        model.vocab_size, (2, model.context_length), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert (hf_model(ids).logits - rounded(ids)).abs().max() <= 1e-4
        assert (rounded(ids) - model(ids)).abs().max() > 1e-3  # the rounding was real


# ------------------------------------------------------------------------------------------------
# what cannot be exported: a clear error, and nothing written


def publish(folder: Path, payload: dict, step: int = 5) -> Path:
    state_lib.commit(
        folder / "state", step, {"optimizer": {}, "iteration": step, **payload}, Manifest(world_size=1)
    )
    publish_run(folder / "state", folder / "ckpt")
    return folder / "ckpt"


def assert_nothing_written(out: Path) -> None:
    assert (out / "old.txt").read_text() == "keep me"  # an earlier folder at the output is untouched
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


@pytest.fixture
def out(tmp_path) -> Path:
    out = tmp_path / "results" / "hf"
    out.mkdir(parents=True)
    (out / "old.txt").write_text("keep me")
    return out


def test_a_corrupt_checkpoint_is_refused(tiny_lm, tmp_path, out):
    model, _ = load_model(tiny_lm["checkpoints"])
    ckpt = publish(tmp_path, {"model": model.state_dict(), "model_config": model.config})
    path = ckpt / "step_5.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.unlink()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{path}: the bytes at offset \d+ do not match the sha256"):
        export_hf(ckpt, tiny_lm["tokenizer"], out)
    assert_nothing_written(out)


def test_a_checkpoint_whose_weights_do_not_fit_its_config_is_refused(tiny_lm, tmp_path, out):
    model, _ = load_model(tiny_lm["checkpoints"])
    weights = model.state_dict()
    weights["layers.0.attn.qkv.weight"] = weights.pop("layers.0.attn.qkv_proj.weight")
    ckpt = publish(tmp_path, {"model": weights, "model_config": model.config})
    with pytest.raises(
        CheckpointError,
        match=r"step_5.pt: .*missing \['layers.0.attn.qkv_proj.weight'\], "
        r"unexpected \['layers.0.attn.qkv.weight'\]",
    ):
        export_hf(ckpt, tiny_lm["tokenizer"], out)
    assert_nothing_written(out)


def test_an_odd_head_dimension_is_refused(tiny_lm, tmp_path, out):
    config = {**load_model(tiny_lm["checkpoints"])[0].config, "d_model": 18, "num_heads": 2}  # d_head 9
    ckpt = publish(tmp_path, {"model": {}, "model_config": config})
    with pytest.raises(CheckpointError, match="step_5.pt: model_config .*even head dimension, got d_k=9"):
        export_hf(ckpt, tiny_lm["tokenizer"], out)
    assert_nothing_written(out)


def test_a_special_token_with_the_bytes_of_an_ordinary_one_cannot_be_expressed(tmp_path, out):
    """A Hugging Face vocabulary maps each token string to one id; ours may hold "\\n" twice."""
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"<|endoftext|>", 257: b"\n"}
    tokenizer = Tokenizer(vocab, [], ["<|endoftext|>", "\n"])
    tokenizer.save(tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    model = Transformer(vocab_size=258, context_length=8, d_model=8, num_layers=1, num_heads=2, d_ff=16)
    ckpt = publish(tmp_path, {"model": model.state_dict(), "model_config": model.config})
    with pytest.raises(ExportError, match=r"tokens 10 and 257 are both b'\\n'.* cannot be exported"):
        export_hf(ckpt, tmp_path / "tokenizer.json", out)
    assert_nothing_written(out)


def test_the_cli_refuses_a_model_of_another_vocabulary(tiny_lm, tmp_path, out):
    torch.manual_seed(0)
    model = Transformer(vocab_size=400, context_length=8, d_model=8, num_layers=1, num_heads=2, d_ff=16)
    ckpt = publish(tmp_path, {"model": model.state_dict(), "model_config": model.config})
    proc = export_cli(ckpt, tiny_lm["tokenizer"], out)
    assert proc.returncode == 1
    assert (
        "tinylm export: error: " in proc.stderr
        and "model vocabulary 400 differs from the tokenizer's 320" in proc.stderr
        and "Traceback" not in proc.stderr
    ), proc.stderr
    assert_nothing_written(out)


# ------------------------------------------------------------------------------------------------
# model options: held by the folder, or refused naming the key


def option_model(**options) -> Transformer:
    """A model of the tiny tokenizer's vocabulary with `options`, every weight moved off its
    initialisation (RMSNorm gains off 1, so a q_norm gain in the wrong order would show)."""
    torch.manual_seed(0)
    model = Transformer(**{**MODEL, **options})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model


EXPORTABLE = [
    {"tie_embeddings": True},
    {"mlp": "geglu"},
    {"qk_norm": True},
    {"embedding_norm": True},
    {"pad_vocab_to_multiple": 128},
    {
        "tie_embeddings": True,
        "pad_vocab_to_multiple": 128,
        "embedding_norm": True,
        "qk_norm": True,
        "zero_init_output": True,
        "dropout": 0.1,
    },
]


@pytest.mark.parametrize("options", EXPORTABLE, ids=lambda options: ",".join(options))
def test_a_model_with_options_exports_and_transformers_computes_our_logits(tiny_lm, tmp_path, options):
    model = option_model(**options)
    ckpt = publish(tmp_path, {"model": model.state_dict(), "model_config": model.config})
    out = export_hf(ckpt, tiny_lm["tokenizer"], tmp_path / "hf")
    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model) is (Qwen3ForCausalLM if options.get("qk_norm") else LlamaForCausalLM)
    # The folded embedding RMSNorm makes the input table differ from the head: then untied.
    tied = options.get("tie_embeddings", False) and not options.get("embedding_norm", False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is tied
    assert (hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()) is tied
    model.eval()
    ids = torch.randint(
        model.vocab_size, (2, model.context_length), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        expected = model(ids)
        assert (hf_model(ids).logits - expected).abs().max() <= 1e-4
    assert expected.std() > 0.1  # far from uniform: the weights matter


@pytest.mark.parametrize(
    ("key", "value"), [("mlp", "relu2"), ("logit_softcap", 15.0), ("value_embeddings", True)]
)
def test_an_option_a_llama_folder_cannot_hold_is_refused_naming_the_key(tiny_lm, tmp_path, out, key, value):
    model = option_model(**{key: value})
    ckpt = publish(tmp_path, {"model": model.state_dict(), "model_config": model.config})
    with pytest.raises(
        ExportError, match=rf"^model\.{key}: a Llama folder cannot hold it \(.*\); export a model without it$"
    ):
        export_hf(ckpt, tiny_lm["tokenizer"], out)
    assert_nothing_written(out)


def test_the_folded_embedding_norm_is_exported_in_float32_only(tiny_lm, tmp_path, out):
    model = option_model(embedding_norm=True)
    ckpt = publish(tmp_path, {"model": model.state_dict(), "model_config": model.config})
    with pytest.raises(ExportError, match=r"^model\.embedding_norm: .* export with dtype float32$"):
        export_hf(ckpt, tiny_lm["tokenizer"], out, dtype="bfloat16")
    assert_nothing_written(out)
