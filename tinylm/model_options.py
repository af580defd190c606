"""The Transformer's recipe options, each declared once: its default, its explanation and its rules.

`ModelOptions` is that one declaration. The Transformer takes its fields as keywords (the keyword
API the reference suites use) and hands the one object to its blocks and their attention; the
config's `model:` section is the model's sizes plus these fields (`ModelConfig` in
tinylm/config/sections.py extends it), so config/config.yaml's comments, config/README.md's table
and the config's range checks come from here too.

The options come from recent small-model pretraining work (the nanoGPT speedrun, nanochat, OLMo 2,
Gemma 2). At their defaults the model is the plain one, parameter for parameter and draw for draw.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tinylm.keys import ConfigError, check_value, key

MLP_CHOICES = ("swiglu", "relu2", "geglu")


@dataclass(frozen=True)
class ModelOptions:
    """The recipe options of the Transformer (see each key's help); all off by default."""

    qk_norm: bool = key(
        False,
        help="QK-norm: RMSNorm of each head's queries and keys before RoPE (OLMo 2, Qwen3, nanochat)",
        more="Its learned gains have the head size `d_model / num_heads`. Exported as a Qwen3 folder",
    )
    mlp: str = key(
        "swiglu",
        choices=list(MLP_CHOICES),
        help="`swiglu` | `relu2` | `geglu`: the MLP of each block",
        more="`geglu`: SwiGLU with GELU for SiLU, w2(gelu(w1 x) * w3 x) (Shazeer 2020), the same "
        "parameters; exported as a Llama folder with `hidden_act: gelu`. "
        "`relu2`: w_out(relu(w_in x)^2) (Primer, So et al. 2021; the nanoGPT speedrun, nanochat) of "
        "hidden width 3/2 `d_ff` (rounded up): two matrices with the parameters and FLOPs of SwiGLU's "
        "three at `d_ff`. A Hugging Face Llama folder cannot hold it",
    )
    logit_softcap: float | None = key(
        None,
        lo=0.0,
        lo_open=True,
        help="cap c > 0: logits = c * tanh(logits / c) (Gemma 2; nanochat uses 15); `null` = none",
        more="The loss, evaluation and sampling all see the capped logits. A Hugging Face Llama folder "
        "cannot hold it",
    )
    zero_init_output: bool = key(
        False,
        help="attention output and MLP down projections start at zero (nanoGPT speedrun, nanochat)",
        more="They are drawn as usual, then zeroed: every other parameter starts as without the option",
    )
    tie_embeddings: bool = key(
        False,
        help="the output head is the token embedding matrix (Press & Wolf 2017)",
        more="One parameter, which starts with the head's initialisation, std sqrt(2 / (d_model + "
        "vocab_size)), not the embedding's std 1 (that would give huge initial logits); `train.head_lr` "
        "must be null. Exported with `tie_word_embeddings: true`",
    )
    value_embeddings: bool = key(
        False,
        help="every other layer (the last one included) adds a table of the token ids to its values",
        more="(nanoGPT speedrun, nanochat): v <- v + g * table[ids], each such layer with its own "
        "`vocab_size x d_model` table and learned scalar g (starts at 0.5). Needs `num_layers` >= 2. A "
        "Hugging Face Llama folder cannot hold it",
    )
    dropout: float = key(
        0.0,
        lo=0.0,
        hi=1.0,
        hi_open=True,
        help="dropout on the attention probabilities and each residual branch, in training only",
        more="(0 <= x < 1). The masks come from each rank's generator (seeded `seed + rank`), so with "
        "dropout another world size, accumulation or `train.compile` draws other masks and reaches "
        "other weights; a resume at the same world size stays bit-identical",
    )
    embedding_norm: bool = key(
        False,
        help="RMSNorm (learned gain) of the token embeddings before the first block (nanochat)",
        more="Exported (in float32) folded into the embedding table: a lookup of normalised rows",
    )

    pad_vocab_to_multiple: int = key(
        1,
        lo=1,
        left_out_at=1,
        help="the embedding and head rows padded to a multiple of this (the GPU recipes set 128); 1 = none",
        more="A head of 10,000 rows is an unaligned matmul on a GPU; padded to 10,112 it is not. The "
        "padding rows are never looked up and their logits are cut off before the loss, evaluation, "
        "sampling and export see them, so the model predicts exactly `tokenizer.vocab_size` tokens. "
        "Padding changes the weights' shapes (and the head's initial std), so it is part of the run",
    )

    def padded_vocab_size(self, vocab_size: int) -> int:
        """The rows of the embedding table and the output head (see `padded_vocab_size`)."""
        return padded_vocab_size(vocab_size, self.pad_vocab_to_multiple)

    def check(self, num_layers: int, prefix: str = "") -> None:
        """Refuse values the model cannot be built with: each key against its declaration, and the
        rules between keys. Messages name the key, after `prefix` (the config says "model.")."""
        for declared in dataclasses.fields(ModelOptions):
            check_value(getattr(self, declared.name), declared, prefix + declared.name)
        if self.value_embeddings and num_layers < 2:
            raise ConfigError(
                f"{prefix}value_embeddings: needs {prefix}num_layers >= 2 (every other layer gets a "
                f"table, the last one included), got {num_layers}"
            )

    def recorded(self) -> dict:
        """The options as a checkpoint's model config records them: every field, but one declared
        `left_out_at` while at that value (a capability off), so that the checkpoints of models
        that do not use it are the same bytes as before it existed. A missing key means its default."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get("left_out_at") is None or getattr(self, f.name) != f.metadata["left_out_at"][0]
        }

    def has_value_embeddings(self, layer: int, num_layers: int) -> bool:
        """Whether block `layer` of `num_layers` gets a value-embedding table: every other block,
        the last one included (as nanochat chooses)."""
        return self.value_embeddings and layer % 2 == (num_layers - 1) % 2


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """vocab_size rounded up to a multiple of `multiple` (model.pad_vocab_to_multiple)."""
    return -(-vocab_size // multiple) * multiple


NO_OPTIONS = ModelOptions()  # every option off: the plain model
OPTION_NAMES = tuple(declared.name for declared in dataclasses.fields(ModelOptions))
