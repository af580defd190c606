"""train.dtype resolved per device, and its autocast: what runs in low precision and what does not."""

import pytest
import torch

from tinylm.model import Transformer
from tinylm.nn_utils import cross_entropy
from tinylm.precision import autocast, resolve_dtype


def test_auto_is_float32_on_the_cpu_and_bfloat16_on_a_cuda_device_that_has_it(monkeypatch):
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda:0") == torch.float32
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="train.dtype: 'fp8'"):
        resolve_dtype("fp8", "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_lowers_the_matmuls_but_not_the_parameters_or_the_loss(dtype):
    torch.manual_seed(0)
    model = Transformer(vocab_size=64, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=24)
    ids = torch.randint(0, 64, (2, 9))
    reference = model(ids[:, :-1])
    with autocast("cpu", dtype):
        logits = model(ids[:, :-1])
        loss = cross_entropy(logits, ids[:, 1:])
    assert logits.dtype == dtype and loss.dtype == torch.float32
    torch.testing.assert_close(logits.float(), reference, atol=0.1, rtol=0.05)
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    with autocast("cpu", torch.float32):
        assert model(ids[:, :-1]).dtype == torch.float32
