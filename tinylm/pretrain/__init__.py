"""The pretrain stage: token files -> committed, published checkpoints.

run.py         train(): the checks, the resume rule, the launch of one loop per rank, publishing
loop.py        one rank's training loop (train_rank) and the RunSpec it is sent
optimizer.py   the run's optimizer and parameter groups, and the learning rate of each step
log.py         rank 0's log lines and TensorBoard scalars
resume.py      the run's identity check, and the state saved for a resume (scaler, RNGs)
state.py       the save and restore collectives of a step folder; commit and prune
steps.py       the state folder's layout: step folders, their files, the committed steps
publish.py     the committed steps as published checkpoints for the other stages
lock.py        one trainer per state folder
heartbeat.py   waits between ranks that are not collectives (checkpoint I/O)
"""

from tinylm.pretrain.loop import NonFiniteLossError, RunSpec, train_rank
from tinylm.pretrain.run import model_config_of, structural_hash, train

__all__ = ["NonFiniteLossError", "RunSpec", "model_config_of", "structural_hash", "train", "train_rank"]
