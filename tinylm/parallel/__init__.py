"""Data parallelism written here on top of torch.distributed: launcher, DDP, sharded optimizer.

parallel/ knows nothing about models: it works on any nn.Module and any torch optimizer.
"""

from tinylm.parallel.ddp import DDP
from tinylm.parallel.launch import RankContext, RankFailedError, launch
from tinylm.parallel.sharded import ShardedOptimizer

__all__ = ["DDP", "RankContext", "RankFailedError", "ShardedOptimizer", "launch"]
