"""The fuzzer's programs and their interpreter (tests/engine/test_fuzz.py says what it checks).

A program is ``{"base": (a, b), "leaves": [(shape code, requires_grad)], "seed", "quantized",
"special", "steps": [(step, under_no_grad)]}``; tensor indices in steps count back from the
newest tensor, modulo the number of tensors, so any list of steps is a valid program.
Custom Functions, checkpoints and hooks are in tests/engine/fuzz_autograd.py.
"""

import collections
import contextlib
import re
import warnings

import torch
import torch.nn.functional as F

import graphgrad as gg
from fuzz_autograd import assert_same_log, checkpoint, fn, register, saved_tensors_hooks
from helpers import TOL_NAN as TOL
from helpers import plain_view as plain

DT = torch.float64
STATS: collections.Counter = collections.Counter()  # figures, read by the test


def _set0(t, v):
    t[0] = v.sum() if v.dim() else v


UNARY = {
    "sin": torch.sin, "cos": lambda t: t.cos(), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "exp": lambda t: t.clamp(-4, 4).exp(), "neg": lambda t: -t, "abs": torch.abs, "relu": F.relu,
    "square": torch.square, "sqrt": lambda t: (t * t + 1).sqrt(), "log1p": lambda t: t.abs().log1p(),
    "softplus": F.softplus, "gelu": F.gelu, "silu": F.silu, "clamp": lambda t: t.clamp(-0.5, 0.5),
    "pow3": lambda t: t.clamp(-2, 2) ** 3, "rpow": lambda t: 2 ** t.clamp(-3, 3),
    "scalars": lambda t: (t * 0.5 + 1) / 3 - 0.25, "clone": torch.clone, "cumsum": lambda t: t.cumsum(-1),
    "softmax": lambda t: t.softmax(-1), "log_softmax": lambda t: F.log_softmax(t, -1),
    "where": lambda t: torch.where(t > 0, t, t * 0.1), "erf": torch.erf, "atan": torch.atan,
    "flip": lambda t: t.flip(-1), "f32": lambda t: t.float().double(), "sign_mul": lambda t: t * t.sign(),
    "sgn_sqrt": lambda t: (t.abs() ** 0.5).sgn(), "pow_half": lambda t: t.abs() ** 0.5,
    "nan_to_num": lambda t: torch.nan_to_num(t.log(), nan=0.5, posinf=2.0),
    "hardtanh": lambda t: F.hardtanh(t, -0.5, 0.5), "erfinv": lambda t: (t * 0.5).tanh().erfinv(),
    # outputs that are views of a temporary of the kernel's own
    "avg_pool": lambda t: F.avg_pool1d(t.reshape(1, 1, -1), 1),
    # (not over no elements: torch's path then keeps nothing, graphgrad the input; documented)
    "instance_norm": lambda t: F.instance_norm(t.reshape(1, 1, -1)) if t.numel() > 1 else t * 1,
    # custom Functions (tests/engine/fuzz_autograd.py): saving inputs or outputs, two outputs
    "fn_square": lambda t: fn("Square", t).apply(t), "fn_exp": lambda t: fn("Exp", t).apply(t),
    "fn_two": lambda t: fn("Two", t).apply(t)[0], "fn_two_nondiff": lambda t: fn("Two", t).apply(t)[1],
    # (non-differentiable outputs saved with save_for_backward)
    "fn_keep_mask": lambda t: fn("KeepMask", t).apply(t)[0],
    "fn_keep_mask1": lambda t: fn("KeepMask", t).apply(t)[1],
    "fn_keep_out": lambda t: fn("KeepOut", t).apply(t)[1],
    "fn_keep_out0": lambda t: fn("KeepOut", t).apply(t)[0],
    "ckpt": lambda t: checkpoint(lambda a: a.sin() * a, t),
    "ckpt_nested": lambda t: checkpoint(lambda a: checkpoint(lambda b: b.tanh().exp(), a) * a, t),
}
BINARY = {
    "add": torch.add, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b * b + 1), "maximum": torch.maximum, "minimum": torch.minimum,
    "lerp": lambda a, b: torch.lerp(a, b, 0.3), "hypot": torch.hypot, "matmul": torch.matmul,
    "where": lambda a, b: torch.where(a > b, a, b), "cat": lambda a, b: torch.cat([a, b], -1),
    "stack": lambda a, b: torch.stack([a, b]), "addcmul": lambda a, b: torch.addcmul(a, a, b, value=0.5),
    "logaddexp": torch.logaddexp, "rsub": lambda a, b: 1 - a * b, "atan2": torch.atan2,
    "outer_t": lambda a, b: torch.einsum("i,j->ji", a.reshape(-1), b.reshape(-1)),
    "huber": lambda a, b: F.huber_loss(a, b, delta=0.5), "smooth_l1": F.smooth_l1_loss,
    "l1": F.l1_loss, "mse": F.mse_loss, "max2": torch.max, "pow": lambda a, b: a.abs() ** b,
    "fn_pair": lambda a, b: fn("Pair", a).apply(a, b)[0],
    "fn_pair1": lambda a, b: fn("Pair", a).apply(a, b)[1],
    "ckpt2": lambda a, b: checkpoint(lambda x, y: x * y.sin() + x, a, b),
}
REDUCE = {
    "sum": lambda t: t.sum(), "sum0": lambda t: t.sum(0), "sum_keep": lambda t: t.sum(-1, keepdim=True),
    "mean": lambda t: t.mean(-1), "amax": lambda t: t.amax(-1), "max_all": lambda t: t.max(),
    "prod": lambda t: t.prod(-1), "norm": lambda t: t.norm(), "logsumexp": lambda t: t.logsumexp(-1),
    "var": lambda t: t.var(-1, correction=0), "min_all": lambda t: t.min(),
    "max_dim": lambda t: t.max(-1).values, "min_dim": lambda t: t.min(0)[0],
    "std_mean_mean": lambda t: torch.std_mean(t, -1, correction=0)[1],
    "std_mean_std": lambda t: torch.std_mean(t, 0, correction=0)[0],
}
VIEW = {
    "select": lambda t: t[0], "slice": lambda t: t[..., :1], "unsqueeze": lambda t: t.unsqueeze(0),
    "transpose": lambda t: t.transpose(0, -1), "reshape": lambda t: t.reshape(-1),
    "view": lambda t: t.view(-1), "expand": lambda t: t.expand(2, *t.shape),
    "diagonal": lambda t: t.diagonal(), "narrow": lambda t: t.narrow(-1, 0, 1),
    "squeeze": lambda t: t.squeeze(), "permute": lambda t: t.permute(*reversed(range(t.dim()))),
    "split": lambda t: t.split(1, -1)[0], "unbind": lambda t: t.unbind(0)[-1],
    "chunk": lambda t: t.chunk(2, -1)[-1], "mT": lambda t: t.mT, "as_is": lambda t: t.view_as(t),
    "tensor_split": lambda t: t.tensor_split(2, -1)[0],
    "fn_identity": lambda t: fn("Identity", t).apply(t), "fn_view": lambda t: fn("View", t).apply(t),
}
INPLACE = {
    "add_": lambda t, o: t.add_(o), "mul_": lambda t, o: t.mul_(o), "sub_": lambda t, o: t.sub_(o),
    "sin_": lambda t, o: t.sin_(), "tanh_": lambda t, o: t.tanh_(), "relu_": lambda t, o: t.relu_(),
    "clamp_": lambda t, o: t.clamp_(-0.5, 0.5), "div_": lambda t, o: t.div_(2.0),
    "exp_": lambda t, o: t.clamp_(-3, 3).exp_(), "sigmoid_": lambda t, o: t.sigmoid_(),
    "setitem": _set0, "fill0": lambda t, o: t.masked_fill_(t > 0, 0.0), "iadd": lambda t, o: t.__iadd__(o),
    "copy_": lambda t, o: t.copy_(o), "zero_": lambda t, o: t.zero_(),
    "fn_dirty": lambda t, o: fn("Dirty", t).apply(t),
}


# -- the step kinds that found the divergences of issue 39 -----------------------------------
def _letters(t):
    return "ijkl"[:t.dim()]


def _einsum_diag(t):
    """``ii->i`` (``iij->ji`` on 3 dims): a diagonal, a view of the operand in torch."""
    if t.dim() < 2:
        return torch.einsum("i->i" if t.dim() else "->", t)
    rest = "jk"[:t.dim() - 2]
    return torch.einsum(f"ii{rest}->{rest[::-1]}i", t)


#: einsum equations whose result is the operand rearranged: torch returns a view of it
EINSUM = {
    "perm": lambda t: torch.einsum(f"{_letters(t)}->{_letters(t)[::-1]}", t),  # ij->ji, ijk->kji
    "identity": lambda t: torch.einsum(f"{_letters(t)}->{_letters(t)}", t),  # i->i, ij->ij
    "implicit": lambda t: torch.einsum(_letters(t)[::-1], t),  # 'ji': the output sorted, ij
    "diag": _einsum_diag,
    "ellipsis": lambda t: torch.einsum("i...->...i" if t.dim() else "...->...", t),
}
EINSUM_TARGETS = ("result", "result", "operand", "operand", "none")


def _fit(o, n, shape=None):
    """A weight or bias of ``n`` elements made from tensor ``o`` (its elements, then ones);
    ``o`` may be None, or ``"ones"`` (see ``Interpreter.double``)."""
    if o is None:
        return None
    if isinstance(o, str):
        w = torch.ones(n, dtype=DT)
    else:
        w = torch.cat([o.reshape(-1), torch.ones(n, dtype=DT)])[:n]
    return w if shape is None else w.reshape(shape)


def _layer_norm(x, w, b):
    x = x if x.dim() else x.reshape(1)
    n = x.shape[-1]
    return F.layer_norm(x, (n,), _fit(w, n), _fit(b, n))


def _layer_norm2(x, w, b):  # over the last two dimensions (or one)
    shape = x.shape[-2:]
    n = shape.numel()
    return F.layer_norm(x, shape, _fit(w, n, shape), _fit(b, n, shape))


def _ncl(x):
    """x as (N=1, C, L) for group and instance norm."""
    return x.reshape(1, x.shape[0] if x.dim() else 1, -1)


def _group_norm(x, w, b, per_channel=False):
    x = _ncl(x)
    c = x.shape[1]
    return F.group_norm(x, c if per_channel else 1, _fit(w, c), _fit(b, c))


def _batch_norm(x, w, b, stats=False):
    x = x if x.dim() == 2 else x.reshape(-1, 1)
    c = x.shape[1]
    mean, var = (torch.zeros(c, dtype=DT), torch.ones(c, dtype=DT)) if stats else (None, None)
    return F.batch_norm(x, mean, var, _fit(w, c), _fit(b, c), training=True)


def _instance_norm(x, w, b):
    x = _ncl(x)
    c = x.shape[1]
    return F.instance_norm(x, weight=_fit(w, c), bias=_fit(b, c))


#: ops differentiated twice at once (``double`` steps): f(x, weight or None, bias or None)
DOUBLE = {
    "layer_norm": _layer_norm, "layer_norm2": _layer_norm2, "group_norm": _group_norm,
    "group_norm_c": lambda x, w, b: _group_norm(x, w, b, per_channel=True),
    "batch_norm": _batch_norm, "batch_norm_stats": lambda x, w, b: _batch_norm(x, w, b, stats=True),
    "instance_norm": _instance_norm,
    # custom Functions whose non-differentiable output is saved (w and b unused)
    "fn_keep_mask": lambda x, w, b: fn("KeepMask", x).apply(x)[0],
    "fn_keep_out": lambda x, w, b: fn("KeepOut", x).apply(x)[1],
}
WEIGHTLESS = {"fn_keep_mask", "fn_keep_out"}
AFFINE = ("none", "weight", "bias", "both")  # "bias": weight=None with a bias given
SECOND = ("none", "grad", "grad", "backward")  # what differentiates the gradients again


def _2d(t):
    return t if t.dim() == 2 else t.reshape(1, -1)


#: rules whose gradient has structural zeros (entries no incoming gradient reaches), met by an
#: incoming gradient that overflowed to inf or NaN: torch writes zeros there, not inf * 0
ZERO_RULES = {
    "trace": lambda t: torch.trace(_2d(t)),
    "diag": lambda t: torch.diag(t if t.dim() in (1, 2) else t.reshape(-1)),
    "diag_embed": torch.diag_embed, "diagonal": lambda t: _2d(t).diagonal(),
    "tril": lambda t: _2d(t).tril(), "triu": lambda t: _2d(t).triu(1),
    "masked_fill": lambda t: t.masked_fill(t > 0, 0.0), "where0": lambda t: torch.where(t > 0, t, 0.0),
    "amax": lambda t: t.amax(-1), "max_all": lambda t: t.max(), "min_dim": lambda t: t.min(-1).values,
    "relu": F.relu, "hardtanh": lambda t: F.hardtanh(t, -0.5, 0.5), "clamp": lambda t: t.clamp(min=0.0),
    "abs": torch.abs, "getitem": lambda t: t[0] if t.dim() else t * 1, "slice": lambda t: t[..., :1],
    "index": lambda t: t.reshape(-1)[[0, 0]], "index_select": lambda t: t.index_select(-1, torch.tensor([0])),
    "pad": lambda t: F.pad(t, (1, 1)), "sort": lambda t: t.sort(-1).values,
    "topk": lambda t: t.reshape(-1).topk(1).values, "cummax": lambda t: t.cummax(-1).values,
    "median": lambda t: t.median(), "max_pool": lambda t: F.max_pool1d(t.reshape(1, 1, -1), 2),
    "leaky_relu": lambda t: F.leaky_relu(t, 0.0), "dropout_eval": lambda t: F.dropout(t, 0.5, training=False),
}
#: what makes the incoming gradient overflow
OVERFLOW = {
    "exp800": lambda y: (800 * y).exp(),  # a step: 0 below zero, inf above 0.9
    "big": lambda y: y * 1e308 * 4,  # finite 1e308 * 4 overflows to an inf gradient
    "inf": lambda y: y * float("inf"),
    "sqrt0": lambda y: (y * 0).sqrt(),  # sqrt's derivative at 0: inf (and inf * 0: NaN)
}
OVERFLOW_HOW = ("backward", "grad", "grad_create", "none")

#: views that overlap themselves (several elements, one memory location) and some that do not
OVERLAP = {
    "unfold": lambda t: t.unfold(-1, 2, 1), "unfold_flat": lambda t: t.reshape(-1).unfold(0, 2, 1),
    "unfold_3": lambda t: t.reshape(-1).unfold(0, 3, 1),
    "unfold_no_overlap": lambda t: t.unfold(-1, 1, 1), "unfold_gaps": lambda t: t.reshape(-1).unfold(0, 1, 2),
    "as_strided": lambda t: t.as_strided((2, 2), (1, 1)),
    "as_strided_zero": lambda t: t.as_strided((2,), (0,)),
    "as_strided_same": lambda t: t.as_strided(t.shape, t.stride()),
    "as_strided_rows": lambda t: t.as_strided((2, 2), (1, 2)),  # no overlap, transposed
}
OVERLAP_INPLACE = ("add_", "mul_", "sin_", "relu_", "div_", "setitem", "copy_", "zero_", "fill0", "iadd",
                   "fn_dirty")


#: a tensor with a Python number or a 0-d tensor (``s``)
NUMBER = {
    "add": lambda t, s: t + s, "radd": lambda t, s: s + t, "sub": lambda t, s: t - s,
    "rsub": lambda t, s: s - t, "mul": lambda t, s: t * s, "rmul": lambda t, s: s * t,
    "div": lambda t, s: t / s, "rdiv": lambda t, s: s / (t * t + 1), "pow": lambda t, s: t ** s,
    "pow_pos": lambda t, s: (t.abs() + 0.5) ** s, "rpow": lambda t, s: s ** t,
    "add_alpha": lambda t, s: torch.add(t, s, alpha=2), "sub_alpha": lambda t, s: torch.sub(s, t, alpha=0.5),
    "clamp_min": lambda t, s: t.clamp(min=s), "where": lambda t, s: torch.where(t > 0, t, s),
    "lerp": lambda t, s: torch.lerp(t, t.sin(), s), "cmp_mul": lambda t, s: t * (t > s),
    "fmod": lambda t, s: torch.fmod(t, s), "remainder": lambda t, s: t.remainder(s),
    "floor_div": lambda t, s: torch.div(t, s, rounding_mode="floor"),
    "twice": lambda t, s: (t * s).sum() * s + s, "iadd": lambda t, s: t.clone().__iadd__(s),
    "imul": lambda t, s: t.clone().__imul__(s), "add_": lambda t, s: t.add_(s),
    "mul_": lambda t, s: t.mul_(s),
    "sigmoid_mix": lambda t, s: torch.sigmoid(t * s) - s,
}
NUMBERS = (0, 1, 2, -1, 3, 0.5, -1.5, 2.5, 1e-3, True)
#: s is: a Python number; a 0-d tensor (plain torch, or a graphgrad tensor, float64 or int64)
#: without grad; a new 0-d leaf that requires grad
NUMBER_FORMS = ("py", "py", "t0", "t0_gg", "t0_int", "t0_leaf", "t0_leaf")

BROADCASTING_LOSSES = {"huber", "smooth_l1", "mse"}
ALIASING = (VIEW, EINSUM, OVERLAP)  # tables of ops whose result may be a view of the input
USES_OTHER = {"add_", "mul_", "sub_", "setitem", "iadd", "copy_"}
HOOK_KINDS = ("tensor", "post_acc", "pre", "post")
MULTI_OUTPUT_VIEWS = {"split", "unbind", "chunk"}
FUNCTION_VIEWS = {"fn_identity", "fn_view"}  # views a custom Function returned
KEPT_ONLY_BY_TORCH = {"avg_pool", "cummax"}  # torch keeps the input, graphgrad its shape (documented)
# graphgrad's as_strided rule keeps its input, torch its geometry (documented)
KEPT_ONLY_BY_GRAPHGRAD = {"as_strided", "as_strided_zero", "as_strided_same", "as_strided_rows"}
ERROR_KINDS = ("second time", "modified by an inplace operation", "leaf Variable that requires grad",
               "implicitly created only for scalar outputs", "does not require grad",
               "not have been used in the graph", "Mismatch in shape", "you can only change requires_grad",
               "custom Function", "no_grad mode", "returns multiple views",
               "detached in-place", "Can't detach views in-place", "can't replace a None gradient",
               "materialize_grads", "moved into the graph interior")
# the same complaint in other words (torch's backward(inputs=[t]) on a t without grad: the first)
SYNONYMS = {"requires_grad=False": "does not require grad",
            # torch's words for an output of split/chunk/unbind whose storage was changed
            "another view of its base has been modified inplace": "modified by an inplace operation"}
# graphgrad checks these misuses before the kernel validates its arguments; torch after.
PRE_CHECKS = ("leaf Variable that requires grad", "returns multiple views", "no_grad mode", "custom Function")
# a backward through a graph with several broken nodes: each library may name another first
BROKEN_GRAPH = ("second time", "modified by an inplace operation", "detached in-place",
                "moved into the graph interior")



# -- the interpreter --------------------------------------------------------------------------
class Side:
    """One run of a program: graphgrad's (``gg=True``) or torch's."""

    def __init__(self, program, is_gg):
        self.is_gg = is_gg
        self.env, self.leaves = [], []
        self.log = []  # hook calls (tests/engine/fuzz_autograd.py)
        a, b = program["base"]
        shapes = [(a, b), (b,), (1, b), (a, 1), (), (0,), (a, 0)]
        gen = torch.Generator().manual_seed(program["seed"])
        for code, requires_grad in program["leaves"]:
            data = torch.rand(shapes[code], dtype=DT, generator=gen) * 3 - 1.5
            if program["quantized"]:  # zeros and ties: the edges of max, abs, relu...
                data = (data * 2).round() / 2
            if program.get("special") and data.numel():  # NaN, infinities and zeros
                data.view(-1)[0] = (float("nan"), float("inf"), -float("inf"), 0.0)[program["seed"] % 4]
            t = (gg.as_tensor(data, requires_grad=requires_grad) if is_gg
                 else data.requires_grad_(requires_grad))
            self.env.append(t)
            self.leaves.append(t)


#: nodes named differently that have the same inputs in both libraries (graphgrad's, torch's)
_SAME_NODE = {("Getitem", "Select"), ("Getitem", "Slice"), ("Getitem", "Index"),
              ("Max", "Maximum"), ("Min", "Minimum"), ("To", "ToCopy"),
              ("VectorNorm", "LinalgVectorNorm")}


def _same_node_kind(g_node, t_node) -> bool:
    kg, kt = _node_kind(g_node), _node_kind(t_node)
    return kg == kt or (kg, kt) in _SAME_NODE


def _expands_inputs_only_in_torch(g_node, t_node) -> bool:
    """Did torch's node take an expanded view of an input where graphgrad's took the input
    (mse/huber/smooth_l1 with broadcasting arguments, documented)? Its hooks then see other
    shapes."""
    g_next, t_next = g_node.next_functions, t_node.next_functions
    if len(g_next) != len(t_next):
        return False
    for (g, _), (t, _) in zip(g_next, t_next):
        if t is not None and _node_kind(t) == "Expand" and (g is None or _node_kind(g) != "Expand"):
            return True
    return False


def _node_kind(node) -> str:
    """A node's name without torch's namespace and overload number (``MulBackward0`` -> ``Mul``)."""
    name = node.name().rsplit("::", 1)[-1]
    return re.sub(r"Backward\d*$", "", name)


def _records_sgn(tensors) -> bool:
    """Does the graph of ``tensors`` hold a sgn node? Under create_graph=True a rule records
    its formula, and some formulas call sgn (abs's ``grad * input.sgn()``): a later pass
    through that node gets sgn's known zero, as after a sgn op (see check_grads)."""
    todo = [t.grad_fn for t in tensors if t is not None and t.grad_fn is not None]
    seen = set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if _node_kind(node) == "Sgn":
            return True
        todo.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return False


def kind_of(exc):
    text = str(exc)
    for words, kind in SYNONYMS.items():
        text = text.replace(words, kind)
    return type(exc).__name__, next((k for k in ERROR_KINDS if k in text), "other")


class StopProgram(Exception):
    """The two graphs part ways (torch refused a second backward that graphgrad allows, or a
    known bug was met): the program ends here."""


def run_both(fn_g, fn_t, backward=False):
    """Run torch's side, then graphgrad's; both must succeed or both raise the same kind.

    Returns (ok, graphgrad's result, torch's result, torch's error kind)."""
    try:
        out_t, exc_t = fn_t(), None
    except Exception as e:
        out_t, exc_t = None, e
    try:
        out_g, exc_g = fn_g(), None
    except Exception as e:
        out_g, exc_g = None, e
    if isinstance(exc_g, gg.MemoryBudgetError):  # graphgrad's side only: the program ends here
        raise exc_g
    if exc_t is None and exc_g is not None:
        raise AssertionError(f"graphgrad raised where torch did not: {exc_g!r}") from exc_g
    if exc_t is not None and exc_g is None:
        raise AssertionError(f"graphgrad did not raise where torch raised {exc_t!r}")
    if exc_t is None:
        return True, out_g, out_t, None
    kind_t, kind_g = kind_of(exc_t), kind_of(exc_g)
    if kind_t[1] == "other" and kind_g[1] in PRE_CHECKS:
        STATS["errors_checked_in_another_order"] += 1  # e.g. x[0] = 1 on a 0-d leaf
    elif backward and kind_t != kind_g and {kind_t[1], kind_g[1]} <= set(BROKEN_GRAPH):
        STATS["errors_checked_in_another_order"] += 1  # two broken nodes: another is named first
    else:
        assert kind_g == kind_t, f"graphgrad: {exc_g!r}\ntorch: {exc_t!r}"
    STATS["errors_matched"] += 1
    STATS["error " + " / ".join(kind_t)] += 1
    return False, None, None, kind_t[1]


def other_requires_grad(name, other) -> bool:
    return name in USES_OTHER and isinstance(other, torch.Tensor) and other.requires_grad


def _storage_positions(t):
    at = torch.full((), t.storage_offset(), dtype=torch.long)
    for n, stride in zip(t.shape, t.stride()):
        at = at.unsqueeze(-1) + torch.arange(n) * stride
    return set(at.reshape(-1).tolist())


def _reads_only_its_own_elements(t, view):
    """Does OVERLAP[view] of torch tensor ``t`` read only storage elements of ``t`` itself?"""
    with torch.no_grad():
        try:
            v = OVERLAP[view](t.detach())
        except RuntimeError:  # (out of bounds: both libraries raise, which op compares)
            return True
    return _storage_positions(v) <= _storage_positions(t)


def told_apart(g, t, what):
    """Gradients whose graphs differ: True if graphgrad's and torch's agree in value but not in
    requires_grad, or graphgrad has None where torch has zeros. Under create_graph=True a
    rule's formula decides whether the gradient depends on the input again: torch's prod over
    a dimension of size 1 returns the incoming gradient (no graph), graphgrad's formula has
    one; the derivative of relu's backward with respect to its input is None in graphgrad, a
    zero tensor (with a graph) in torch. Such gradients are compared by value only. Over no
    elements torch's double-backward formulas leave gradients undefined (no edge) where
    graphgrad's compute an empty one: an empty gradient where torch has None (or a
    materialized zero) is compared by shape."""
    if t is None:
        if g is not None and g.numel() == 0:
            STATS["empty_gradients_with_other_graphs"] += 1
            return True
        return False
    if t.numel() == 0 and g is not None and g.shape == t.shape and g.is_leaf != t.is_leaf:
        STATS["empty_gradients_with_other_graphs"] += 1
        return True
    if g is None:
        if bool((plain(t) == 0).all()):
            STATS["gradients_with_other_graphs"] += 1
            return True
        return False
    if g.requires_grad != t.requires_grad:
        torch.testing.assert_close(plain(g), plain(t), **TOL, msg=lambda m: f"{what}: {m}")
        STATS["gradients_with_other_graphs"] += 1
        return True
    return False


def assert_same_tensor(g, t, what, flags=True):
    if t is None:
        assert g is None, what
        return
    assert g is not None, what
    torch.testing.assert_close(plain(g), plain(t), **TOL, msg=lambda m: f"{what}: {m}")
    if flags:
        assert g.requires_grad == t.requires_grad, f"{what}: requires_grad"
        assert g.is_leaf == t.is_leaf, f"{what}: is_leaf"
        assert (g.grad_fn is None) == (t.grad_fn is None), f"{what}: grad_fn"


class Interpreter:
    def __init__(self, program):
        self.G, self.T = Side(program, True), Side(program, False)
        n = len(self.G.env)
        self.root = list(range(n))  # which storage each tensor aliases (views share their base's)
        self.stale = [False] * n
        self.retained = set()
        self.broken = set()  # see broken_view
        self.diverged = set()  # see call_backward
        self.wrapped = {}  # see push
        self.no_grad_views = set()  # views made under no_grad (and views of them)
        self.detached_on_torch = set()  # see op(): torch's side was detached (and views of it)
        self.broadcast_by_a_loss = set()  # see op(): torch's loss node keeps an expanded view
        self.multi_output_views = set()  # outputs of split/chunk/unbind (and views of them)
        self.function_views = set()  # views returned by custom Functions (and views of them)
        self.stale_grad_graph = set()  # see grad_holders
        self.hooks = 0  # hooks registered so far (their ids in the logs)
        self.kept_only_by_torch = False  # see call_backward
        self.kept_only_by_graphgrad = False  # see call_backward
        self.known_zeros = False  # see check_grads: a sgn op ran, or a created graph holds one
        self.ckpt_inputs_without_grad = set()  # see op(): torch's checkpoint recomputes with them
        self.created_graph = False  # see call_backward: a create_graph=True pass ran
        self.overlapping = set()  # views made by OVERLAP (and views of them)
        self.empty_created_graph = False  # see call_backward

    # -- bookkeeping -------------------------------------------------------------------------
    def args(self, *idx):
        """The indexed tensors on both sides (None if one of them is stale)."""
        ks = [len(self.T.env) - 1 - i % len(self.T.env) for i in idx]
        if any(self.stale[k] for k in ks):
            STATS["stale_reads_left_out"] += 1
            return None
        return ks, [self.G.env[k] for k in ks], [self.T.env[k] for k in ks]

    def push(self, g, t, parent=None, multi_output=False, function_view=False):
        assert_same_tensor(g, t, "result")
        assert isinstance(g, gg.Tensor) or not g.requires_grad
        if not isinstance(g, gg.Tensor):
            # gradients are plain torch tensors (documented); made to require grad, a plain
            # tensor would be torch.autograd's. A graphgrad user wraps it: so do we (once per
            # tensor, as the same .grad pushed twice is one tensor on torch's side)
            if id(g) not in self.wrapped:
                self.wrapped[id(g)] = (g, gg.as_tensor(g))
            g = self.wrapped[id(g)][1]
        self.G.env.append(g)
        self.T.env.append(t)
        alias = parent is not None and (g is self.G.env[parent] or g._is_view())
        self.root.append(self.root[parent] if alias else len(self.root))
        self.stale.append(False)
        same = parent is not None and g is self.G.env[parent]  # the op returned its input
        if alias and ((not torch.is_grad_enabled() and not same) or parent in self.no_grad_views):
            self.no_grad_views.add(len(self.root) - 1)
        if alias and parent in self.detached_on_torch:
            self.detached_on_torch.add(len(self.root) - 1)
        if alias and (multi_output or parent in self.multi_output_views):
            self.multi_output_views.add(len(self.root) - 1)
        if alias and (function_view or parent in self.function_views):
            self.function_views.add(len(self.root) - 1)
        if alias and parent in self.overlapping:
            self.overlapping.add(len(self.root) - 1)

    def grad_holders(self, stale_too=False):
        """(k, graphgrad tensor, torch tensor) for each tensor whose .grad is filled in."""
        for k, (g, t) in enumerate(zip(self.G.env, self.T.env)):
            # torch would regenerate a stale view's grad_fn (or raise, for multi-output views)
            if self.broken_view(k) or (self.stale[k] and not stale_too):
                continue
            if (t.is_leaf and t.requires_grad) or id(t) in self.retained:
                yield k, g, t

    def broken_view(self, k):
        """torch refuses to tell the grad_fn of an output of split/chunk/unbind, or of a view made
        under no_grad, once its base was changed in place; such a tensor is only compared by
        value from then on."""
        if self.stale[k] and k in self.broken:
            return True
        try:
            _ = self.T.env[k].grad_fn
        except RuntimeError as e:
            assert "multiple views" in str(e) or "no_grad mode" in str(e) or "custom Function" in str(e), e
            if "custom Function" in str(e):  # graphgrad refuses it too (it would bypass the
                with_error = False  # Function's backward): compared, then left out
                try:
                    _ = self.G.env[k].grad_fn
                except RuntimeError as e2:
                    with_error = "custom Function" in str(e2)
                assert with_error, "graphgrad used a Function's view after its base changed"
                STATS["function_views_refused_after_their_base_changed"] += 1
            self.stale[k] = True
            self.broken.add(k)
            STATS["multi_output_views_changed"] += 1
            return True
        if k in self.detached_on_torch and k in self.function_views:
            # torch's side is a detached copy (a Function's view made under no_grad of a tensor
            # that requires grad, compared as graphgrad has it: see op()); torch's own view, as
            # graphgrad's, is refused once its base changed: from then on left out
            try:
                _ = self.G.env[k].grad_fn
            except RuntimeError as e:
                assert "custom Function" in str(e), e
                self.stale[k] = True
                self.broken.add(k)
                STATS["function_views_made_under_no_grad_refused_after_their_base_changed"] += 1
                return True
            return False
        # reading grad_fn rebuilds a view's grad_fn after its base changed, moving its
        # retain_grad, in torch: so it must in graphgrad, read as often
        _ = self.G.env[k].grad_fn
        return False

    def check_logs(self):
        """Hook calls must match torch's, in torch's order. After a loss broadcast an input
        (torch's node keeps an expanded view of it, documented) torch's graph has ExpandBackward
        nodes graphgrad's lacks, which changes when the nodes after them become ready: then
        each hook's calls are compared in order, not how they interleave with other hooks'."""
        if self.empty_created_graph and self.created_graph and \
                [e[:2] for e in self.G.log] != [e[:2] for e in self.T.log]:
            # a hook on a tensor that a graph created over no elements reaches in graphgrad
            # only (see call_backward): the program ends here
            STATS["stopped_where_an_empty_created_graph_ran_other_hooks"] += 1
            raise StopProgram
        if self.broadcast_by_a_loss and [e[:2] for e in self.G.log] != [e[:2] for e in self.T.log]:
            STATS["hook_orders_compared_per_hook_after_a_broadcasting_loss"] += 1
            assert_same_log(_by_hook(self.G.log), _by_hook(self.T.log), TOL, self.created_graph)
            return
        assert_same_log(self.G.log, self.T.log, TOL, self.created_graph)

    def check_grads(self):
        self.check_logs()
        for k, g, t in self.grad_holders():
            # a plain backward that adds to a .grad made with create_graph=True: torch adds in
            # place and keeps the old grad_fn, graphgrad makes a new .grad: values compared
            if told_apart(g.grad, t.grad, f".grad of tensor {k}"):
                self.stale_grad_graph.add(id(t))
                continue
            if t.grad is None and g.grad is not None and self.empty_created_graph and \
                    bool((plain(g.grad) == 0).all()):
                # over no elements torch's double-backward formulas leave a gradient undefined
                # (no edge, see told_apart) where graphgrad's compute one: a zero that reached a
                # leaf through empty tensors is None in torch (documented)
                STATS["zero_grads_through_empty_created_graphs"] += 1
                continue
            flags = id(t) not in self.stale_grad_graph
            if self.known_zeros and g.grad is not None and t.grad is not None and \
                    g.grad.shape == t.grad.shape:
                # sgn's known-zero gradient stays exactly zero through every rule in graphgrad,
                # through ops with ZeroTensor kernels only in torch, which gives NaN elsewhere
                # (0 * inf in a custom Function's backward, reciprocal, a rule before a slice,
                # whose backward writes the zero into plain zeros...: documented)
                # (added to a .grad an earlier pass filled: graphgrad's stays, torch's is NaN)
                kept = torch.isnan(plain(t.grad)) & ~torch.isnan(plain(g.grad))
                if bool(kept.any()):
                    STATS["known_zeros_where_torch_gives_nan"] += 1
                    torch.testing.assert_close(plain(g.grad)[~kept], plain(t.grad)[~kept], **TOL)
                    continue
            assert_same_tensor(g.grad, t.grad, f".grad of tensor {k}", flags)

    def call_backward(self, fn_g, fn_t, create):
        """A backward or grad call. graphgrad checks the whole graph before it runs anything;
        torch runs until it meets the broken node. So after an error graphgrad's .grads must
        be exactly as before (checked); torch's partial sums are undone before going on."""
        holders = list(self.grad_holders(stale_too=True))
        before = [(g.grad, None if g.grad is None else plain(g.grad).clone(),
                   t.grad, None if t.grad is None else plain(t.grad).clone()) for _, g, t in holders]
        if not create:  # see check_grads; and torch's in-place sum shows through aliases
            graphs = [t.grad for _, _, t in holders if t.grad is not None and t.grad.requires_grad]
            self.stale_grad_graph.update(id(t) for _, _, t in holders if t.grad is not None
                                         and t.grad.requires_grad)
            roots = {self.root[m] for m, tt in enumerate(self.T.env) if any(tt is grad for grad in graphs)}
            for m in range(len(self.T.env)):
                if self.root[m] in roots:  # the .grad itself and views of it
                    self.stale[m] = True
                    self.diverged.add(m)
        self.check_logs()
        logged = len(self.G.log)
        try:
            ok, got_g, got_t, kind = run_both(fn_g, fn_t, backward=True)
        except AssertionError as e:
            text = str(e)
            if "torch: RuntimeError('ZeroTensors are immutable" in text:
                # torch's .grad holds sgn's immutable zero tensor (documented), and both raised
                STATS["stopped_where_torch_kept_an_immutable_zero_grad"] += 1
                raise StopProgram from e
            if self.empty_created_graph and self.created_graph and (
                    "not have been used in the graph" in text
                    or "modified by an inplace operation" in text):
                # over no elements torch's double-backward formulas leave gradients undefined
                # (no edge, see told_apart) where graphgrad's compute empty ones: the graph
                # created reaches inputs and saved results in graphgrad only (documented)
                STATS["stopped_where_an_empty_created_graph_reached_more"] += 1
                raise StopProgram from e
            if "raised where torch did not" in text and "second time" in text and self.empty_created_graph:
                # graphgrad's double-backward graphs over no elements have edges torch's lack
                # (see told_apart): a pass without retain_graph freed nodes torch's never
                # reached. The programs part here
                STATS["stopped_where_an_empty_created_graph_freed_more"] += 1
                raise StopProgram from e
            if "raised where torch did not" in text and self.kept_only_by_graphgrad and (
                    "second time" in text or "modified by an inplace operation" in text):
                # as_strided's input, which graphgrad's rule keeps and torch's does not
                # (KEPT_ONLY_BY_GRAPHGRAD in tests/engine/test_parity_rules.py), was freed by
                # an earlier pass or changed in place since
                STATS["stopped_where_graphgrad_kept_an_as_strided_input"] += 1
                raise StopProgram from e
            if self.created_graph and "graphgrad: RuntimeError('One of the differentiated" in text \
                    and "torch: RuntimeError('Trying to backward through the graph a second time" in text:
                # a gradient made with create_graph whose formula reads an input in one library
                # only (documented): torch's graph reached a node an earlier pass freed, where
                # graphgrad's does not reach that input at all
                STATS["stopped_where_a_created_graph_reached_other_inputs"] += 1
                raise StopProgram from e
            if "did not raise where" not in text:
                raise
            if "second time" in text:
                # torch freed more in a failed backward, or keeps 0.5 in x * 0.5 as a tensor
                # and frees it (graphgrad keeps the number). The programs part here.
                STATS["stopped_where_torch_refused_a_second_backward"] += 1
                raise StopProgram from e
            if "modified by an inplace operation" in text and self.created_graph:
                # differentiated again, graphgrad's rules save what their formulas use (square:
                # grad * (2 * input) keeps 2 * input), torch's double-backward nodes what
                # derivatives.yaml names (PowBackward0 keeps self): an in-place change that
                # torch refuses may leave graphgrad's created graph valid (documented)
                STATS["stopped_where_a_created_graph_saved_other_tensors"] += 1
                raise StopProgram from e
            if ("modified by an inplace operation" in text or "detached in-place" in text) and \
                    self.kept_only_by_torch:
                # an op whose input torch keeps for its shape only (KEPT_ONLY_BY_TORCH in
                # tests/engine/test_parity_rules.py) had that input changed in place
                STATS["stopped_where_torch_kept_a_shape_only_input"] += 1
                raise StopProgram from e
            if "ZeroTensors are immutable" in text:
                # torch stores sgn's efficient zero gradient in .grad as is, and then fails
                # to add to it; graphgrad stores a plain zero tensor (documented)
                STATS["stopped_where_torch_kept_an_immutable_zero_grad"] += 1
                raise StopProgram from e
            if "CheckpointError" in text:
                # torch's checkpoint reads requires_grad of its inputs again when it recomputes
                # (a detach_() in between changes what it saves); graphgrad's kept it
                STATS["stopped_where_torch_checkpoint_recomputed_differently"] += 1
                raise StopProgram from e
            raise
        if ok and create:
            self.created_graph = True
            self.empty_created_graph |= any(t.numel() == 0 for t in self.T.env)
            # the gradients made (returned, or written to .grad) may hold a sgn node
            made = list(got_g) if isinstance(got_g, (tuple, list)) else []
            self.known_zeros |= _records_sgn(made + [g.grad for _, g, _ in holders])
        if not ok and kind == "not have been used in the graph" and (
                len(self.G.log) > logged or any(g.grad is not b[0] for (_, g, _), b in zip(holders, before))):
            # an input reached that got no gradient: both libraries ran the pass, then refused
            STATS["unused_inputs_refused_after_the_pass"] += 1
        elif not ok:
            # (hooks too: graphgrad ran none of them; torch those before the broken node)
            assert len(self.G.log) == logged, "a failed backward ran hooks"
            del self.T.log[logged:]
            for (_, g, t), (g_obj, g_val, t_obj, t_val) in zip(holders, before):
                assert g.grad is g_obj, "an error replaced a .grad"
                if g_obj is not None:
                    torch.testing.assert_close(plain(g.grad), g_val, rtol=0, atol=0, equal_nan=True,
                                               msg="an error changed a .grad")
                t.grad = t_obj
                if t_obj is not None and not t_obj._is_zerotensor() and not torch.allclose(
                        t_obj, t_val, rtol=0, atol=0, equal_nan=True):  # (zero: immutable)
                    with torch.no_grad():  # (only if torch changed it: copy_ bumps the version,
                        t_obj.copy_(t_val)  # which a node that saved this .grad would see)
        return ok, got_g, got_t

    # -- steps --------------------------------------------------------------------------------
    def op(self, table, name, *idx):
        picked = self.args(*idx)
        if picked is None:
            return
        ks, gs, ts = picked
        fn = table[name]
        self.kept_only_by_torch |= name in KEPT_ONLY_BY_TORCH
        self.kept_only_by_graphgrad |= name in KEPT_ONLY_BY_GRAPHGRAD
        self.known_zeros |= "sgn" in name
        if name.startswith("ckpt") and torch.is_grad_enabled():
            self.ckpt_inputs_without_grad |= {k for k, t in zip(ks, ts) if not t.requires_grad}
        ok, out_g, out_t, _ = run_both(lambda: fn(*gs), lambda: fn(*ts))
        if ok and name in BROADCASTING_LOSSES:
            shape = torch.broadcast_shapes(*(g.shape for g in gs))
            self.broadcast_by_a_loss |= {k for k, g in zip(ks, gs) if g.shape != shape}
        if ok:
            if out_t.requires_grad and not torch.is_grad_enabled() and not any(out_t is t for t in ts):
                # torch: a view made under no_grad of a tensor that requires grad is a leaf
                # that requires grad (with its own rules for in-place changes); graphgrad's
                # does not require grad. Documented; compared here as graphgrad has it.
                assert any(table is v for v in ALIASING) and not out_g.requires_grad
                STATS["no_grad_views"] += 1
                out_t = out_t.detach()
                self.detached_on_torch.add(len(self.T.env))
            aliasing = any(table is v for v in ALIASING)
            self.push(out_g, out_t, ks[0] if aliasing else None, name in MULTI_OUTPUT_VIEWS,
                      name in FUNCTION_VIEWS)

    def inplace(self, name, i, j, fn=None, number=None):
        """In-place op ``name`` of INPLACE on tensor i with tensor j; or ``fn`` with ``number``,
        a (graphgrad side, torch side) pair (a Python number or a 0-d tensor), for the other."""
        picked = self.args(i, j)
        if picked is None:
            return
        (k, _), (g, go), (t, to) = picked
        if number is not None:
            go, to = number
        fn = fn or INPLACE[name]
        base = g._base if g._is_view() else None
        if id(t) in self.retained and t.output_nr != 0:
            # torch bug (2.13): an in-place op on output 1 of a multi-output op (std_mean's
            # mean) that retains its grad fails "out != nullptr INTERNAL ASSERT FAILED", or
            # crashes the process
            STATS["inplace_on_retained_second_output_left_out"] += 1
            return
        tb = t._base if t._is_view() else None
        if tb is not None and id(tb) in self.retained and tb.output_nr != 0:
            # the same torch bug through a view of that output (its CopySlices): torch's
            # backward then crashes the process (segmentation fault; found by a fuzz run)
            STATS["inplace_on_views_of_a_retained_second_output_left_out"] += 1
            return
        if t.retains_grad and t.grad_fn is None and (other_requires_grad(name, to) or (
                number is not None and isinstance(to, torch.Tensor) and to.requires_grad)):
            # torch bug (2.13): detach_() keeps retains_grad on, and an in-place op that makes
            # the tensor require grad again fails "old_fn INTERNAL ASSERT FAILED"
            STATS["inplace_on_retained_then_detached_left_out"] += 1
            return
        other = other_requires_grad(name, go) or (
            number is not None and isinstance(go, torch.Tensor) and go.requires_grad)
        if k in self.no_grad_views and torch.is_grad_enabled() and (
                other or (base is not None and base.requires_grad)):
            if k in self.overlapping:
                # an overlapping view of a tensor made from a no_grad view (reshape copied it):
                # torch's side requires grad and runs the op (its overlap check gives up),
                # graphgrad's refuses it for the overlap (documented). The program ends here
                STATS["stopped_at_inplace_on_self_overlapping_view"] += 1
                raise StopProgram
            if name == "fn_dirty" and k in self.detached_on_torch:
                # (the Function changes its input before refusing; torch's side is a copy)
                STATS["dirty_no_grad_views_left_out"] += 1
                return
            # torch forbids it ("A view was created in no_grad mode..."), and so does graphgrad,
            # before changing anything. (torch's side of a no_grad view of a tensor that
            # requires grad was detached in op(), see there: only graphgrad's is checked then.)
            before = plain(g).clone()
            sides = [g] + ([t] if k not in self.detached_on_torch else [])
            for side, o in zip(sides, (go, to)):
                try:
                    fn(side, o)
                except IndexError:  # a bad index as well (x[0] = v on a 0-d view): either
                    STATS["errors_checked_in_another_order"] += 1  # may be named (documented)
                except RuntimeError as e:
                    assert "no_grad mode" in str(e) or (
                        k in self.function_views and "custom Function" in str(e)), e
                else:
                    raise AssertionError("in-place op on a view made under no_grad did not raise")
            if name != "fn_dirty":  # (a Function's forward changes its input before the check)
                torch.testing.assert_close(plain(g), before, rtol=0, atol=0, equal_nan=True)
            STATS["inplace_on_no_grad_view_refused"] += 1
            return
        grad_before = t.grad if name == "fn_dirty" and t.retains_grad else None
        try:
            ok, _, _, _ = run_both(lambda: fn(g, go), lambda: fn(t, to))
        except AssertionError as e:
            if "raised where torch did not" in str(e) and "single memory location" in str(e):
                # an in-place op on an expanded view that the kernel allows (masked_fill_):
                # graphgrad refuses to record it, torch fails in backward. The programs part.
                # Likewise on a view that overlaps itself (unfold with step < size, as_strided
                # with overlap): torch's overlap check does not catch all of them and its
                # gradient is then wrong; graphgrad refuses (documented).
                if k in self.overlapping:
                    STATS["stopped_at_inplace_on_self_overlapping_view"] += 1
                else:
                    STATS["stopped_at_inplace_on_overlapping_view"] += 1
                raise StopProgram from e
            raise
        if not ok and grad_before is not None and t.grad is None:
            # a refused mark_dirty: torch resets the input's retained .grad before its check
            # (documented), graphgrad refuses before changing anything: torch's is put back
            t.grad = grad_before
            STATS["retained_grad_reset_by_a_refused_dirty_function_undone"] += 1
        if ok and base is not None and torch.is_grad_enabled() and (g.requires_grad or other):
            STATS["inplace_on_views_recorded"] += 1  # the base's grad_fn is now CopySlices
        # changed alike, or (after errors) not at all
        assert_same_tensor(g, t, "in-place target", flags=not self.broken_view(k))
        if ok:
            for m in range(len(self.root)):  # other aliases of the changed storage
                if m != k and self.root[m] == self.root[k]:
                    # compared from here on: a view's grad_fn is rebuilt by both libraries;
                    # torch refuses to rebuild those of split/chunk/unbind outputs and of views
                    # made under no_grad: those are left out
                    if self.T.env[m]._is_view() and not self.G.env[m]._is_view():
                        # a view of a kernel temporary in torch only: its history is the
                        # temporary's there (documented), so it is compared by value only
                        self.stale[m] = True
                        STATS["views_of_temporaries_changed"] += 1
                    elif m in self.function_views:  # both refuse to use it: compared once
                        self.broken_view(m)
                        self.stale[m] = True
                    elif m in self.multi_output_views or m in self.no_grad_views:
                        self.stale[m] = True
                    else:
                        STATS["aliases_compared_after_inplace"] += 1

    def backward(self, i, retain, create, use_inputs, how, j=0):
        """``use_inputs``: False, "leaf" (the first leaf) or "tensor" (tensor ``j``: torch
        retains the grad of a non-leaf input and runs its grad_fn)."""
        picked = self.args(i, j)
        if picked is None:
            return
        _, (g, gj), (t, tj) = picked

        def call(x, leaves, other):
            out = x.sum() if how == "sum" else x
            grad = torch.ones_like(out) if how == "ones" else None
            inputs = (leaves[:1] if use_inputs in (True, "leaf") else [other]) if use_inputs else None
            out.backward(grad, retain_graph=retain, create_graph=create, inputs=inputs)

        if use_inputs == "tensor" and tj._is_view() and not gj._is_view():
            # a view of a kernel temporary in torch only (documented): torch runs the view's
            # own node, which keeps nothing, graphgrad the op's (after an in-place change, one
            # that frees what it saved): a later backward through it differs. Left out.
            STATS["backward_inputs_on_views_of_temporaries_left_out"] += 1
            return
        STATS["backward_calls"] += 1
        STATS["backward_with_inputs"] += bool(use_inputs)
        before = tj.grad if use_inputs == "tensor" else None
        ok, _, _ = self.call_backward(lambda: call(g, self.G.leaves, gj),
                                      lambda: call(t, self.T.leaves, tj), create)
        if use_inputs == "tensor":
            if not ok:  # torch's partial pass may have filled the input's .grad (see there)
                tj.grad = before
            if tj.retains_grad:
                self.retained.add(id(tj))

    def grad(self, i, j, retain, create, allow_unused, materialize=False, k=None):
        """``gg.grad`` w.r.t. tensor ``j`` (and ``k``); ``allow_unused`` may be None (unset)."""
        picked = self.args(i, j) if k is None else self.args(i, j, k)
        if picked is None:
            return
        _, (g, *gi), (t, *ti) = picked
        if any(b._is_view() and not a._is_view() for a, b in zip(gi, ti)):
            # w.r.t. a view of a kernel temporary in torch only (documented): once that
            # temporary changed in place, torch's view gets a new grad_fn the output does not
            # reach (unused input), graphgrad's tensor keeps its own (see backward). Left out.
            STATS["grad_inputs_on_views_of_temporaries_left_out"] += 1
            return
        STATS["grad_calls"] += 1
        STATS["grad_with_materialize_grads"] += bool(materialize)
        options = {"retain_graph": retain, "create_graph": create, "materialize_grads": materialize}
        if allow_unused is not None:
            options["allow_unused"] = allow_unused
        ok, got_g, got_t = self.call_backward(lambda: gg.grad(g.sum(), gi, **options),
                                              lambda: torch.autograd.grad(t.sum(), ti, **options),
                                              create)
        if not ok:
            return
        for n, (have, want) in enumerate(zip(got_g, got_t)):
            # (a materialized zero under create_graph is compared exactly: see differentiate)
            materialized = materialize and want is not None and want.is_leaf and want.requires_grad
            if (not materialized or want.numel() == 0) and told_apart(have, want, f"gg.grad result {n}"):
                continue
            assert_same_tensor(have, want, f"gg.grad result {n}")
            if want is not None and n == 0:
                # (torch's may be an expanded view made under no_grad, which it forbids to
                # change in place later: the program goes on with copies)
                self.push(have.clone(), want.clone())

    def hook(self, kind, i, modify):
        """Register a hook of ``kind`` on tensor i (tests/engine/fuzz_autograd.py) on both sides."""
        picked = self.args(i)
        if picked is None:
            return
        _, (g,), (t,) = picked
        if t._is_view() and (not g._is_view() or g._base.shape != t._base.shape):
            # a view of a kernel temporary in torch only (documented), or a view of a view of
            # one (its base is the temporary): hooks on it see the temporary's history, which
            # graphgrad's graph does not have
            STATS["hooks_on_views_of_temporaries_left_out"] += 1
            return
        if kind in ("pre", "post") and g.grad_fn is not None and t.grad_fn is not None and \
                not _same_node_kind(g.grad_fn, t.grad_fn):
            # the libraries built different nodes for this op (torch's composite or
            # CopySlices for a `t[0] = v` on a non-view, graphgrad's one rule): a Node hook
            # sees each node's own inputs, so only tensor hooks and gradients are compared
            STATS["node_hooks_on_differently_built_nodes_left_out"] += 1
            return
        if kind in ("pre", "post") and g.grad_fn is not None and t.grad_fn is not None and \
                _expands_inputs_only_in_torch(g.grad_fn, t.grad_fn):
            # torch's loss took expanded views of broadcast arguments (documented): a post
            # hook sees gradients of other shapes; tensor hooks and gradients are compared
            STATS["node_hooks_on_nodes_with_inputs_expanded_by_torch_left_out"] += 1
            return
        hid = self.hooks
        self.hooks += 1
        ok, handle_g, handle_t, _ = run_both(lambda: register(kind, g, self.G.log, hid, modify),
                                             lambda: register(kind, t, self.T.log, hid, modify))
        if ok:
            assert (handle_g is None) == (handle_t is None), "grad_fn"
            STATS[f"hooks_{kind}"] += handle_t is not None

    def detach_(self, i):
        picked = self.args(i)
        if picked is None:
            return
        (k,), (g,), (t,) = picked
        if k in self.detached_on_torch:  # torch's side is a detached copy (see op()): not a view
            STATS["detach_in_place_of_no_grad_views_left_out"] += 1
            return
        if k in self.broadcast_by_a_loss:
            # torch's F.mse_loss/huber_loss/smooth_l1_loss keep the expanded view of an input
            # they broadcast, graphgrad the input itself: after detach_() of it, graphgrad's
            # backward refuses where torch's runs (documented)
            STATS["stopped_at_detach_of_an_input_a_loss_broadcast"] += 1
            raise StopProgram
        if t._is_view() and not g._is_view():
            # torch's output of avg_pool1d, instance_norm, einsum... is a view of the kernel's
            # own temporary, which torch refuses to detach in place; graphgrad's is no view
            # (documented): left out
            STATS["detach_in_place_of_views_of_temporaries_left_out"] += 1
            return
        ok, _, _, _ = run_both(g.detach_, t.detach_)
        STATS["detach_in_place"] += ok
        if ok:
            assert_same_tensor(g, t, "detached in place")
            if any(m != k and self.root[m] == self.root[k] for m in range(len(self.root))):
                # torch's views of it keep its old history (a view rebuilt after an in-place
                # change still leads there); graphgrad rebuilds them from its current state
                STATS["stopped_at_detach_of_a_base_with_views"] += 1
                raise StopProgram

    # -- the step kinds of issue 39 ------------------------------------------------------------
    def back(self, k):
        """The index counted back from the newest tensor of tensor number ``k``."""
        return len(self.T.env) - 1 - k

    def einsum(self, name, i, target, inplace, j):
        """An einsum whose result is its operand rearranged (a view of it in torch), then an
        in-place op on the result or on the operand (a later backward meets it)."""
        picked = self.args(i)
        if picked is None:
            return
        (k,), _, _ = picked
        n = len(self.T.env)
        self.op(EINSUM, name, i)
        if len(self.T.env) == n or target == "none":
            return
        STATS[f"einsum_then_inplace_on_the_{target}"] += 1
        self.inplace(inplace, 0 if target == "result" else self.back(k), j)

    def inplace_on_overlap(self, view, name, i, j):
        """A view that may overlap itself (unfold, as_strided), changed in place at once."""
        picked = self.args(i)
        if picked is None:
            return
        g, t = picked[1][0], picked[2][0]
        if view.startswith("as_strided") and (
                not _reads_only_its_own_elements(t, view) or g.stride() != t.stride()
                or g.storage_offset() != t.storage_offset()):
            # an as_strided geometry that reaches storage beyond the tensor's own elements reads
            # whatever the storage holds there (another view's elements, a kernel's scratch),
            # and over another layout other elements: no value to compare. Left out
            STATS["as_strided_outside_the_tensor_left_out"] += 1
            return
        n = len(self.T.env)
        self.op(OVERLAP, view, i)
        if len(self.T.env) > n:
            self.overlapping.add(len(self.T.env) - 1)
            STATS["inplace_on_unfold_or_as_strided_views"] += 1
            self.inplace(name, 0, j)

    def number(self, name, i, num, form):
        """An op between a tensor and a Python number or a 0-d tensor (maybe a new leaf)."""
        picked = self.args(i)
        if picked is None:
            return
        (k,), (g,), (t,) = picked
        if form == "py":
            sg = st_ = num
            if name == "rpow" and type(num) is bool:
                # torch 2.13 bug: the backward of a Python bool to a tensor's power fails ("unknown
                # ivalue tag 4" INTERNAL ASSERT); graphgrad's True ** t is compared with
                # torch's 1.0 ** t
                st_ = float(num)
                STATS["torch_bug_bool_base_of_pow_stepped_around"] += 1
        elif form == "t0":  # a plain torch tensor mixes in on graphgrad's side
            sg, st_ = torch.tensor(num, dtype=DT), torch.tensor(num, dtype=DT)
        elif form == "t0_gg":
            sg, st_ = gg.tensor(num, dtype=DT), torch.tensor(num, dtype=DT)
        elif form == "t0_int":
            sg, st_ = torch.tensor(int(num)), torch.tensor(int(num))
        else:  # a new 0-d leaf that requires grad
            sg = gg.tensor(float(num), dtype=DT, requires_grad=True)
            st_ = torch.tensor(float(num), dtype=DT, requires_grad=True)
            self.push(sg, st_)
            self.G.leaves.append(sg)
            self.T.leaves.append(st_)
            STATS["zero_dim_leaves"] += 1
        STATS[f"numbers_{form}"] += 1
        f = NUMBER[name]
        if name.endswith("_"):  # in place on the tensor itself: as the in-place steps do
            self.inplace("number_" + name, self.back(k), 0, fn=f, number=(sg, st_))
            return
        ok, out_g, out_t, _ = run_both(lambda: f(g, sg), lambda: f(t, st_))
        if ok:
            self.push(out_g, out_t)

    def overflow(self, zero, scale, i, how, retain):
        """A rule with structural zeros (trace, tril, relu, max...) then an op whose gradient
        overflows to inf or NaN (exp(800 * y), y * 1e308 * 4...), differentiated at once."""
        picked = self.args(i)
        if picked is None:
            return
        (k,), _, _ = picked
        n = len(self.T.env)
        self.op({zero: lambda t: OVERFLOW[scale](ZERO_RULES[zero](t))}, zero, i)
        if len(self.T.env) == n or how == "none":
            return
        STATS["overflowing_gradients"] += 1
        if how == "backward":
            self.backward(0, retain, False, False, "sum")
        else:
            self.grad(0, self.back(k), retain, how == "grad_create", None)

    def double(self, name, i, j, k, affine, materialize, second):
        """An op of DOUBLE (norms with and without weight or bias, custom Functions that save a
        non-differentiable output) differentiated with create_graph=True, and again."""
        picked = self.args(i, j, k)
        if picked is None:
            return
        ks, gs, ts = picked
        use = (True,) + ((False, False) if name in WEIGHTLESS else
                         (affine in ("weight", "both"), affine in ("bias", "both")))
        f = DOUBLE[name]

        # torch 2.13 fails on a norm given a bias and weight=None: group_norm's backward
        # ("tensor does not have a device", or under create_graph "shape '[0]' is invalid"),
        # the double backward of layer_norm, batch_norm and instance_norm ("Expected a proper
        # Tensor but got None"). Its side runs with a weight of ones (the same function):
        # graphgrad's weight=None path is compared with that
        ones = "ones" if use[2] and not use[1] and name not in WEIGHTLESS else None

        def call(side, weightless=None):
            return f(side[0], side[1] if use[1] else weightless, side[2] if use[2] else None)

        ok, out_g, out_t, _ = run_both(lambda: call(gs), lambda: call(ts, ones))
        STATS["norms_with_a_bias_and_no_weight"] += ones is not None
        if not ok:
            return
        self.push(out_g, out_t)
        STATS["double_steps"] += 1
        in_ks = list(dict.fromkeys(m for m, u in zip(ks, use) if u and self.T.env[m].requires_grad))
        if in_ks and torch.is_grad_enabled():
            self.differentiate(len(self.T.env) - 1, in_ks, materialize, second)

    def grad2(self, i, j, k, materialize, second, api):
        """``gg.grad(create_graph=True)`` (materialized zeros or not), then a second
        differentiation of what it returned; ``api="torch"``: graphgrad's side calls
        ``torch.autograd.grad`` on its tensors (which reaches graphgrad)."""
        picked = self.args(i, j, k)
        if picked is None:
            return
        ks, _, _ = picked
        self.differentiate(ks[0], list(dict.fromkeys(ks[1:])), materialize, second, api)

    def differentiate(self, out, ins, materialize, second, api="gg"):
        """gg.grad of a loss of tensor ``out`` w.r.t. tensors ``ins`` with create_graph=True;
        the gradients join the program (materialized zeros as they are: leaves that require
        grad in both), then ``second``: "grad" (gg.grad of a loss of them w.r.t. ``ins`` and
        the materialized zeros), "backward" (into the leaves) or "none"."""
        if any(self.stale[m] for m in [out, *ins]):
            STATS["stale_reads_left_out"] += 1
            return
        gi, ti = [self.G.env[m] for m in ins], [self.T.env[m] for m in ins]
        if any(b._is_view() and not a._is_view() for a, b in zip(gi, ti)):
            STATS["grad_inputs_on_views_of_temporaries_left_out"] += 1  # (see grad)
            return
        g_out, t_out = self.G.env[out], self.T.env[out]
        options = {"retain_graph": True, "create_graph": True, "materialize_grads": materialize,
                   "allow_unused": True}
        STATS["grad_calls"] += 1
        STATS["grad_with_create_graph_and_materialize_grads"] += bool(materialize)

        def loss(y):
            return (y.sin() + y * y).sum()

        grad = gg.grad if api == "gg" else torch.autograd.grad
        STATS["torch_autograd_grad_on_graphgrad_tensors"] += api != "gg"
        ok, got_g, got_t = self.call_backward(lambda: grad(loss(g_out), gi, **options),
                                              lambda: torch.autograd.grad(loss(t_out), ti, **options), True)
        if not ok:
            return
        firsts = []
        for n, (have, want) in enumerate(zip(got_g, got_t)):
            # (a materialized zero is torch's zeros_like(input, requires_grad=True): exactly)
            materialized = materialize and want is not None and want.is_leaf and want.requires_grad
            if (not materialized or want.numel() == 0) and told_apart(
                    have, want, f"gg.grad(create_graph=True) result {n}"):
                continue
            assert_same_tensor(have, want, f"gg.grad(create_graph=True) result {n}")
            if want is None:
                continue
            if materialized:  # a leaf that requires grad
                STATS["materialized_zeros_differentiated"] += second != "none"
                self.push(have, want)
            else:
                self.push(have.clone(), want.clone())
            firsts.append(len(self.T.env) - 1)
        if second == "none" or not firsts:
            return
        STATS[f"differentiated_again_by_{second}"] += 1

        def loss2(env):
            return sum((env[m] * env[m]).sum() * 0.5 + env[m].sum() for m in firsts)

        if second == "backward":
            self.call_backward(lambda: loss2(self.G.env).backward(), lambda: loss2(self.T.env).backward(),
                               False)
            return
        ins2 = ins + [m for m in firsts if self.T.env[m].is_leaf and self.T.env[m].requires_grad]
        gi, ti = [self.G.env[m] for m in ins2], [self.T.env[m] for m in ins2]
        options = {"allow_unused": True, "materialize_grads": materialize}
        ok, got_g, got_t = self.call_backward(lambda: grad(loss2(self.G.env), gi, **options),
                                              lambda: torch.autograd.grad(loss2(self.T.env), ti, **options),
                                              False)
        if not ok:
            return
        for n, (have, want) in enumerate(zip(got_g, got_t)):
            if not told_apart(have, want, f"second gg.grad result {n}"):
                assert_same_tensor(have, want, f"second gg.grad result {n}")

    def under_saved_hooks(self, mode, inner, no_grad):
        """Run a step with saved-tensor hooks on (``clone``: pack a copy; ``identity``)."""
        g_hooks = saved_tensors_hooks(self.G.env[-1], mode)
        t_hooks = saved_tensors_hooks(self.T.env[-1], mode)
        STATS["steps_under_saved_tensor_hooks"] += 1
        with g_hooks, t_hooks:
            self.step(inner, no_grad, check=False)

    def step(self, step, no_grad, check=True):
        kind = step[0]
        STATS["steps"] += 1
        with torch.set_grad_enabled(not no_grad):
            if kind in ("unary", "binary", "reduce", "view"):
                table = {"unary": UNARY, "binary": BINARY, "reduce": REDUCE, "view": VIEW}[kind]
                self.op(table, step[1], *step[2:])
            elif kind == "inplace":
                self.inplace(*step[1:])
            elif kind == "einsum":
                self.einsum(*step[1:])
            elif kind == "inplace_on_overlap":
                self.inplace_on_overlap(*step[1:])
            elif kind == "number":
                self.number(*step[1:])
            elif kind == "overflow":
                self.overflow(*step[1:])
            elif kind == "double":
                self.double(*step[1:])
            elif kind == "grad2":
                self.grad2(*step[1:])
            elif kind == "inplace_on_view":  # a view, then an in-place op on it (CopySlices)
                _, view, name, i, j = step
                n = len(self.T.env)
                self.op(VIEW, view, i)
                if len(self.T.env) > n:
                    self.inplace(name, 0, j)
            elif kind == "detach":
                picked = self.args(step[1])
                if picked is not None:
                    self.push(picked[1][0].detach(), picked[2][0].detach())
            elif kind == "retain_grad":
                picked = self.args(step[1])
                if picked is not None:
                    run_both(picked[1][0].retain_grad, picked[2][0].retain_grad)
                    if picked[2][0].retains_grad:
                        self.retained.add(id(picked[2][0]))
            elif kind == "requires_grad_":
                picked = self.args(step[1])
                flag = step[2]
                if picked is not None and flag and picked[0][0] in self.ckpt_inputs_without_grad \
                        and not picked[2][0].requires_grad:
                    # torch's non-reentrant checkpoint recomputes with the input's flag as it is
                    # at backward: the recomputed forward saves other tensors than the first
                    # did, and torch unpacks them by position without an error. Its gradient is
                    # then wrong (x * y.sin() + x gave 1 + y for x, not 1 + sin(y)); graphgrad
                    # recomputes what it recorded. The programs part here (documented).
                    STATS["stopped_at_requires_grad_on_a_checkpoint_input"] += 1
                    raise StopProgram
                if picked is not None and (flag or not picked[2][0].is_leaf):
                    # (requires_grad_(False) on a leaf is left out: torch keeps treating the
                    # views and results made from it as made from a leaf that requires grad)
                    ok, _, _, _ = run_both(lambda: picked[1][0].requires_grad_(flag),
                                           lambda: picked[2][0].requires_grad_(flag))
                    k = picked[0][0]
                    if ok and any(m != k and self.root[m] == self.root[k] for m in range(len(self.root))):
                        # torch's views follow their base's flag, without a grad_fn (and one that
                        # a node saved may then raise when backward unpacks it): the programs part
                        STATS["stopped_at_requires_grad_on_a_base_with_views"] += 1
                        raise StopProgram
            elif kind == "backward":
                self.backward(*step[1:])
            elif kind == "hook":
                self.hook(*step[1:])
            elif kind == "detach_":
                self.detach_(step[1])
            elif kind == "saved_hooks":
                self.under_saved_hooks(step[1], step[2], no_grad)
            elif kind == "grad":
                self.grad(*step[1:])
            elif kind == "leaf_grad":
                picked = self.args(step[1])
                g, t = (None, None) if picked is None else (picked[1][0], picked[2][0])
                if t is not None and t.is_leaf and t.requires_grad and id(t) not in self.stale_grad_graph:
                    assert (g.grad is None) == (t.grad is None)
                    if t.grad is not None:
                        self.push(g.grad, t.grad)
            else:  # zero_grad
                for g, t in zip(self.G.leaves, self.T.leaves):
                    g.grad = t.grad = None
                self.stale_grad_graph.clear()
        if check:
            self.check_grads()

    def finish(self):
        self.backward(0, False, False, False, "sum")  # every program ends with a backward
        for k, (g, t) in enumerate(zip(self.G.env, self.T.env)):
            if k not in self.diverged:
                torch.testing.assert_close(plain(g), t.data, **TOL, msg=lambda m, k=k: f"value {k}: {m}")
        self.check_grads()


def _by_hook(log):
    """A hook-call log grouped by hook, each hook's calls in their order (a stable sort)."""
    return sorted(log, key=lambda entry: entry[1])


def run_program(program):
    STATS["programs"] += 1
    budget = program.get("budget")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interp = Interpreter(program)
        try:
            # a memory budget (128 or 512 bytes) around the whole program: graphgrad's side drops
            # and recomputes saved tensors (torch's side is recorded too, and unchanged)
            # (_live=False: what was dropped is recomputed even where the program still holds it)
            mb = gg.memory_budget(budget, plan=False, _live=False) if budget else contextlib.nullcontext()
            with mb:
                for step, no_grad in program["steps"]:
                    interp.step(step, no_grad)
                interp.finish()
            if budget:
                STATS["programs_under_a_memory_budget"] += 1
                STATS["saved_values_dropped_by_a_budget"] += mb.stats.evicted
                STATS["calls_recomputed_by_a_budget"] += mb.stats.recomputed
        except StopProgram:
            pass
        except gg.MemoryBudgetError:  # a limit below what must be kept (a copy of a changed leaf)
            STATS["programs_ended_by_an_infeasible_budget"] += 1
