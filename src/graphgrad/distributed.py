"""Data-parallel training on torch.distributed: ``graphgrad.nn.parallel``, under its public name.

``gg.nn.DataParallel`` wraps a module; ``init_process_group`` / ``destroy_process_group`` are
torch's with two work-arounds for gloo at shutdown (docs/distributed.md, "Exiting").
"""

from .nn.parallel import DataParallel, assign_buckets, destroy_process_group, init_process_group

__all__ = ["DataParallel", "init_process_group", "destroy_process_group", "assign_buckets"]
