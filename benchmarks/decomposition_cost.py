"""What the decomposition fallback costs per call: the first call, later calls, the lookup alone.

Run: PYTHONPATH=src python benchmarks/decomposition_cost.py (docs/performance.md quotes it).
"""

import time

import torch

import graphgrad as gg
from graphgrad import decompose

X = gg.as_tensor(torch.randn(16, dtype=torch.float64), requires_grad=True)
CASES = [
    ("torch.deg2rad (torch._decomp table)", lambda: torch.deg2rad(X),
     lambda: torch.mul(X, 0.017453292519943295)),
    ("aten.sin.default (as torch.sin)", lambda: torch.ops.aten.sin.default(X),
     lambda: torch.sin(X)),
    ("F.gaussian_nll_loss (Python body)",
     lambda: torch.nn.functional.gaussian_nll_loss(X, X, X.detach().abs() + 1), None),
]


def per_call_us(f, n=2000):
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e6


def once_us(f):
    start = time.perf_counter()
    f()
    return (time.perf_counter() - start) * 1e6


def main():
    first = once_us(lambda: torch.special.ndtr(X)) / 1e6
    print(f"the first table decomposition in the process (imports torch._dynamo): {first:.2f} s")
    for name, f, direct in CASES:
        decompose.clear_cache()
        cold = once_us(f)
        warm = per_call_us(f)
        plain = f"{per_call_us(direct):.1f} us" if direct else "-"
        print(f"{name}: first call {cold:.0f} us, later calls {warm:.1f} us; "
              f"the op it records, called directly: {plain}")
    for name, func in [("C function", torch.deg2rad), ("ATen overload", torch.ops.aten.sin.default)]:
        cost = per_call_us(lambda func=func: decompose.find(func, (X,), {}), 20000)
        print(f"find() on a warm cache, {name}: {cost:.2f} us")


if __name__ == "__main__":
    main()
