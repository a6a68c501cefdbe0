"""Data-parallel training on torch.distributed: ``graphgrad.nn.parallel`` and ``graphgrad.nn.sharded``,
under their public name.

``gg.nn.DataParallel`` and ``gg.nn.ShardedDataParallel`` (ZeRO stages 1-3) wrap a module;
``init_process_group`` / ``destroy_process_group`` are torch's with two work-arounds for gloo at
shutdown (docs/distributed.md, "Exiting").
"""

from .nn.parallel import DataParallel, assign_buckets, destroy_process_group, init_process_group
from .nn.sharded import ShardedDataParallel

__all__ = ["DataParallel", "ShardedDataParallel", "init_process_group", "destroy_process_group",
           "assign_buckets"]
