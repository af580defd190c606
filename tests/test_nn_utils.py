"""softmax, cross_entropy and gradient_clip against PyTorch's own implementations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.nn_utils import cross_entropy, gradient_clip, softmax, squared_norms


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


# The fused path (log-softmax and softmax kernels, the default on CUDA) against the formula: the loss
# to float32 rounding, each gradient element to a few units in the last place of its dtype.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_fused_cross_entropy_is_the_formula_up_to_rounding(dtype, scale):
    torch.manual_seed(0)
    vocab = 301
    logits = (torch.randn(4, 33, vocab) * scale).to(dtype)
    if dtype == torch.float16:
        logits = logits.clamp(-6e4, 6e4)
    targets = torch.randint(0, vocab, (4, 33))
    results = []
    for fused in (True, False):
        leaf = logits.clone().requires_grad_()
        # Chunks of 10 rows (10 x 301 floats): several per call, and a ragged last one.
        loss = cross_entropy(leaf, targets, chunk_bytes=10 * 4 * vocab, fused=fused)
        loss.backward()
        results.append((loss, leaf.grad))
    (loss, grad), (reference_loss, reference_grad) = results
    assert loss.dtype == reference_loss.dtype == torch.promote_types(dtype, torch.float32)
    assert grad.dtype == dtype
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6 if dtype != torch.float64 else 1e-12, atol=0)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(grad.double(), reference_grad.double(), rtol=4 * ulp, atol=ulp / (4 * 33))
    expected = F.cross_entropy(logits.double().reshape(-1, vocab), targets.reshape(-1))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


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


@pytest.mark.parametrize(
    "dtypes", [(torch.bfloat16, torch.float32), (torch.float64,), (torch.float16, torch.bfloat16)]
)
def test_gradient_clip_of_mixed_dtypes_matches_brute_force(dtypes):
    """Gradients of several dtypes (one multi-tensor norm per dtype, in at least float32): the norm
    and every clipped gradient against a float64 computation over every element."""
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(shape).to(dtypes[i % len(dtypes)]))
        for i, shape in enumerate([(5, 7), (3,), (64, 33), (1,)])
    ]
    for p in params:
        p.grad = (torch.randn(p.shape) * 3).to(p.dtype)
    brute = torch.cat([p.grad.double().flatten() for p in params]).pow(2).sum().sqrt()
    expected = [(p.grad.double() * (1.0 / (brute + 1e-6))).to(p.dtype) for p in params]
    norm = gradient_clip(params, 1.0)
    torch.testing.assert_close(norm.double(), brute, rtol=1e-5, atol=0)
    for p, want in zip(params, expected, strict=True):
        assert p.grad.dtype == want.dtype
        torch.testing.assert_close(p.grad, want)  # within the dtype's own tolerance


def test_squared_norms_fused_are_the_per_tensor_sums_up_to_rounding():
    """The multi-tensor norms (the default on CUDA) against the per-tensor sums of squares and a
    float64 brute force: one entry per tensor in order, 0 where there is no gradient."""
    torch.manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float32, torch.float16]
    grads = [(torch.randn(n) * 5).to(dtype) for n, dtype in zip((7, 300, 1, 4096, 65), dtypes, strict=True)]
    grads.insert(2, None)
    fused = squared_norms(grads, torch.device("cpu"), fused=True)
    per_tensor = squared_norms(grads, torch.device("cpu"), fused=False)
    brute = torch.tensor(
        [0.0 if g is None else g.double().pow(2).sum().item() for g in grads], dtype=torch.float64
    )
    assert fused.dtype == per_tensor.dtype == torch.float32 and fused.shape == (len(grads),)
    assert fused[2] == per_tensor[2] == 0
    torch.testing.assert_close(fused, per_tensor, rtol=1e-6, atol=0)
    torch.testing.assert_close(fused.double(), brute, rtol=1e-6, atol=0)


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


# Under torch.compile the fused path's backward is one pointwise expression over the saved
# logsumexp: Inductor makes it one kernel (the logits read once, the gradient written once), and it
# is the formula's gradient up to rounding, as the eager fused path is.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_fused_cross_entropy_backward_is_one_kernel_and_the_formula(dtype):
    from torch._inductor import config as inductor_config
    from torch._inductor import metrics

    torch.manual_seed(0)
    vocab = 301
    logits = (torch.randn(4, 33, vocab) * 30).to(dtype)
    targets = torch.randint(0, vocab, (4, 33))
    reference = logits.clone().requires_grad_()
    cross_entropy(reference, targets, fused=False).backward()
    compiled = torch.compile(lambda z, y: cross_entropy(z, y, fused=True), fullgraph=True)
    leaf = logits.clone().requires_grad_()
    with inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False):
        loss = compiled(leaf, targets)
        metrics.reset()
        loss.backward()
        assert metrics.generated_kernel_count == 1
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(leaf.grad.double(), reference.grad.double(), rtol=4 * ulp, atol=ulp / (4 * 33))
    expected = F.cross_entropy(logits.double().reshape(-1, vocab), targets.reshape(-1))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)
