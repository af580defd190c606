"""tiktoken's core as the encoding engine of our tokenizer, where it provably gives our ids.

Our BPE (tokenizer.py, the readable reference) merges, in each pre-token, the adjacent pair with
the lowest *merge rank*, leftmost first. tiktoken merges the adjacent pair whose *concatenated
bytes* have the lowest rank (its token id), leftmost first, and returns a whole pre-token at once
when its bytes are a token. The two differ on some vocabularies (two pairs that make the same
bytes; a token its own bytes do not encode to), so `tiktoken_encoding` builds a tiktoken
`Encoding` only after checking four conditions on the tokenizer, and returns a reason otherwise:

(C1) No two ordinary (non-special) tokens have the same bytes.
(C2) Every ordinary token of two or more bytes is made by exactly one merge, and each merge's two
     parts are single bytes or tokens made by earlier merges.
(C3) Token ids grow with merge rank (tiktoken ranks tokens by id).
(C4) The bytes of every ordinary token encode, with our BPE, to that one token.

Why they suffice. By (C2) the merges our BPE applies to a pre-token come in non-decreasing rank,
so the state after every merge below rank m is done is exactly the result of BPE with the merges
below m alone. In such a result, a run of adjacent tokens is segmented just as BPE (with those
merges) segments the run's bytes alone: no token ever crossed the run's edges, and merges inside
it were taken in the same order. So a run whose bytes form a token T of rank below m would be the
one token T (C4), and a run whose bytes form T of rank m is exactly T's merge pair (C4 and C2: the
last step of encoding T's bytes is T's merge). Hence at every rank m, the only adjacent pairs
whose bytes form a token of rank <= m are the pairs of merge m, in both algorithms: tiktoken
(ordering by id, C1 and C3) and our BPE merge the same pairs, leftmost first, and stop at the same
state. A pre-token whose bytes are a token T is T in both (C4).

The checks take well under a second for a 32,000-token vocabulary. Pre-tokenization is tiktoken's
Rust regex with the GPT-2 pattern; the tests compare it with ours on mixed text of many scripts.

Special tokens: ours split the text at the leftmost match, the longest where several start there;
tiktoken's at the leftmost match, the first listed where several start there. The two agree unless
one special token is a prefix of another (`specials_agree`); then the caller splits the text itself
and gives tiktoken only the text between special tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tiktoken

from tinylm.tokenizer.pretokenize import GPT2_PATTERN


def tiktoken_encoding(
    vocab: dict[int, bytes],
    merges: Sequence[tuple[bytes, bytes]],
    special_ids: dict[str, int],
    encode_many: Callable[[list[bytes]], list[Sequence[int]]],
) -> tuple[tiktoken.Encoding | None, str]:
    """(a tiktoken Encoding giving exactly our ids, "") or (None, the condition that fails).

    `special_ids` (special token -> id) are left out of the ranks and given to tiktoken as its
    special tokens; `encode_many` is the reference BPE of each of a list of byte strings (for C4).
    """
    ranks: dict[bytes, int] = {}
    special = set(special_ids.values())
    for i in sorted(vocab):
        if i in special:
            continue
        token = vocab[i]
        if token in ranks:
            return None, f"C1: tokens {ranks[token]} and {i} are both {token!r}"
        ranks[token] = i
    made_at: dict[bytes, int] = {}  # token bytes -> the rank of the merge that makes it
    last_id = -1
    for rank, (a, b) in enumerate(merges):
        merged = a + b
        if merged in made_at:
            return None, f"C2: merges {made_at[merged]} and {rank} both make {merged!r}"
        for part in (a, b):
            if len(part) > 1 and part not in made_at:
                return None, f"C2: merge {rank} uses {part!r}, which no earlier merge makes"
        made_at[merged] = rank
        if merged not in ranks:
            return None, f"C2: merge {rank} makes {merged!r}, which is not an ordinary token"
        if ranks[merged] <= last_id:
            return None, f"C3: merge {rank} makes id {ranks[merged]}, not above the id of merge {rank - 1}"
        last_id = ranks[merged]
    merged = [(token, i) for token, i in ranks.items() if len(token) > 1]
    for token, i in merged:
        if token not in made_at:
            return None, f"C2: token {i} ({token!r}) is made by no merge"
    for (token, i), ids in zip(merged, encode_many([token for token, _ in merged]), strict=True):
        if tuple(ids) != (i,):
            return None, f"C4: the bytes of token {i} ({token!r}) encode to {list(ids)}"
    encoding = tiktoken.Encoding(
        "tinylm", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=dict(special_ids)
    )
    return encoding, ""


def specials_agree(special_tokens: Sequence[str]) -> bool:
    """True if tiktoken splits text at special tokens as we do: none is a prefix of another."""
    return not any(a != b and b.startswith(a) for a in special_tokens for b in special_tokens)
