"""Pre-tokenization does not depend on the installed `regex`: every code point, in a few contexts,
splits as Hugging Face tokenizers' Rust regex engine splits it with the same GPT-2 pattern."""

import pytest
import regex

from tinylm.tokenizer.pretokenize import GPT2_PATTERN, unicode_version

tokenizers = pytest.importorskip("tokenizers")


def hf_pieces(text: str) -> list[str]:
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(GPT2_PATTERN), behavior="isolated")
    return [piece for piece, _ in split.pre_tokenize_str(text)]


@pytest.mark.parametrize("joiner", ["", " "], ids=["alone", "spaced"])
def test_every_code_point_splits_as_in_hugging_face_tokenizers(joiner):
    """Every code point but the surrogates, in order, each after `joiner`: the pattern cuts a string where
    the class of its characters (letter, number, space, other) changes, so a character that one engine
    classes otherwise than the other moves a cut."""
    text = "".join(joiner + chr(code) for code in range(0x110000) if not 0xD800 <= code <= 0xDFFF)
    ours = regex.findall(GPT2_PATTERN, text)
    theirs = hf_pieces(text)
    if ours != theirs:
        first = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
        pytest.fail(
            f"pre-tokens differ from tokenizers' first at {ours[first][:12]!r} vs {theirs[first][:12]!r}; "
            f"regex {regex.__version__} has Unicode {unicode_version()}"
        )


def test_the_unicode_version_is_recorded_and_checked(tmp_path, capsys):
    from tinylm.tokenizer import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256] = b"<|endoftext|>"
    Tokenizer(vocab, [], ["<|endoftext|>"]).save(tmp_path / "tok.json")
    assert f'"unicode_version": "{unicode_version()}"' in (tmp_path / "tok.json").read_text()
    text = (
        (tmp_path / "tok.json")
        .read_text()
        .replace(f'"unicode_version": "{unicode_version()}"', '"unicode_version": "9.0"')
    )
    (tmp_path / "other.json").write_text(text)
    Tokenizer.load(tmp_path / "other.json")
    warning = capsys.readouterr().err
    assert "Unicode 9.0" in warning and f"Unicode {unicode_version()}" in warning and "other.json" in warning
