"""The decoder-only Transformer language model: token ids [B, T] -> next-token logits [B, T, vocab_size].

    token_embeddings -> num_layers x TransformerBlock -> ln_final (RMSNorm) -> lm_head (Linear)

Each block is pre-norm: x = x + attn(ln1(x)); x = x + ffn(ln2(x)). Positions enter only through RoPE
inside attention; the output head is not tied to the embeddings (unless tie_embeddings).

Recipe options from recent small-model pretraining work (the nanoGPT speedrun, nanochat, OLMo 2,
Gemma 2), each off by default; with all of them off the model is the one above, parameter for
parameter and draw for draw: qk_norm, mlp="relu2", logit_softcap, zero_init_output,
tie_embeddings, value_embeddings, dropout and embedding_norm. They are declared once, in
tinylm/model_options.py (`ModelOptions`: default, explanation, rules); the Transformer takes them
as keywords and its layers get the one object.

For generation, `forward(ids, kv_cache=cache)` runs only the new positions and keeps the keys and
values of the earlier ones in a KVCache (see kv_cache.py); training never passes one.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tinylm.model.attention import CausalSelfAttention
from tinylm.model.kv_cache import KVCache
from tinylm.model.layers import GEGLU, Embedding, Linear, ReLUSquared, RMSNorm, RotaryEmbedding, SwiGLU
from tinylm.model_options import NO_OPTIONS, OPTION_NAMES, ModelOptions
from tinylm.nn_utils import cross_entropy, softcap

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")  # see Transformer.set_activation_checkpointing


def relu2_hidden_width(d_ff: int) -> int:
    """The ReLU² MLP's hidden width for a SwiGLU width d_ff: 3/2 d_ff, rounded up.

    Two matrices of d_model x 3/2 d_ff hold as many parameters (and cost as many FLOPs) as SwiGLU's
    three of d_model x d_ff.
    """
    return (3 * d_ff + 1) // 2


class TransformerBlock(nn.Module):
    """Pre-norm block: causal self-attention then the MLP, each with a residual. [B, T, d_model] -> same.

    From `options` (ModelOptions): mlp, "swiglu" (SwiGLU of width d_ff), "geglu" (GEGLU, likewise)
    or "relu2" (ReLUSquared of width relu2_hidden_width(d_ff)); dropout on each residual branch's
    output (and on the attention probabilities), in training mode only; zero_init_output, the
    attention output projection and the MLP's down projection start at zero; qk_norm (see
    CausalSelfAttention). value_vocab_size: give this block value embeddings of that many rows (see
    CausalSelfAttention); forward then needs the token ids [B, T] of x's positions.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        rope: RotaryEmbedding | None = None,
        options: ModelOptions = NO_OPTIONS,
        value_vocab_size: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(
            d_model,
            num_heads,
            rope=rope,
            options=options,
            value_vocab_size=value_vocab_size,
            device=device,
            dtype=dtype,
        )
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        if options.mlp in ("swiglu", "geglu"):
            gated = SwiGLU if options.mlp == "swiglu" else GEGLU
            self.ffn = gated(d_model, d_ff, device=device, dtype=dtype)
            down_proj = self.ffn.w2
        else:
            self.ffn = ReLUSquared(d_model, relu2_hidden_width(d_ff), device=device, dtype=dtype)
            down_proj = self.ffn.w_out
        self.dropout = nn.Dropout(options.dropout)
        if options.zero_init_output:
            # Zero-init of the residual branches' last projections (nanoGPT speedrun, nanochat; muP).
            # Drawn as usual first, then zeroed: every other parameter starts as without the option.
            nn.init.zeros_(self.attn.output_proj.weight)
            nn.init.zeros_(down_proj.weight)

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: KVCache | None = None,
        layer: int = 0,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x), kv_cache, layer, token_ids))
        return x + self.dropout(self.ffn(self.ln2(x)))


class Transformer(nn.Module):
    """A decoder-only language model.

    forward: token ids [B, T] (any integer dtype, T <= context_length) -> logits [B, T, vocab_size],
    where logits[:, t] predict the token after position t from positions 0 .. t only. With
    `kv_cache` (from `new_kv_cache`), the ids are the positions after the kv_cache.length cached
    ones, and logits[:, t] see the cached positions too. With `targets` ([B, T] ids), forward
    returns their mean cross-entropy instead (a float32 scalar; `output_loss`).

    `model.config` holds the constructor's values, so `Transformer(**model.config)` rebuilds the same
    architecture (e.g. from a checkpoint). One RotaryEmbedding (cos/sin cache) is shared by all layers.

    Options, keywords that are the fields of ModelOptions (tinylm/model_options.py, where each is
    declared with its default and rules; `model.options` holds them), all off by default, and then
    the model is exactly the plain one:
    - qk_norm: RMSNorm (learned gain [d_head]) of each head's queries and keys, before RoPE;
    - mlp: "swiglu", "geglu" (gelu for silu, the same weights) or "relu2", the ReLU² MLP
      w_out(relu(w_in x)^2) of hidden width 3/2 d_ff (rounded up), as many parameters and FLOPs as
      the SwiGLU of width d_ff;
    - logit_softcap: logits = cap * tanh(logits / cap), so every consumer sees capped logits
      (computed in at least float32, returned in the logits' dtype); must be > 0 when set;
    - zero_init_output: each block's attention output projection and MLP down projection start at 0;
    - tie_embeddings: lm_head.weight is token_embeddings.weight, one [vocab_size, d_model] parameter.
      The shared matrix starts with the head's initialisation (truncated normal, std
      sqrt(2 / (d_model + vocab_size)), about GPT-2's 0.02), not the embedding's std 1: as a head,
      std-1 rows would give logits of std sqrt(d_model) at the start. The embedding's own draw is
      made and dropped, so every other parameter starts as in the untied model;
    - value_embeddings: layers i with i % 2 == (num_layers - 1) % 2 (every other layer, the last one
      included, as nanochat chooses) each get a table [vocab_size, d_model] and a scalar gate
      (init 0.5): v <- v + gate * table[ids], split into heads like v. Needs num_layers >= 2;
    - dropout: in [0, 1), on the attention probabilities and on each residual branch's output, in
      training mode only (model.eval() turns it off). Its masks come from the torch generator of
      the process (each rank's is seeded seed + rank), so unlike the rest of training dropout is
      not invariant to the world size (nor to grad_accum_steps or compilation): another layout
      draws other masks. A resume at the same world size stays bit-identical (the RNG states are
      checkpointed);
    - embedding_norm: RMSNorm (learned gain [d_model]) of the token embeddings, before the first
      block;
    - pad_vocab_to_multiple: the embedding table and the head get vocab_size rounded up to this
      multiple of rows (an aligned head matmul on a GPU); the padding rows are never looked up and
      their logits are cut off in output_logits, so every consumer sees [..., vocab_size].
    """

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float = 10000.0,
        *,
        device=None,
        dtype=None,
        **options,
    ):
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(
                f"Transformer: unknown option {unknown[0]!r} (the options: {', '.join(OPTION_NAMES)})"
            )
        # Every architecture argument, options included: Transformer(**model.config) rebuilds it.
        self.config = {name: value for name, value in locals().items() if name in Transformer.CONFIG_KEYS}
        self.options = ModelOptions(**options)
        self.options.check(num_layers)
        self.config.update(self.options.recorded())
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.logit_softcap = self.options.logit_softcap

        rows = self.options.padded_vocab_size(vocab_size)  # the logits are cut to vocab_size
        self.token_embeddings = Embedding(rows, d_model, device=device, dtype=dtype)
        self.embedding_norm = None
        if self.options.embedding_norm:
            # RMSNorm right after the embedding lookup, as nanochat does.
            self.embedding_norm = RMSNorm(d_model, device=device, dtype=dtype)
        self.rope = RotaryEmbedding(rope_theta, d_model // num_heads, context_length, device=device)
        self.layers = nn.ModuleList(
            TransformerBlock(
                d_model,
                num_heads,
                d_ff,
                rope=self.rope,
                options=self.options,
                value_vocab_size=vocab_size if self.options.has_value_embeddings(i, num_layers) else None,
                device=device,
                dtype=dtype,
            )
            for i in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model, device=device, dtype=dtype)
        self.lm_head = Linear(d_model, rows, device=device, dtype=dtype)
        if self.options.tie_embeddings:
            # Tied input and output embeddings (Press & Wolf 2017); the head's init, see above.
            self.token_embeddings.weight = self.lm_head.weight
        self.recomputed_layers: frozenset[int] = frozenset()  # see set_activation_checkpointing

    def forward(
        self, token_ids: torch.Tensor, kv_cache: KVCache | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.hidden_states(token_ids, kv_cache)
        return self.output_logits(x) if targets is None else self.output_loss(x, targets)

    def hidden_states(self, token_ids: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Token ids [B, T] -> the last block's output [B, T, d_model] (before ln_final); the
        kv_cache, if given, advanced by T."""
        if token_ids.dim() != 2:
            raise ValueError(f"expected token ids of shape [batch, seq_len], got {tuple(token_ids.shape)}")
        seq_len = token_ids.shape[1]
        if seq_len > self.context_length:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's context_length {self.context_length}"
            )
        if kv_cache is not None and kv_cache.length + seq_len > kv_cache.max_len:
            raise ValueError(
                f"{kv_cache.length} cached and {seq_len} new positions exceed the cache's "
                f"{kv_cache.max_len} (the model's context_length)"
            )
        x = self.token_embeddings(token_ids)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        for i, layer in enumerate(self.layers):
            if i in self.recomputed_layers and torch.is_grad_enabled():
                # Activation checkpointing: keep only the block's input, run it again in backward.
                x = checkpoint(layer, x, kv_cache, i, token_ids, use_reentrant=False)
            else:
                x = layer(x, kv_cache, i, token_ids)
        if kv_cache is not None:
            kv_cache.advance(seq_len)
        return x

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output [B, T, d_model] -> logits [B, T, vocab_size]: ln_final, lm_head (the
        padding rows' logits cut off: a view, no copy) and the soft-cap."""
        logits = self.lm_head(self.ln_final(x))
        if logits.shape[-1] != self.vocab_size:  # pad_vocab_to_multiple
            logits = logits[..., : self.vocab_size]
        if self.logit_softcap is not None:
            # Logit soft-capping (Gemma 2; the nanoGPT speedrun and nanochat), in at least float32.
            logits = softcap(logits, self.logit_softcap)
        return logits

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last block's output [B, T, d_model] and targets [B, T] -> their mean cross-entropy.

        The logits (in the autocast dtype) exist only inside this region, which `train.compile`
        compiles on CUDA (tinylm.pretrain.loop.compile_model; it has no graph break of its own, a
        test holds it to fullgraph): Inductor then fuses the head's epilogue, the soft-cap and the
        cross-entropy's passes. The loss itself runs outside autocast, in float32.
        """
        logits = self.output_logits(x)
        with torch.autocast(x.device.type, enabled=False):
            return cross_entropy(logits, targets)

    def new_kv_cache(self, batch_size: int = 1) -> KVCache:
        """An empty cache for `batch_size` sequences of up to context_length positions."""
        attn = self.layers[0].attn
        weight = self.lm_head.weight
        return KVCache(
            len(self.layers),
            batch_size,
            attn.num_heads,
            self.context_length,
            attn.d_head,
            device=weight.device,
            dtype=weight.dtype,
        )

    def set_activation_checkpointing(self, mode: str) -> None:
        """Which blocks keep only their input in forward and run again in backward (Chen et al. 2016,
        "Training Deep Nets with Sublinear Memory Cost"), with torch's non-reentrant checkpoint:

        - "none": every block keeps its activations (the default);
        - "full": every block is recomputed: a block's saved tensors drop to its input, for about
          one more forward pass of compute;
        - "selective": every second block (0, 2, 4, ...): about half the activation memory saved
          for half the recompute.

        Gradients are exactly those without it: the recomputation runs the same kernels on the same
        inputs, with the RNG state of the first pass (dropout draws the same masks). Only while
        autograd records (training); evaluation and generation never recompute.
        """
        if mode not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"activation checkpointing: {mode!r} is not one of {list(ACTIVATION_CHECKPOINTING)}"
            )
        every = {"none": 0, "full": 1, "selective": 2}[mode]
        self.recomputed_layers = frozenset(range(0, len(self.layers), every) if every else ())

    def set_fast_attention(self, enabled: bool) -> None:
        """Switch every layer between the fused attention kernel (default) and the reference path."""
        for layer in self.layers:
            layer.attn.use_fast_attention = enabled

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of trainable scalars, each shared one once (optionally without the token embedding
        table and the value-embedding tables: lookups, not matmuls; with tie_embeddings that is the
        head too)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.token_embeddings.weight.numel()
            tables = [block.attn.value_embedding for block in self.layers]
            total -= sum(table.weight.numel() for table in tables if table is not None)
        return total


# The architecture arguments, the keys of `model.config`: the sizes, then the options; the sizes
# without a default must be given (a config that leaves out another means its default).
_SIZES = [p for p in inspect.signature(Transformer).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
Transformer.CONFIG_KEYS = tuple(p.name for p in _SIZES) + OPTION_NAMES
Transformer.REQUIRED_KEYS = tuple(p.name for p in _SIZES if p.default is inspect.Parameter.empty)
