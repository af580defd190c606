"""Hugging Face export: a published checkpoint and its tokenizer as a transformers Llama folder.

    results/hf/
      config.json              LlamaForCausalLM (Qwen3ForCausalLM with model.qk_norm): sizes,
                               rope_theta, rms_norm_eps, tie_word_embeddings, token ids, dtype
      model.safetensors        the weights under Llama's names (qkv split, q and k rows permuted)
      tokenizer.json           byte-level BPE: our vocabulary and merges, the GPT-2 regex, our
                               special tokens as added tokens
      tokenizer_config.json    PreTrainedTokenizerFast; no BOS added, no clean-up of spaces
      special_tokens_map.json
      generation_config.json   the <|endoftext|> id as bos, eos and pad

`AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)` load it
with no code of ours. The architectures are the same (pre-norm RMSNorm, RoPE, SwiGLU, no biases);
two layouts differ:

- our fused qkv_proj (q, k and v weights stacked) becomes q_proj, k_proj and v_proj;
- RoPE pairs: ours rotates consecutive features (x[2i], x[2i+1]) of a head by the angle
  p * theta^(-2i / d_head); Llama rotates (x[i], x[i + d_head / 2]) by that same angle. Reordering
  the rows of each head of q_proj and k_proj (new row i = old row 2i, new row d_head / 2 + i = old
  row 2i + 1) turns one into the other; q . k is unchanged because q and k are reordered alike.

The model options (tinylm.model.Transformer) map as follows:

- qk_norm: a Qwen3 folder, which is Llama with an RMSNorm of each head's queries and keys before
  RoPE (q_norm, k_norm); their gains are reordered like the rows of q_proj and k_proj;
- tie_embeddings: `tie_word_embeddings: true` (and no lm_head.weight in the file);
- embedding_norm: folded into the embedding table, since the RMSNorm of a looked-up row is the
  lookup of the normalised row (with tie_embeddings the folder is then untied: the head keeps the
  plain matrix); float32 only, as a rounded normalised table is not our model with rounded weights;
- zero_init_output and dropout: nothing (an initialisation; off at inference);
- pad_vocab_to_multiple: the padding rows of the embedding table and the head are left out;
- mlp geglu: `hidden_act: gelu` (Llama's gated MLP with another activation);
- mlp relu2, logit_softcap and value_embeddings have no place in a Llama folder: refused.

The <|endoftext|> token, which starts every document after the first, serves as BOS and EOS.

The folder is written under a temporary name, loaded back with transformers and checked (its
tokenizer gives our ids on a probe text, its logits are ours on a full context), and only then
renamed into place: a model or tokenizer that cannot be expressed, or a check that fails, is an
ExportError and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from tinylm.checkpoint import load_model
from tinylm.config import END_OF_TEXT
from tinylm.io import atomic_dir
from tinylm.model import Transformer
from tinylm.tokenizer import Tokenizer
from tinylm.tokenizer.files import bytes_to_text

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The export check: the tokenizer must give our ids on this text (with every special token added),
# and the logits must match ours within this tolerance, relative to the largest logit (and at least
# absolute). A wrong layout is off by O(1).
PROBE_TEXT = "Hello, world!  It's 2024:\n\n\tnaïve café, 日本語, привет, 🙂👍🏽   spaces\r\n"
LOGITS_RTOL = 1e-3
# Model options a Llama (or Qwen3) folder holds only at some values: the values it holds (the first
# is the option's default).
EXPORTABLE = {"mlp": ("swiglu", "geglu"), "logit_softcap": (None,), "value_embeddings": (False,)}
# The gated MLP's activation, Llama's `hidden_act` (transformers' ACT2FN: "gelu" is the exact GELU).
HIDDEN_ACT = {"swiglu": "silu", "geglu": "gelu"}


class ExportError(ValueError):
    """The model or tokenizer cannot be written as a Hugging Face Llama folder; the message says why."""


def export_hf(
    checkpoint_dir: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    output_dir: str | os.PathLike,
    step: int | None = None,
    dtype: str = "float32",
) -> Path:
    """Write published checkpoint `step` (default: the newest) and the tokenizer as a Llama folder.

    `dtype` ("float32", "bfloat16" or "float16") is the dtype of the saved weights. Returns the
    folder. Needs the `hf` extra (safetensors, transformers).
    """
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    tokenizer = Tokenizer.load(tokenizer_path)
    model, step = load_model(checkpoint_dir, step, tokenizer=tokenizer)
    model.eval()  # no dropout
    where = f"{Path(checkpoint_dir) / f'step_{step}.pt'} with {tokenizer_path}"
    if END_OF_TEXT not in tokenizer.special_ids:
        raise ExportError(f"{tokenizer_path}: has no {END_OF_TEXT} special token (bos and eos of the export)")
    tokenizer_json = hf_tokenizer_json(tokenizer, where)
    tensors = llama_state_dict(model, DTYPES[dtype])

    with atomic_dir(output_dir) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        for name, content in hf_configs(model, tokenizer, dtype).items():
            (tmp / name).write_text(
                json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )
        difference = check_with_transformers(tmp, model, tokenizer, DTYPES[dtype], where)
    print(
        f"[export] step {step} -> {output_dir} ({dtype}); transformers loads it: same token ids on the "
        f"probe text, logits within {difference:.1e} of ours on {model.context_length} positions",
        file=sys.stderr,
    )
    return Path(output_dir)


# ------------------------------------------------------------------------------------------------
# weights


def interleaved_to_halves(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a q or k projection [num_heads * d_head, d_in], reordered within each head from RoPE's
    consecutive pairs (2i, 2i + 1) to Llama's rotate-half pairs (i, i + d_head / 2)."""
    d_out, d_in = weight.shape
    d_head = d_out // num_heads
    return weight.view(num_heads, d_head // 2, 2, d_in).transpose(1, 2).reshape(d_out, d_in)


def check_exportable(config: dict[str, Any]) -> None:
    """Refuse a model config with an option that a Llama folder cannot hold, naming the key."""
    for key, held in EXPORTABLE.items():
        if config.get(key, held[0]) not in held:
            raise ExportError(
                f"model.{key}: a Llama folder cannot hold it ({config[key]!r}); export a model without it"
            )


def tied_in_folder(config: dict[str, Any]) -> bool:
    """Whether the folder ties its head to embed_tokens: tied models, unless the embedding RMSNorm
    is folded into embed_tokens (then the head keeps the plain matrix)."""
    return config["tie_embeddings"] and not config["embedding_norm"]


def llama_state_dict(model: Transformer, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our weights under LlamaForCausalLM's names and layout (Qwen3ForCausalLM's with qk_norm; see the
    module docstring), in `dtype`."""
    check_exportable(model.config)
    ours = model.state_dict()
    num_heads = model.config["num_heads"]
    vocab_size = model.vocab_size  # the padding rows (pad_vocab_to_multiple) are left out
    embeddings = ours["token_embeddings.weight"][:vocab_size]
    if model.embedding_norm is not None:
        if dtype != torch.float32:  # rounding the normalised table is not rounding our weights
            raise ExportError(
                "model.embedding_norm: folded into the embedding table it is exact in float32 only; "
                "export with dtype float32"
            )
        with torch.no_grad():
            embeddings = model.embedding_norm(embeddings)  # each row normalised as the lookup would be
    out = {"model.embed_tokens.weight": embeddings}
    for i in range(model.config["num_layers"]):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = ours[src + "attn.qkv_proj.weight"].chunk(3, dim=0)
        out[dst + "self_attn.q_proj.weight"] = interleaved_to_halves(q, num_heads)
        out[dst + "self_attn.k_proj.weight"] = interleaved_to_halves(k, num_heads)
        out[dst + "self_attn.v_proj.weight"] = v
        out[dst + "self_attn.o_proj.weight"] = ours[src + "attn.output_proj.weight"]
        if model.config["qk_norm"]:  # a gain per feature of the head: reordered as q's and k's rows
            for name in ("q_norm", "k_norm"):
                gain = ours[src + f"attn.{name}.weight"]
                out[dst + f"self_attn.{name}.weight"] = interleaved_to_halves(gain[:, None], 1)[:, 0]
        out[dst + "mlp.gate_proj.weight"] = ours[src + "ffn.w1.weight"]  # silu(gate(x)) * up(x)
        out[dst + "mlp.up_proj.weight"] = ours[src + "ffn.w3.weight"]
        out[dst + "mlp.down_proj.weight"] = ours[src + "ffn.w2.weight"]
        out[dst + "input_layernorm.weight"] = ours[src + "ln1.weight"]
        out[dst + "post_attention_layernorm.weight"] = ours[src + "ln2.weight"]
    out["model.norm.weight"] = ours["ln_final.weight"]
    if not tied_in_folder(model.config):
        out["lm_head.weight"] = ours["lm_head.weight"][:vocab_size]
    # Own, contiguous storage for each (safetensors refuses views that share memory).
    return {
        name: t.detach().to(dtype).clone(memory_format=torch.contiguous_format) for name, t in out.items()
    }


# ------------------------------------------------------------------------------------------------
# tokenizer and config files


def hf_tokenizer_json(tokenizer: Tokenizer, where: str = "tokenizer") -> str:
    """tokenizer.json for Hugging Face `tokenizers`: the same ids as `tokenizer.encode` on any text.

    Token bytes are written with GPT-2's byte-to-character map (as ByteLevel expects). Each string
    of the BPE vocabulary names one id, so two tokens with the same bytes (e.g. a one-character
    special token) cannot be expressed; nor can ids that are not 0 .. len - 1.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    if sorted(tokenizer.vocab) != list(range(len(tokenizer.vocab))):
        raise ExportError(f"{where}: token ids are not 0 .. {len(tokenizer.vocab) - 1}")
    vocab: dict[str, int] = {}
    for i, token in sorted(tokenizer.vocab.items()):
        text = bytes_to_text(token)
        if text in vocab:
            raise ExportError(
                f"{where}: tokens {vocab[text]} and {i} are both {token!r}; a Hugging Face "
                f"vocabulary maps each token to one id, so this tokenizer cannot be exported"
            )
        vocab[text] = i
    # Our encoder uses the first merge of a repeated pair; Hugging Face's the last. Keep the first.
    merges = list(dict.fromkeys((bytes_to_text(a), bytes_to_text(c)) for a, c in tokenizer.merges))
    hf = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=False))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # the GPT-2 regex
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds no tokens
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokenizer.special_tokens])
    for token, i in tokenizer.special_ids.items():
        if hf.token_to_id(token) != i:  # the special token's bytes are also an ordinary token's
            raise ExportError(
                f"{where}: special token {token!r} (id {i}) cannot be expressed: Hugging Face "
                f"gives it id {hf.token_to_id(token)}"
            )
    return hf.to_str(pretty=True) + "\n"


def hf_configs(model: Transformer, tokenizer: Tokenizer, dtype: str) -> dict[str, dict[str, Any]]:
    """config.json, tokenizer_config.json, special_tokens_map.json and generation_config.json."""
    c = model.config
    eot_id = tokenizer.special_ids[END_OF_TEXT]
    others = [t for t in tokenizer.special_tokens if t != END_OF_TEXT]
    special = {
        "bos_token": END_OF_TEXT,
        "eos_token": END_OF_TEXT,
        **({"additional_special_tokens": others} if others else {}),
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c["vocab_size"],
        "hidden_size": c["d_model"],
        "intermediate_size": c["d_ff"],
        "num_hidden_layers": c["num_layers"],
        "num_attention_heads": c["num_heads"],
        "num_key_value_heads": c["num_heads"],
        "head_dim": c["d_model"] // c["num_heads"],
        "hidden_act": HIDDEN_ACT[c["mlp"]],
        "max_position_embeddings": c["context_length"],
        "rms_norm_eps": model.ln_final.eps,  # every RMSNorm of the model has this eps
        "rope_theta": c["rope_theta"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": tied_in_folder(c),
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if c["qk_norm"]:  # Qwen3: Llama with q_norm and k_norm, and no mlp_bias key
        del config["mlp_bias"]
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "clean_up_tokenization_spaces": False,  # decode gives back the text exactly
        "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids, which Llama refuses
        "model_max_length": c["context_length"],
    }
    generation = {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id}
    return {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special,
        "generation_config.json": generation,
    }


# ------------------------------------------------------------------------------------------------
# the check


def check_with_transformers(
    folder: Path, model: Transformer, tokenizer: Tokenizer, dtype: torch.dtype, where: str
) -> float:
    """Load `folder` with transformers; compare token ids and logits with ours; return the largest
    logit difference. The comparison runs in float32, with `model`'s weights rounded to `dtype`
    first (in place: the model is the exporter's own copy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    probe = PROBE_TEXT + "".join(f"{t} x{t}" for t in tokenizer.special_tokens)
    ours, theirs = tokenizer.encode(probe), hf_tokenizer(probe, verbose=False)["input_ids"]
    if ours != theirs:
        raise ExportError(f"{where}: the exported tokenizer gives {theirs} on {probe!r}, ours {ours}")

    hf_model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # the weights as saved
            p.copy_(p.to(dtype))
        ids = torch.randint(
            model.vocab_size, (1, model.context_length), generator=torch.Generator().manual_seed(0)
        )
        expected = model(ids)
        actual = hf_model(ids).logits
    difference = float((actual - expected).abs().max())
    if not difference <= LOGITS_RTOL * max(1.0, float(expected.abs().max())):
        raise ExportError(
            f"{where}: transformers' logits differ from ours by {difference:.3g}; "
            "the export does not reproduce the model"
        )
    return difference
