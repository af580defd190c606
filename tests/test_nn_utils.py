"""softmax, cross_entropy and gradient_clip against PyTorch's own implementations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.nn_utils import cross_entropy, gradient_clip, softmax


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_softmax_matches_torch(dim, scale):
    torch.manual_seed(0)
    x = torch.randn(4, 5, 6) * scale
    out = softmax(x, dim=dim)
    torch.testing.assert_close(out, torch.softmax(x, dim=dim))
    assert torch.isfinite(out).all()


def test_softmax_handles_masked_positions():
    x = torch.tensor([[0.0, float("-inf"), 1.0], [2.0, 2.0, float("-inf")]])
    torch.testing.assert_close(softmax(x), torch.softmax(x, dim=-1))


@pytest.mark.parametrize("leading", [(7,), (3, 5), (2, 3, 4)])
@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_cross_entropy_matches_torch(leading, scale):
    torch.manual_seed(0)
    vocab = 11
    logits = torch.randn(*leading, vocab) * scale
    targets = torch.randint(0, vocab, leading)
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    loss = cross_entropy(ours, targets)
    expected = F.cross_entropy(theirs.reshape(-1, vocab), targets.reshape(-1))
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(ours.grad, theirs.grad)


def test_cross_entropy_huge_logits_stay_finite_and_exact():
    # Logits of 1e4 overflow a naive exp(); the loss must still be exact.
    logits = torch.tensor([[1e4, 0.0, -1e4], [1e4, 1e4 - 1.0, 0.0]], requires_grad=True)
    targets = torch.tensor([1, 1])
    loss = cross_entropy(logits, targets)
    expected = F.cross_entropy(logits, targets)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(grad, expected_grad)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    vocab=st.integers(2, 9),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_cross_entropy_matches_torch_property(n, vocab, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale
    targets = torch.randint(0, vocab, (n,), generator=g)
    torch.testing.assert_close(cross_entropy(logits, targets), F.cross_entropy(logits, targets))


def test_cross_entropy_gradient_passes_gradcheck():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (3, 4))
    assert torch.autograd.gradcheck(cross_entropy, (logits, targets))


def test_cross_entropy_of_bfloat16_logits_is_computed_in_float32():
    torch.manual_seed(0)
    logits = (torch.randn(8, 50) * 5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (8,))
    loss = cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), targets))
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


def _two_identical_models(seed: int = 0):
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    b = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    b.load_state_dict(a.state_dict())
    x = torch.randn(10, 6)
    for model in (a, b):
        model(x).pow(2).sum().backward()
        model[0].bias.grad = None  # a parameter without a gradient is skipped
    return a, b


@pytest.mark.parametrize("max_norm", [1e-2, 0.5, 1e6])
def test_gradient_clip_matches_torch(max_norm):
    ours, theirs = _two_identical_models()
    norm = gradient_clip(ours.parameters(), max_norm)
    expected_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    torch.testing.assert_close(norm, expected_norm)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, q.grad)
    clipped = torch.stack([p.grad.norm() for p in ours.parameters() if p.grad is not None]).norm()
    assert clipped <= max_norm * (1 + 1e-5) or max_norm > norm


def test_gradient_clip_leaves_small_gradients_alone():
    ours, _ = _two_identical_models()
    before = [p.grad.clone() for p in ours.parameters() if p.grad is not None]
    gradient_clip(ours.parameters(), max_norm=1e6)
    after = [p.grad for p in ours.parameters() if p.grad is not None]
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradient_clip_without_gradients_returns_zero():
    layer = torch.nn.Linear(3, 3)
    assert gradient_clip(layer.parameters(), 1.0).item() == 0.0


def test_cross_entropy_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="disagree"):
        cross_entropy(torch.randn(2, 3, 5), torch.zeros(3, 2, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_in_row_chunks_is_the_same_bits_and_matches_torch(monkeypatch, dtype):
    """Chunks of 3 rows (a last one of 1) against one chunk: the same loss and gradient bit for bit,
    and both against F.cross_entropy on float32 logits."""
    import tinylm.nn_utils as nn_utils

    torch.manual_seed(0)
    logits = (torch.randn(2, 5, 37) * 4).to(dtype)
    targets = torch.randint(0, 37, (2, 5))

    def loss_and_grad():
        z = logits.clone().requires_grad_()
        loss = cross_entropy(z, targets)
        loss.backward()
        return loss.detach(), z.grad

    whole = loss_and_grad()
    monkeypatch.setattr(nn_utils, "CPU_LOSS_CHUNK_BYTES", 3 * 4 * 37)
    assert [(s.start, s.stop) for s in nn_utils.row_chunks(10, 37, torch.device("cpu"))] == [
        (0, 3),
        (3, 6),
        (6, 9),
        (9, 12),
    ]
    chunked = loss_and_grad()
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert chunked[1].dtype == dtype
    # The chunk size given explicitly (as the memory plan gives a GPU's): again the same bits.
    monkeypatch.undo()
    z = logits.clone().requires_grad_()
    loss = cross_entropy(z, targets, chunk_bytes=2 * 4 * 37)
    loss.backward()
    assert torch.equal(loss.detach(), whole[0]) and torch.equal(z.grad, whole[1])
    assert len(nn_utils.row_chunks(10, 37, torch.device("cpu"), 2 * 4 * 37)) == 5
    reference = logits.float().requires_grad_()
    expected = F.cross_entropy(reference.flatten(0, 1), targets.flatten())
    expected.backward()
    torch.testing.assert_close(chunked[0], expected)
    torch.testing.assert_close(
        chunked[1].float(), reference.grad, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-6
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("num_rows, vocab_size", [(2048, 4096), (5, 50_257), (16_384, 32_000), (3, 1 << 27)])
def test_row_chunks_cover_every_row_once_within_the_device_bound(device, num_rows, vocab_size):
    """In order, no gap, no overlap; each chunk's float32 rows within the device's bound unless a
    single row is larger (then one row a chunk). No tensor is made: a CUDA device needs no GPU."""
    import tinylm.nn_utils as nn_utils

    limit = nn_utils.CPU_LOSS_CHUNK_BYTES if device == "cpu" else nn_utils.LOSS_CHUNK_BYTES
    chunks = nn_utils.row_chunks(num_rows, vocab_size, torch.device(device))
    covered = [row for chunk in chunks for row in range(num_rows)[chunk]]
    assert covered == list(range(num_rows))
    for chunk in chunks:
        rows = len(range(num_rows)[chunk])
        assert rows == 1 or rows * vocab_size * 4 <= limit


def test_evaluation_token_losses_in_row_chunks_match_torch(monkeypatch):
    import tinylm.nn_utils as nn_utils
    from tinylm.evaluate import token_losses

    torch.manual_seed(1)
    logits, targets = torch.randn(11, 29, dtype=torch.bfloat16), torch.randint(0, 29, (11,))
    expected = F.cross_entropy(logits.float(), targets, reduction="none")
    monkeypatch.setattr(nn_utils, "CPU_LOSS_CHUNK_BYTES", 2 * 4 * 29)
    assert len(nn_utils.row_chunks(11, 29, torch.device("cpu"))) == 6
    torch.testing.assert_close(token_losses(logits, targets), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_softcap_is_autograd_through_the_formula_bit_for_bit(monkeypatch, dtype):
    """Forward and gradient against PyTorch's autograd through cap * tanh(z / cap) in float32 (or
    float64), in chunks of 3 rows (a last one of 1) and in one chunk."""
    import tinylm.nn_utils as nn_utils
    from tinylm.nn_utils import softcap

    torch.manual_seed(2)
    logits = (torch.randn(2, 5, 37) * 30).to(dtype)
    upstream = torch.randn(2, 5, 37).to(dtype)
    reference = logits.clone().requires_grad_()
    wide = torch.promote_types(dtype, torch.float32)
    expected = (7.0 * torch.tanh(reference.to(wide) / 7.0)).to(dtype)
    expected.backward(upstream)
    for chunk_bytes in (3 * 4 * 37, nn_utils.CPU_LOSS_CHUNK_BYTES):
        monkeypatch.setattr(nn_utils, "CPU_LOSS_CHUNK_BYTES", chunk_bytes)
        z = logits.clone().requires_grad_()
        capped = softcap(z, 7.0)
        capped.backward(upstream)
        assert capped.dtype == dtype and capped.shape == logits.shape
        assert torch.equal(capped, expected) and torch.equal(z.grad, reference.grad)
    assert capped.abs().max() <= 7.0
