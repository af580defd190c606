"""Byte-level BPE tokenizer: training, encoding/decoding, tokenizer files, corpus encoding.

    vocab, merges = train_bpe(input_path, vocab_size, special_tokens, num_workers=None)
    tok = Tokenizer(vocab, merges, special_tokens)
    tok.encode(text); tok.decode(ids); tok.encode_iterable(lines)
    tok.save(path); Tokenizer.load(path); Tokenizer.from_gpt2_files(vocab_json, merges_txt, special_tokens)

The stages: `train_tokenizer(input_path, output_path, vocab_size, special_tokens)` (train-tokenizer)
and `encode_corpus(tokenizer, input_path, output_path)` (encode).
"""

from tinylm.tokenizer.bpe import train_bpe, train_tokenizer
from tinylm.tokenizer.encode import encode_corpus
from tinylm.tokenizer.pretokenize import GPT2_PATTERN
from tinylm.tokenizer.tokenizer import Tokenizer

__all__ = [
    "GPT2_PATTERN",
    "Tokenizer",
    "encode_corpus",
    "train_bpe",
    "train_tokenizer",
]
