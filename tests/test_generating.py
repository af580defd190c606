"""Sampling: top-p keeps exactly the nucleus, temperature 0 is argmax, generation is seeded."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.generating import generate, sample_next, top_p_filter
from tinylm.model import Transformer


def nucleus_by_loop(probs: list[float], top_p: float) -> set[int]:
    """Reference: walk tokens from most to least likely until the kept mass reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.001, 1.0), min_size=2, max_size=30, unique=True),
    st.floats(0.05, 0.999),
)
def test_top_p_keeps_the_nucleus_and_renormalizes(weights, top_p):
    probs = torch.tensor(weights, dtype=torch.float64)
    probs /= probs.sum()
    filtered = top_p_filter(probs, top_p)
    kept = {i for i in range(len(weights)) if filtered[i] > 0}
    assert kept == nucleus_by_loop(probs.tolist(), top_p)
    assert torch.isclose(filtered.sum(), torch.tensor(1.0, dtype=torch.float64))
    # Kept tokens keep their relative odds.
    idx = sorted(kept)
    ratio = filtered[idx] / probs[idx]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio))


def test_top_p_one_is_identity_and_tiny_top_p_is_argmax():
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert torch.equal(top_p_filter(probs, 1.0), probs)
    only = top_p_filter(probs, 1e-9)
    assert int(only.argmax()) == int(probs.argmax()) and only.max() == 1.0


def test_temperature_zero_is_greedy_and_sampling_follows_the_distribution():
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])
    assert sample_next(logits, 0.0, 1.0, None) == 1
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_next(logits, 1.0, 1.0, g) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).double() / len(draws)
    assert torch.allclose(freq, torch.softmax(logits.double(), -1), atol=0.03)


def test_generate_is_seeded_crops_context_and_stops_at_eos():
    torch.manual_seed(0)
    model = Transformer(vocab_size=40, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    def run(seed):
        return generate(model, [1, 2, 3], 30, 8, 1.0, 1.0, None, torch.Generator().manual_seed(seed))
    a, b, c = run(0), run(0), run(1)
    assert a == b and a != c and len(a) == 30  # 33 ids in all: the context was cropped to 8
    eos = a[4]
    stopped = generate(model, [1, 2, 3], 30, 8, 1.0, 1.0, eos, torch.Generator().manual_seed(0))
    assert stopped == a[: a.index(eos) + 1]
