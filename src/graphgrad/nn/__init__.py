"""graphgrad for torch.nn modules: ``adopt`` a module, train it data-parallel.

- ``adoption``: ``adopt(module)``, ``is_adopted``, ``Parameter`` (a graphgrad leaf that is an
  ``nn.Parameter``);
- ``parallel``: ``DataParallel`` on torch.distributed (it adopts the module it wraps), with
  ``init_process_group`` / ``destroy_process_group``, also importable as ``graphgrad.distributed``;
- ``sharded``: ``ShardedDataParallel`` (ZeRO stages 1-3), built on ``parallel``'s machinery, with
  ``gathering`` (stage 3: units of parameters gathered around their use).

The modules import one way (``sharded`` imports ``gathering`` and ``parallel``, ``gathering``
imports ``parallel``, ``parallel`` imports ``adoption``); this package re-exports them.
"""

from .adoption import Parameter, adopt, is_adopted
from .parallel import DataParallel
from .sharded import ShardedDataParallel

# Pickles name the class by this path (as before nn became a package), so checkpoints saved by
# either layout load with torch.load(weights_only=True).
Parameter.__module__ = __name__

__all__ = ["Parameter", "adopt", "is_adopted", "DataParallel", "ShardedDataParallel"]
