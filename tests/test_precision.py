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


def test_loss_scaler_follows_torch_grad_scaler_over_overflows_and_growth():
    """The same overflow sequence gives torch.amp.GradScaler's scales, growth tracker and state dict."""
    from tinylm.precision import LossScaler

    ours = LossScaler(enabled=True, init_scale=2.0**10, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    pattern = [False, True, False, False, False, False, True, True, False, False, False, False, False]
    for step, overflow in enumerate(pattern):
        gradient = torch.full((4,), float("inf") if overflow else 3.0)
        weight.grad = gradient * theirs.scale(torch.ones(()))
        theirs.unscale_(optimizer)
        theirs.step(optimizer)
        theirs.update()
        ours_grad = [gradient * ours.scale]
        ours.unscale_(ours_grad)
        if not overflow:
            torch.testing.assert_close(ours_grad[0], weight.grad, rtol=0, atol=0)
        ours.update(overflow)
        assert ours.state_dict() == theirs.state_dict(), f"step {step}"
    restored = LossScaler(enabled=True)
    restored.load_state_dict(theirs.state_dict())
    assert restored.state_dict() == theirs.state_dict()
    disabled = LossScaler(enabled=False)
    disabled.update(True)
    assert (
        disabled.scale == 1.0
        and disabled.state_dict() == {} == torch.amp.GradScaler("cpu", enabled=False).state_dict()
    )
