"""Programs built on graphgrad, not part of the engine: ``python -m graphgrad demo | tour | bench``.

- ``demo``: trains a torch.nn model on scikit-learn's digits with graphgrad beside torch.autograd.
- ``tour``: walks through how an autograd graph works, then trains an MLP side by side.
- ``bench``: graphgrad against torch.autograd on the benchmark workloads
  (``bench_distributed``: the data-parallel workloads, ``python -m graphgrad.apps.bench_distributed``).

They use only graphgrad's public API. The library never imports this package; ``__main__`` does.
The demo's optional dependencies (the ``[demo]`` extra) are imported where found: without them the
demo says what to install.
"""
