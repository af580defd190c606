"""tinylm.pretrain.log: rank 0's lines (labelled with the run's name), the mean loss of each line,
and the TensorBoard scalars; other ranks print nothing."""

import dataclasses
import re

import pytest
import torch

from tinylm.config import TrainConfig
from tinylm.model import Transformer
from tinylm.parallel import RankContext
from tinylm.precision import LossScaler
from tinylm.pretrain.log import TrainingLog, log_line, set_run_name

SHAPE = dict(vocab_size=50, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=24)


@pytest.fixture(autouse=True)
def plain_label():
    yield
    set_run_name(None)


def make_log(rank: int, tmp_path, tensorboard: bool, **train) -> TrainingLog:
    ctx = RankContext(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), backend="gloo")
    config = dataclasses.replace(TrainConfig(), **train)
    model = Transformer(**SHAPE)
    tb = str(tmp_path / "tb") if tensorboard else None
    return TrainingLog(ctx, config, model, torch.float32, 0, str(tmp_path / "state"), tb, 0.0)


def test_rank_0_logs_the_shape_and_the_mean_loss_since_the_last_line(tmp_path, capsys):
    set_run_name("lr3e-3")
    log = make_log(0, tmp_path, False, max_iters=4, log_interval=2, batch_size=6)
    losses = [4.0, 3.0, 2.5, 1.25]
    for step, loss in enumerate(losses, start=1):
        log.step_begins()
        log.step_done(step, LossScaler(False), False)
        log.values(step, loss, 1.0, {"matrices": 0.01, "gains": 0.01}, LossScaler(False))
    log.finish()
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith("[pretrain lr3e-3] ") for line in lines)
    header = lines[0]
    parameters = sum(p.numel() for p in Transformer(**SHAPE).parameters())
    assert f"model: {parameters:,} parameters" in header and "vocab 50, d_model 16, 2 layers" in header
    assert "4 steps of 48 tokens (batch 6 x context 8)" in header
    printed = {int(m[1]): float(m[2]) for m in re.finditer(r"step (\d+)/4 loss (\S+)", "\n".join(lines))}
    assert printed == {2: sum(losses[:2]) / 2, 4: sum(losses[2:]) / 2}
    assert "done: steps 1-4 of 4" in lines[-1]


def test_other_ranks_print_nothing(tmp_path, capsys):
    log = make_log(1, tmp_path, True, max_iters=2, log_interval=1)
    log.step_done(1, LossScaler(False), False)
    log.values(1, 3.0, 1.0, {"matrices": 0.01}, LossScaler(False))
    log.validation(1, 2.0)
    log.finish()
    log_line(False, "not printed")
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "tb").exists()


def test_tensorboard_gets_the_loss_every_groups_learning_rate_the_norm_and_validation(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = make_log(0, tmp_path, True, max_iters=3, log_interval=1)
    for step in (1, 2, 3):
        lrs = {"matrices": 0.1 * step, "gains": 0.01 * step}
        log.step_done(step, LossScaler(False), False)
        log.values(step, 5.0 - step, 0.5 * step, lrs, LossScaler(False))
    log.validation(3, 1.5)
    log.finish()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()

    def scalars(tag):
        return {e.step: e.value for e in events.Scalars(tag)}

    assert scalars("loss_train") == {1: 4.0, 2: 3.0, 3: 2.0}
    assert scalars("lr/matrices") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    assert scalars("lr/gains") == pytest.approx({1: 0.01, 2: 0.02, 3: 0.03})
    assert scalars("grad_norm") == {1: 0.5, 2: 1.0, 3: 1.5}
    assert scalars("val_loss") == {3: 1.5}


def test_a_float16_overflow_is_said_with_the_new_scale(tmp_path, capsys):
    scaler = LossScaler(True)
    log = make_log(0, tmp_path, False, max_iters=2, log_interval=1)
    scaler.update(True)
    log.step_done(1, scaler, True)
    log.values(1, 3.0, float("inf"), {"matrices": 0.01}, scaler)
    err = capsys.readouterr().err
    assert f"step 1: float16 gradients overflowed; update skipped, loss scale now {scaler.scale:g}" in err
    assert f"loss scale {scaler.scale:g}" in err
