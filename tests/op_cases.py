"""Helpers for hand-written cases: graphgrad against torch.autograd, in float64.

- Comparing: ``plain``, ``TOL`` / ``TOL_NAN_FAILS``, ``assert_grads_close``, ``close``.
- Inputs: ``Randoms`` (a file's random factories on that file's own generator), ``rnd`` and
  ``leaf`` (a generator seeded per call), ``Const`` (a floating tensor that needs no grad).
- Checks: ``case`` / ``check_case`` (a table row through the op_db harness's check, then
  ``gg.gradcheck``), ``check`` (values, first and second derivatives), ``check_to_order``
  (derivatives up to any order), ``compare`` (a list of leaves, tuple outputs), plus
  ``inplace`` and ``grad_of``.

Importing this module does not load op_db (seconds): ``check_case`` imports the harness itself.
"""

import contextlib
from collections import namedtuple
from types import SimpleNamespace

import torch
from torch.nn.attention import sdpa_kernel

import graphgrad as gg
import helpers
from helpers import F64, TOL_NAN, plain  # noqa: F401  (F64, plain: re-exported)

T = torch.Tensor
TOL = TOL_NAN  # here TOL is helpers.TOL_NAN: a NaN where the other has a NaN is equal
TOL_NAN_FAILS = helpers.TOL  # any NaN fails


# -- comparing (plain: helpers.plain) ----------------------------------------------------------
def assert_grads_close(have, want, what="gradient", tol=TOL):
    """Gradient lists equal; ``None`` and an all-zero tensor count as the same."""
    assert len(have) == len(want), f"{what}: {len(have)} vs {len(want)} gradients"
    for k, (h, w) in enumerate(zip(have, want)):
        if h is None or w is None:
            other = w if h is None else h
            assert other is None or not plain(other).any(), f"{what} {k}: None vs nonzero"
        else:
            torch.testing.assert_close(plain(h), plain(w), **tol, msg=lambda m, k=k: f"{what} {k}: {m}")


def close(a, b, where="result", tol=TOL_NAN_FAILS):
    """Recursive comparison: tensors by value, containers element-wise, the rest by ==."""
    if isinstance(a, T) or isinstance(b, T):
        assert isinstance(a, T) and isinstance(b, T), f"{where}: {a!r} vs {b!r}"
        torch.testing.assert_close(plain(a), plain(b), **tol, msg=lambda m: f"{where}: {m}")
    elif isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{where}[{i}]", tol)
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


# -- inputs ------------------------------------------------------------------------------------
class Randoms:
    """Random float64 factories drawing from one generator. Each test file makes its own, so
    that its inputs do not depend on which other files were imported before it."""

    def __init__(self, seed=0):
        self.gen = torch.Generator().manual_seed(seed)

    def r(self, *shape, scale=1.0):  # standard normal, times scale
        return torch.randn(shape, dtype=F64, generator=self.gen) * scale

    def pos(self, *shape, low=0.5, width=1.5):  # in [low, low + width): log, sqrt, pow bases
        return torch.rand(shape, dtype=F64, generator=self.gen) * width + low

    def away(self, *shape):  # |x| in [0.5, 2): denominators
        return self.pos(*shape) * torch.where(torch.rand(shape, generator=self.gen) < 0.5, -1.0, 1.0).to(F64)

    def unit(self, *shape):  # in (-0.9, 0.9)
        return torch.rand(shape, dtype=F64, generator=self.gen) * 1.8 - 0.9

    def mask(self, *shape):
        return torch.rand(shape, generator=self.gen) < 0.5

    def ints(self, high, *shape):
        return torch.randint(0, high, shape, generator=self.gen)


def rnd(*shape, seed=0, scale=1.0):
    """Standard normal float64 values (times scale) from a generator seeded for this call."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


def leaf(kind, *shape, seed=0, scale=1.0):
    """``rnd`` as a leaf that requires grad: a graphgrad one for kind "gg", else a torch one."""
    data = rnd(*shape, seed=seed, scale=scale)
    return gg.as_tensor(data, requires_grad=True) if kind == "gg" else data.requires_grad_(True)


def grad_of(out, inputs, **kw):
    """gg.grad for a graphgrad output, torch.autograd.grad for a plain one."""
    if isinstance(out, gg.Tensor):
        return gg.grad(out, inputs, **kw)
    return torch.autograd.grad(out, inputs, **kw)


class Const:
    """A floating tensor passed without requires_grad (a class weight, a dtype donor)."""

    def __init__(self, t):
        self.t = t


def inplace(method, *extra, extra_first=False, covers=None, **kw):
    """``y = a * 1.0; method(y, *rest, *extra, **kw)``: an in-place op on a non-leaf, ``rest``
    being the case's other arguments (``extra_first``: ``method(y, *extra, *rest, **kw)``); it
    must return y. ``covers`` names the registered spelling the case reaches, for the reader."""

    def fn(a, *rest):
        y = a * 1.0
        out = method(y, *extra, *rest, **kw) if extra_first else method(y, *rest, *extra, **kw)
        assert out is y
        return y

    return fn


def _is_float(a):
    return isinstance(a, T) and a.is_floating_point()


# -- table rows through the op_db harness's check ----------------------------------------------
Case = namedtuple("Case", "id fn args gradcheck tol")


def case(id, fn, *args, gradcheck=True, tol=TOL):
    """``fn(*args)``: floating tensors require grad, except those wrapped in ``Const``."""
    return Case(id, fn, args, gradcheck, tol)


def check_case(c):
    """Values, gradients and second derivatives vs torch (the op_db check), then gradcheck
    (unless ``c.gradcheck`` is False)."""
    from opdb_harness import check_sample  # loads op_db: only the files that check cases pay

    args = [a.t.clone() if isinstance(a, Const) else a.clone().requires_grad_() if _is_float(a) else a
            for a in c.args]
    sample = SimpleNamespace(input=args[0], args=tuple(args[1:]), kwargs={},
                             output_process_fn_grad=lambda out: out)
    assert check_sample(SimpleNamespace(op=c.fn), sample, torch.Generator().manual_seed(1), tol=c.tol)
    if c.gradcheck:
        assert gg.gradcheck(c.fn, [gg.as_tensor(a.detach().clone(), requires_grad=a.requires_grad)
                                   if isinstance(a, T) else a for a in args])


# -- checks on positional arguments -------------------------------------------------------------
def _both(fn, args, ref=None):
    """``ref`` (default ``fn``) on torch copies and ``fn`` on graphgrad copies of ``args``, every
    floating tensor requiring grad: the copies that require grad and the two outputs."""
    t_args = [a.clone().requires_grad_() if _is_float(a) else a for a in args]
    g_args = [gg.as_tensor(a.clone(), requires_grad=True) if _is_float(a) else a for a in args]
    want, have = (ref or fn)(*t_args), fn(*g_args)
    torch.testing.assert_close(plain(have), plain(want), **TOL)
    assert isinstance(have, gg.Tensor) and have.requires_grad
    return [a for a in t_args if _is_float(a)], [a for a in g_args if _is_float(a)], want, have


def check(fn, *args, ref=None, second_order=True):
    """``fn`` on graphgrad tensors and ``ref`` (default ``fn``) on torch tensors: values,
    gradients for a random upstream gradient, and (unless ``second_order`` is False) second
    derivatives w.r.t. the inputs and the upstream gradient."""
    t_in, g_in, want, have = _both(fn, args, ref)
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(want.shape, dtype=want.dtype, generator=gen)
    t_v, g_v = v.clone().requires_grad_(), gg.as_tensor(v.clone(), requires_grad=True)
    t_first = torch.autograd.grad(want, t_in, t_v, create_graph=second_order, allow_unused=True)
    g_first = gg.grad(have, g_in, g_v, create_graph=second_order, allow_unused=True)
    assert_grads_close(g_first, t_first, "gradient of input")
    keep = [k for k, g in enumerate(t_first) if g is not None and g.requires_grad]
    if not second_order or not keep:
        return
    ws = [torch.randn(t_first[k].shape, dtype=F64, generator=gen) for k in keep]
    t_second = torch.autograd.grad(sum((t_first[k] * w).sum() for k, w in zip(keep, ws)),
                                   t_in + [t_v], allow_unused=True)
    g_second = gg.grad(sum((g_first[k] * w).sum() for k, w in zip(keep, ws)), g_in + [g_v],
                       allow_unused=True)
    assert_grads_close(g_second, t_second, "second derivative w.r.t. input")


def check_to_order(fn, *args, order=2):
    """``fn`` on torch and on graphgrad tensors (every float tensor requires grad): values,
    then derivatives up to ``order``, each level differentiating the previous one's gradients
    (weighted by random tensors) w.r.t. the inputs and the upstream gradient."""
    t_in, g_in, want, have = _both(fn, args)
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(want.shape, dtype=F64, generator=gen)
    t_v, g_v = v.clone().requires_grad_(), gg.as_tensor(v.clone(), requires_grad=True)
    t_in, g_in = t_in + [t_v], g_in + [g_v]
    t_out, g_out = (want * t_v).sum(), (have * g_v).sum()
    for level in range(1, order + 1):
        more = level < order
        t_grads = torch.autograd.grad(t_out, t_in, create_graph=more, allow_unused=True)
        g_grads = gg.grad(g_out, g_in, create_graph=more, allow_unused=True)
        assert_grads_close(g_grads, t_grads, f"derivative {level} w.r.t. input")
        if not more:
            break
        keep = [k for k, t in enumerate(t_grads) if t is not None and t.requires_grad]
        if level == 1:
            for k in keep:
                assert g_grads[k] is not None and g_grads[k].requires_grad, f"gradient {k}"
        # deeper down, torch may mark a constant as requiring grad; the next level compares
        g_keep = [k for k in keep if g_grads[k] is not None and g_grads[k].requires_grad]
        if not g_keep:
            break
        ws = {k: torch.randn(t_grads[k].shape, dtype=F64, generator=gen) for k in keep}
        t_out = sum((t_grads[k] * ws[k]).sum() for k in keep)
        g_out = sum((g_grads[k] * ws[k]).sum() for k in g_keep)


# -- a check on a list of leaves ------------------------------------------------------------------
def _outputs(out):
    return [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]


def compare(fn, tensors, second_order=True, seed=0, *, tol=TOL, backend=None, create_graph=None,
            allow_unused=True):
    """``fn`` on torch leaves and on graphgrad leaves with the same values (floating tensors
    require grad, the others are passed as they are): outputs, gradients for a random upstream
    gradient (a leaf too), and (unless ``second_order`` is False) second derivatives w.r.t. the
    inputs and the upstream gradient. ``fn`` may return a tuple; None outputs are skipped.
    Returns graphgrad's output.

    ``backend``: an SDPBackend the torch reference runs under. ``create_graph``: for the first
    derivatives (default ``second_order``). ``allow_unused=False``: every input must reach the
    outputs."""
    gen = torch.Generator().manual_seed(seed)
    diff = [t.is_floating_point() for t in tensors]
    ts = [t.clone().requires_grad_(d) for t, d in zip(tensors, diff)]
    gs = [gg.as_tensor(t.clone(), requires_grad=d) for t, d in zip(tensors, diff)]
    with contextlib.nullcontext() if backend is None else sdpa_kernel(backend):
        want = _outputs(fn(*ts))
    out = fn(*gs)
    have = _outputs(out)
    assert len(want) == len(have)
    for h, w in zip(have, want):
        torch.testing.assert_close(plain(h), plain(w), **tol)
    ts = [t for t, d in zip(ts, diff) if d]
    gs = [g for g, d in zip(gs, diff) if d]
    vs = [torch.randn(w.shape, dtype=w.dtype, generator=gen) for w in want]
    vts = [v.clone().requires_grad_() for v in vs]
    vgs = [gg.as_tensor(v.clone(), requires_grad=True) for v in vs]
    create_graph = second_order if create_graph is None else create_graph
    gw = torch.autograd.grad(want, ts, vts, create_graph=create_graph, allow_unused=allow_unused)
    gh = gg.grad(have, gs, vgs, create_graph=create_graph, allow_unused=allow_unused)
    assert_grads_close(gh, gw, "gradient of input", tol)
    if not second_order:
        return out
    keep = [k for k, g in enumerate(gw) if g is not None and g.requires_grad]
    ws = [torch.randn(gw[k].shape, dtype=gw[k].dtype, generator=gen) for k in keep]
    g2w = torch.autograd.grad([gw[k] for k in keep], ts + vts, ws, allow_unused=True)
    g2h = gg.grad([gh[k] for k in keep], gs + vgs, [gg.as_tensor(w.clone()) for w in ws], allow_unused=True)
    assert_grads_close(g2h, g2w, "second derivative w.r.t. input", tol)
    return out


# -- complex tensors ----------------------------------------------------------------------------
C128 = torch.complex128


def _differentiable(a):
    return isinstance(a, T) and (a.is_floating_point() or a.is_complex())


def check_complex(fn, *args, second_order=True):
    """``fn(*args)``, floating and complex tensors requiring grad, through the op_db harness's
    check: values, gradients for a random upstream gradient of the output's dtype, and second
    derivatives w.r.t. the inputs and the upstream gradient, against torch.autograd."""
    from opdb_harness import check_sample

    args = [a.clone().requires_grad_() if _differentiable(a) else a for a in args]
    sample = SimpleNamespace(input=args[0], args=tuple(args[1:]), kwargs={},
                             output_process_fn_grad=lambda out: out)
    assert check_sample(SimpleNamespace(op=fn), sample, torch.Generator().manual_seed(1),
                        second_order)


def as_real_function(fn, args):
    """``fn`` on real tensors: each complex argument passed as ``view_as_real`` pairs, each
    complex output returned as such pairs. gg.gradcheck perturbs real numbers only; through
    these views it checks graphgrad's complex gradients (torch's convention) numerically."""
    is_complex = [isinstance(a, T) and a.is_complex() for a in args]

    def real_fn(*real_args):
        inner = [torch.view_as_complex(a) if c else a for a, c in zip(real_args, is_complex)]
        out = fn(*inner)
        outs = out if isinstance(out, tuple) else (out,)
        outs = tuple(torch.view_as_real(o.resolve_conj()) if o.is_complex() else o for o in outs)
        return outs if isinstance(out, tuple) else outs[0]

    real_args = [torch.view_as_real(a.detach().clone()) if c else a
                 for a, c in zip(args, is_complex)]
    return real_fn, real_args


def gradcheck_complex(fn, *args, second_order=True):
    """gg.gradcheck (and gg.gradgradcheck) of ``fn`` through ``as_real_function``."""
    real_fn, real_args = as_real_function(fn, args)
    leaves = [gg.as_tensor(a.detach().clone(), requires_grad=True) if _differentiable(a) else a
              for a in real_args]
    ok = gg.gradcheck(real_fn, leaves)
    if second_order:
        ok = ok and gg.gradgradcheck(real_fn, leaves)
    return ok
