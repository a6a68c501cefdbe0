"""Fuzzing forward mode with hypothesis: random programs on dual tensors, graphgrad against torch.

A program is a list of steps over a pool of tensors (float64, broadcasting shapes): unary and
binary elementwise ops, reductions, matmul, softmax, views (transpose, slicing, reshape,
unsqueeze), in-place ops on intermediates and through views, writing a dual into a slice of a
plain buffer, a custom Function with ``jvp`` and ``save_for_forward``, ``gg.checkpoint``
around a block, and ``no_grad`` regions. It runs twice, in a dual level each: on plain tensors
under ``torch.autograd.forward_ad`` and on graphgrad tensors under ``gg.forward_ad`` (or torch's
API, routed to graphgrad). After every step the values and tangents must match; a program ends
with forward over reverse (the tangent of ``gg.grad`` of a scalar) and reverse over forward (the
gradient of a tangent with respect to the primal and the tangent), compared with torch.

Each program is also run as a function of its leaves through ``gg.func.jacfwd`` and
``gg.func.hessian`` (all basis vectors in one pass, tangents batched by torch.vmap) against
torch's forward AD one column at a time.

CI runs 150 examples (60 batched; derandomized); ``--run-slow`` 1,500 (600);
``GRAPHGRAD_FUZZ_EXAMPLES=N`` runs N fresh ones (N / 4).
"""

import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import given
from hypothesis import strategies as st

import graphgrad as gg
from helpers import CubeWithJvp, fuzz_settings

TOL = dict(rtol=1e-8, atol=1e-8, equal_nan=True)

UNARY = {
    "sin": torch.sin, "exp": lambda x: torch.exp(x.clamp(max=5)), "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "square": torch.square, "abs": torch.abs, "relu": torch.relu,
    "log1p_abs": lambda x: torch.log1p(x.abs()), "neg": torch.neg, "gelu": torch.nn.functional.gelu,
    "softmax": lambda x: torch.softmax(x, -1), "cumsum": lambda x: torch.cumsum(x, -1),
    "sum_keep": lambda x: x.sum(-1, keepdim=True), "mean": lambda x: x.mean(),
    "max_dim": lambda x: x.max(-1, keepdim=True).values, "norm": lambda x: x.norm(dim=-1, keepdim=True),
    "logsumexp": lambda x: _logsumexp(x), "scale": lambda x: x * 0.5 + 1.0,
    "where": lambda x: torch.where(x > 0, x, x * 0.1), "clamp": lambda x: x.clamp(-0.5, 0.5),
}
def _atan2(a, b):
    if bool(((a == 0) & (b == 0)).any()):  # a documented difference (docs/reliability.md): at
        # (0, 0) torch's forward formula gives NaN, its backward 0; graphgrad follows each, and
        # the NaN then spreads differently through later ops' formulas: not drawn
        raise RuntimeError("atan2 at (0, 0): not compared")
    return torch.atan2(a, b)


def _logsumexp(x):
    if x.dim() and x.shape[-1] == 0:  # a documented difference (docs/reliability.md): over no
        # elements torch's tangent is its formula's 0 / 0 = NaN, graphgrad's 0; not drawn
        raise RuntimeError("logsumexp over no elements: not compared")
    return x.logsumexp(-1, keepdim=True)


BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul,
    "div": lambda a, b: a / (b.abs() + 1), "atan2": lambda a, b: _atan2(a, b), "maximum": torch.maximum,
    "hypot": torch.hypot,
}
VIEWS = {
    "t": lambda x: x.transpose(-1, -2), "slice": lambda x: x[..., 1:], "unsq": lambda x: x.unsqueeze(0),
    "flat": lambda x: x.reshape(-1), "expand": lambda x: x.unsqueeze(0).expand(2, *x.shape),
    "select": lambda x: x.select(-1, 0),
}
INPLACE = ("mul_", "add_", "sin_", "clamp_", "copy_")


def _block(x):
    return (x.sin() * x).tanh() + x.exp().clamp(max=3)


SHAPES = [(3, 4), (4,), (1, 4), (3, 1), ()]


@st.composite
def programs(draw):
    n_leaves = draw(st.integers(1, 3))
    shapes = [draw(st.sampled_from(SHAPES[:3])) for _ in range(n_leaves)]
    steps = []
    for _ in range(draw(st.integers(2, 10))):
        kind = draw(st.sampled_from(["unary"] * 4 + ["binary"] * 3 + ["view", "inplace", "matmul",
                                                                          "function", "checkpoint",
                                                                          "buffer", "no_grad"]))
        steps.append((kind, draw(st.sampled_from(sorted(UNARY))), draw(st.sampled_from(sorted(BINARY))),
                      draw(st.sampled_from(sorted(VIEWS))), draw(st.sampled_from(INPLACE)),
                      draw(st.integers(0, 1000)), draw(st.integers(0, 1000))))
    return {"shapes": shapes, "seed": draw(st.integers(0, 2**16)), "steps": steps,
            "torch_api": draw(st.booleans()), "requires_grad": draw(st.booleans())}


class Side:
    """One engine: its forward-AD module, how it makes a tensor, how it reads a tangent."""

    def __init__(self, graphgrad: bool, torch_api: bool):
        self.gg = graphgrad
        self.api = fwAD if (torch_api or not graphgrad) else gg.forward_ad

    def tensor(self, t, requires_grad=False):
        t = t.clone()
        if self.gg:
            return gg.as_tensor(t, requires_grad=requires_grad)
        return t.requires_grad_(requires_grad)

    def checkpoint(self, fn, x):
        if self.gg:
            return gg.checkpoint(fn, x)
        return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)

    def grad(self, *args, **kwargs):
        return (gg.grad if self.gg else torch.autograd.grad)(*args, **kwargs)


def _run(program, side):
    gen = torch.Generator().manual_seed(program["seed"])
    primals = [torch.randn(s, dtype=torch.float64, generator=gen) for s in program["shapes"]]
    tangents = [torch.randn(s, dtype=torch.float64, generator=gen) for s in program["shapes"]]
    trace = []
    with side.api.dual_level():
        leaves = [side.tensor(p, program["requires_grad"]) for p in primals]
        pool = [side.api.make_dual(p, side.tensor(t)) for p, t in zip(leaves, tangents)]
        for step in program["steps"]:
            try:
                out = _step(side, step, pool)
            except (RuntimeError, IndexError) as error:  # a shape the op refuses: on both sides
                trace.append(("error", type(error).__name__))
                continue
            pool.append(out)
            p, t = side.api.unpack_dual(out)
            trace.append((torch.Tensor(p.detach()).clone(),
                          None if t is None else torch.Tensor(t.detach()).clone()))
        # forward over reverse, then reverse over forward
        scalar = None
        if program["requires_grad"]:
            scalar = sum(o.sin().sum() for o in pool[len(leaves):] if o.requires_grad)
        if scalar is not None and isinstance(scalar, torch.Tensor) and scalar.requires_grad:
            try:
                grads = side.grad(scalar, leaves, allow_unused=True)
            except RuntimeError as error:  # a saved value changed in place since: both refuse
                trace.append(("error", type(error).__name__))
            else:
                trace.append(("hvp", [None if g is None else side.api.unpack_dual(g).tangent
                                      for g in grads]))
    return trace


def _step(side, step, pool):
    kind, u, b, v, ip, i, j = step
    x, y = pool[i % len(pool)], pool[j % len(pool)]
    if kind == "unary":
        out = UNARY[u](x)
    elif kind == "binary":
        out = BINARY[b](x, y)
    elif kind == "view":
        out = VIEWS[v](x) * 1.0 if x.dim() else x * 1.0
    elif kind == "inplace":
        out = x * 1.0  # a non-leaf to change
        target = out[..., :1] if out.dim() and i % 2 else out
        if ip == "copy_":
            target.copy_(torch.sin(y).expand_as(target) if y.dim() <= target.dim()
                         and torch.broadcast_shapes(y.shape, target.shape) == target.shape
                         else target.cos())
        elif ip == "sin_":
            target.sin_()
        elif ip == "clamp_":
            target.clamp_(-0.7, 0.7)
        else:
            fits = torch.broadcast_shapes(y.shape, target.shape) == target.shape
            getattr(target, ip)(y if fits else y.sum())
    elif kind == "matmul":
        a = x if x.dim() == 2 else x.reshape(1, -1)
        out = a @ a.transpose(-1, -2).tanh()
    elif kind == "function":  # (on a graphgrad tensor: torch's own apply refuses a Function
        # without setup_context under vmap, in gg.func.jacfwd as in torch.func.jacfwd)
        out = CubeWithJvp.apply(side.tensor(x) if side.gg and type(x) is torch.Tensor else x)
    elif kind == "checkpoint":
        out = side.checkpoint(_block, x)
    elif kind == "buffer":  # (a plain torch buffer, or a graphgrad one; read again, or not)
        # (filled with 0.5, not 0: exact zeros make 0/0 points, hypot's and atan2's, whose NaN
        # tangents torch's and graphgrad's maximum spread differently; docs/reliability.md)
        buf = torch.full((2,) + tuple(x.shape), 0.5, dtype=torch.float64)
        buf = buf if j % 2 else side.tensor(buf)
        buf[1] = x.sin()
        out = buf.cumsum(0) if i % 2 else buf
    else:  # no_grad: forward mode goes on
        with torch.no_grad():
            out = UNARY[u](x)
    return out


def _same(a, b, where):
    if any(isinstance(side[0], str) and side[0] == "error" for side in (a, b)):
        assert a == b, f"{where}: {a} vs {b}"
        return
    if isinstance(a, tuple) and a and isinstance(a[0], str):
        for x, y in zip(a[1], b[1]):
            if y is None:
                assert x is None or not torch.Tensor(x).abs().sum(), where
            else:
                assert x is not None, where
                torch.testing.assert_close(torch.Tensor(x.detach()), y.detach(), **TOL, msg=where)
        return
    torch.testing.assert_close(a[0], b[0], **TOL, msg=f"{where}: values")
    if b[1] is None:
        assert a[1] is None or not a[1].abs().sum(), f"{where}: a tangent where torch has none"
    else:
        assert a[1] is not None, f"{where}: no tangent"
        torch.testing.assert_close(a[1], b[1], **TOL, msg=f"{where}: tangents")


def run_program(program):
    want = _run(program, Side(False, False))
    got = _run(program, Side(True, program["torch_api"]))
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        _same(g, w, f"step {k} ({program['steps'][k][0] if k < len(program['steps']) else 'hvp'})")


def test_random_dual_programs_match_torch_forward_ad(request):
    n, fuzz = fuzz_settings(request.config, ci=150, slow=1500)

    @fuzz
    @given(programs())
    def check(program):
        run_program(program)

    check()


# -- batched: gg.func.jacfwd and hessian (all basis vectors in one vmapped pass) ------------
class _Plain(Side):
    """A program as a function of its leaves (no dual level of its own: jacfwd makes them)."""

    def __init__(self, graphgrad: bool):
        super().__init__(graphgrad, False)

    def tensor(self, t, requires_grad=False):
        return gg.as_tensor(t.clone()) if self.gg else t


def _as_function(program, side):
    def f(*leaves):
        pool = list(leaves)
        for step in program["steps"]:
            try:
                out = _step(side, step, pool)
            except (RuntimeError, IndexError) as error:  # a shape the op refuses (torch too)
                if "vmap" in str(error):
                    raise
                continue
            pool.append(out)
        return tuple(pool[len(leaves):]) or (leaves[0] * 1.0,)
    return f


def _sum_of_sines(f):
    return lambda *leaves: sum(o.sin().sum() for o in f(*leaves))


def _columns(primals):
    """Each standard basis vector of the leaves' joint space, split into one tensor per leaf."""
    numels = [p.numel() for p in primals]
    for row in torch.eye(sum(numels), dtype=torch.float64):
        yield [part.reshape(p.shape) for part, p in zip(row.split(numels), primals)]


def _torch_jacobian(f, primals):
    """The Jacobian by torch's forward AD, one column (one unbatched pass) at a time."""
    cols = []
    for basis in _columns(primals):
        with fwAD.dual_level():
            outs = f(*[fwAD.make_dual(p, e) for p, e in zip(primals, basis)])
            cols.append([torch.zeros_like(o) if fwAD.unpack_dual(o).tangent is None
                         else fwAD.unpack_dual(o).tangent.clone() for o in outs])
    numels = [p.numel() for p in primals]
    result = []
    for j, o in enumerate(outs):
        stacked = torch.stack([c[j] for c in cols], -1).split(numels, -1)
        result.append([s.reshape(o.shape + p.shape) for s, p in zip(stacked, primals)])
    return result


def _torch_hessian_block(s, primals, a, b):
    """d^2 s / (d primals[a] d primals[b]) by torch, forward over reverse, one column a pass."""
    cols = []
    for basis in _columns([primals[b]]):
        with fwAD.dual_level():
            call = list(primals)
            call[a] = pa = primals[a].clone().requires_grad_()
            call[b] = fwAD.make_dual(call[b], basis[0])
            (g,) = torch.autograd.grad(s(*call), pa, allow_unused=True)
            t = None if g is None else fwAD.unpack_dual(g).tangent
            cols.append(torch.zeros_like(pa) if t is None else t.detach().clone())
    return torch.stack([c.reshape(-1) for c in cols], -1).reshape(primals[a].shape + primals[b].shape)


def run_batched(program, stats):
    gen = torch.Generator().manual_seed(program["seed"])
    primals = [torch.randn(s, dtype=torch.float64, generator=gen) for s in program["shapes"]]
    argnums = tuple(range(len(primals)))
    want = _torch_jacobian(_as_function(program, _Plain(False)), primals)
    got = gg.func.jacfwd(_as_function(program, _Plain(True)), argnums)(*primals)
    for j, (go, wo) in enumerate(zip(got, want)):
        for a, (g, w) in enumerate(zip(go, wo)):
            torch.testing.assert_close(torch.Tensor(g), w, **TOL, msg=f"jacfwd: output {j}, input {a}")
    stats["jacobians"] += 1
    s_torch, s_gg = (_sum_of_sines(_as_function(program, _Plain(side))) for side in (False, True))
    try:
        want = [[_torch_hessian_block(s_torch, primals, a, b) for b in argnums] for a in argnums]
    except RuntimeError:  # torch's reverse pass refuses (a saved value changed in place)
        return
    got = gg.func.hessian(s_gg, argnums)(*primals)
    for a in argnums:
        for b in argnums:
            torch.testing.assert_close(torch.Tensor(got[a][b]), want[a][b], **TOL, msg=f"hessian {a}, {b}")
    stats["hessians"] += 1


def test_random_programs_batched_jacfwd_and_hessian_match_torch(request):
    """Every program as a function: gg.func.jacfwd and hessian (one vmapped pass: batched
    tangents through in-place ops, plain buffers, custom Functions, checkpoint) against torch's
    forward AD column by column."""
    n, fuzz = fuzz_settings(request.config, ci=60, slow=600, fresh_divisor=4)
    stats = {"jacobians": 0, "hessians": 0}

    @fuzz
    @given(programs())
    def check(program):
        run_batched(program, stats)

    check()
    assert stats["jacobians"] >= n and stats["hessians"] >= n // 3, stats


def test_the_comparison_can_fail():
    program = {"shapes": [(3, 4)], "seed": 1, "torch_api": False, "requires_grad": True,
               "steps": [("unary", "sin", "add", "t", "mul_", 0, 0)]}
    run_program(program)
    good = UNARY["sin"]
    UNARY["sin"] = lambda x: torch.sin(x) if not isinstance(x, gg.Tensor) else torch.cos(x)
    try:
        try:
            run_program(program)
        except AssertionError:
            return
        raise RuntimeError("a different value went unnoticed")
    finally:
        UNARY["sin"] = good
