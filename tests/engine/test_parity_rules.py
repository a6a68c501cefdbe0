"""Rules against torch.autograd: views of op temporaries, NaN/empty/0-d edges, and what each
rule keeps for backward, which decides where an in-place change raises (issue 18, items 3,
8, 9, 12, 15, 16).

``SAVED_LIKE_TORCH`` pins the rules that keep what torch keeps; ``KEPT_ONLY_BY_TORCH`` and
``KEPT_ONLY_BY_GRAPHGRAD`` pin the deliberate differences listed in docs/reliability.md.
"""

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from parity import Lib, identity, same_as_torch

A = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]
B = [[1.0, 0.5], [-2.0, 1.5], [0.25, -0.5]]


# -- item 3: outputs that are views of an op's own temporary ---------------------------------
TEMPORARY_VIEWS = {
    "einsum": lambda lib, a, b: torch.einsum("ij,jk->ki", a, b),
    "avg_pool1d": lambda lib, a, b: F.avg_pool1d(a.unsqueeze(0), 2, 1),
    "max_pool1d": lambda lib, a, b: F.max_pool1d(a.unsqueeze(0), 2, 1),
    "instance_norm": lambda lib, a, b: F.instance_norm(a.unsqueeze(0)),
    "adaptive_avg_pool1d": lambda lib, a, b: F.adaptive_avg_pool1d(a.unsqueeze(0), 2),
}


@pytest.mark.parametrize("op", TEMPORARY_VIEWS.values(), ids=TEMPORARY_VIEWS.keys())
def test_an_output_that_views_a_temporary_changes_in_place_like_any_output(op):
    def in_place_on_a_view(lib):
        a, b = lib.leaf(A), lib.leaf(B)
        y = op(lib, a, b)
        y[0].mul_(2)
        (y * y).sum().backward()
        return a.grad, b.grad, y

    same_as_torch(in_place_on_a_view)

    def view_used_after(lib):  # the silently wrong case: v lost its grad_fn
        a, b = lib.leaf(A), lib.leaf(B)
        y = op(lib, a, b)
        v = y[0]
        with torch.no_grad():
            y.mul_(2)
        (v.sum() + y.sum()).backward()
        return a.grad, b.grad, v.grad_fn is not None

    same_as_torch(view_used_after)


@pytest.mark.parametrize("op", TEMPORARY_VIEWS.values(), ids=TEMPORARY_VIEWS.keys())
def test_an_output_that_views_a_temporary_made_under_no_grad_is_a_no_grad_view(op):
    """Found by a 20,000-program fuzz run: graphgrad recorded the in-place op (or failed with
    a shape error) where torch refuses a view made in no_grad mode."""
    def program(lib):
        a, b = lib.leaf(A), lib.leaf(B)
        with torch.no_grad():
            y = op(lib, a, b)
        y.add_(op(lib, a, b))
        y.sum().backward()
        return y, a.grad, b.grad

    if op is TEMPORARY_VIEWS["max_pool1d"]:  # torch's no-grad max_pool1d makes no view
        same_as_torch(program)
    else:
        same_as_torch(program, RuntimeError, "view was created in no_grad mode",
                      "view was created in no_grad mode")


@pytest.mark.parametrize("op", TEMPORARY_VIEWS.values(), ids=TEMPORARY_VIEWS.keys())
def test_an_output_that_views_a_temporary_made_from_constants_follows_its_base(op):
    """Found by a 20,000-program random fuzz run (seed 41; a silently dropped gradient): made
    with grad mode on from tensors that require no grad, such an output is a plain view of the
    kernel's temporary; another view of that temporary changed in place by an op with a tensor
    that requires grad makes it require grad too (its grad_fn rebuilt from the base's, as any
    view's). graphgrad did not mark it as a view, so it stayed without a grad_fn and the
    gradient through it was lost."""
    def program(lib):
        a, b, x = lib.const(A), lib.const(B), lib.leaf([[2.0]])
        y = op(lib, a, b)
        y.reshape(-1)[:1].add_(x.reshape(-1))  # a second view of the same temporary
        (y * y).sum().backward()
        return y.requires_grad, y, x.grad

    same_as_torch(program)


# -- item 12: tensor_split and its family are plain slices ------------------------------------
SLICERS = {
    "tensor_split_sections": lambda t: torch.tensor_split(t, 2, dim=1),
    "tensor_split_indices": lambda t: t.tensor_split([1, 3], dim=-1),
    "tensor_split_unordered": lambda t: torch.tensor_split(t, [2, 1], dim=1),
    "tensor_split_tensor": lambda t: torch.tensor_split(t, torch.tensor(3), dim=1),
    "hsplit": lambda t: torch.hsplit(t, [1]),
    "vsplit": lambda t: t.vsplit(2),
    "dsplit": lambda t: torch.dsplit(t.unsqueeze(-1).expand(2, 4, 2), [1]),
}


@pytest.mark.parametrize("split", SLICERS.values(), ids=SLICERS.keys())
def test_tensor_split_outputs_are_ordinary_views(split):
    def program(lib):
        log = []
        x = lib.leaf([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
        y = x * 1
        parts = split(y)
        parts[0].grad_fn.register_hook(lambda gi, go: log.append("node hook"))
        (parts[-1] * 3).sum().backward(retain_graph=True)
        parts[0].mul_(2)  # allowed: not an output of a multi-output node
        (y * y).sum().backward()
        return x.grad, [p.shape for p in parts], log

    same_as_torch(program)


def test_tensor_split_checks_its_arguments_as_torch():
    def program(lib):
        torch.hsplit(lib.leaf([[1.0, 2.0, 3.0]]) * 1, 2)

    same_as_torch(program, RuntimeError, "not divisible", "not divisible")


# -- items 8, 9, 15: zeros, NaN, empty tensors ----------------------------------------------
@pytest.mark.parametrize("mode", ["clone", "identity"])
def test_einsum_under_saved_tensor_hooks(mode):
    """Found by the fuzzer: einsum read requires_grad off its saved operands, which a pack hook
    may have replaced by copies: the gradient was silently dropped."""
    def program(lib):
        x, w = lib.leaf([0.3, 0.7]), lib.leaf([[1.0, 2.0], [3.0, 4.0]])
        pack = (lambda t: t.detach().clone()) if mode == "clone" else (lambda t: t)
        with lib.saved_tensors_hooks(pack, lambda t: t):
            y = torch.einsum("i,j->ji", x, x) + torch.einsum("ij,j->i", w, x).sum()
        y.sum().backward()
        return x.grad, w.grad

    same_as_torch(program)


EINSUM_CHANGED = {
    # (equation, which operands require grad, which one changes in place, does torch refuse?)
    "other_needs_none": ("i,j->ji", (True, False), 0, False),  # found by the GC-stress fuzz
    "changed_factor": ("i,j->ji", (True, False), 1, True),
    "both_need": ("i,j->ji", (True, True), 0, True),
    "one_operand": ("ii->i", (True,), 0, False),
    "three_one_needs": ("ij,jk,k->i", (False, True, False), 1, False),
    "three_factor_changed": ("ij,jk,k->i", (False, True, False), 2, True),
}


@pytest.mark.parametrize("case", EINSUM_CHANGED.values(), ids=EINSUM_CHANGED.keys())
def test_einsum_saves_only_the_operands_a_gradient_reads(case):
    """An einsum operand changed in place under no_grad before backward: refused only where a
    gradient reads it (it is another operand's factor), as torch saves only those."""
    equation, needs, changed, refused = case
    shapes = {"i,j->ji": [(3,), (2,)], "ii->i": [(3, 3)],
              "ij,jk,k->i": [(2, 3), (3, 4), (4,)]}[equation]

    def program(lib):
        g = torch.Generator().manual_seed(0)
        xs = [lib.leaf(torch.randn(s, generator=g, dtype=torch.float64), requires_grad=n)
              for s, n in zip(shapes, needs)]
        y = torch.einsum(equation, *xs)
        with torch.no_grad():
            xs[changed].add_(1)
        y.sum().backward()
        return [x.grad for x in xs]

    if refused:
        same_as_torch(program, raises=RuntimeError, torch_says="modified by an inplace operation",
                      gg_says="modified by an inplace operation")
    else:
        same_as_torch(program)


def test_copy_over_a_tensor_with_history_sends_zeros_back():
    """torch's copy_ gives its old value a zero gradient (0 * inf = NaN on the way)."""
    def program(lib):
        x, w = lib.leaf([0.0, 2.0]), lib.leaf([1.0, 1.0])
        y = x ** -1
        y.copy_(lib.const([3.0, 4.0]))
        (y * w).sum().backward()
        z = x * 2
        z.copy_(lib.const([1.0, 1.0]))
        return x.grad, w.grad, lib.grad(z.sum(), [x])

    same_as_torch(program)


LOSSES = {"huber": F.huber_loss, "smooth_l1": F.smooth_l1_loss, "smooth_l1_beta0":
          lambda a, b: F.smooth_l1_loss(a, b, beta=0.0), "mse": F.mse_loss, "l1": F.l1_loss}


@pytest.mark.parametrize("loss", LOSSES.values(), ids=LOSSES.keys())
def test_losses_with_a_nan_target_give_nan_gradients(loss):
    def program(lib):
        x = lib.leaf([1.0, 2.0, 3.0, 0.0])
        t = lib.leaf([float("nan"), 1.0, 0.0, float("inf")])
        loss(x, t).backward()
        return x.grad, t.grad

    same_as_torch(program)


@pytest.mark.parametrize("loss", [F.mse_loss, F.l1_loss, F.huber_loss, F.smooth_l1_loss],
                         ids=["mse", "l1", "huber", "smooth_l1"])
def test_losses_over_no_elements_differentiate_twice_as_torch(loss):
    def program(lib):
        x, t = lib.leaf(torch.zeros(0)), lib.leaf(torch.zeros(0))
        go = lib.leaf(1.0)
        value = loss(x, t)
        (g,) = lib.grad(value, [x], go, create_graph=True)
        return value, g, lib.grad(g.sum(), [go], allow_unused=True)

    same_as_torch(program)


def test_sgn_gives_a_zero_that_stays_zero_and_sign_a_plain_one():
    def program(lib):
        x = lib.leaf([0.0, 2.0])
        (x ** 0.5).sgn().sum().backward()
        first = x.grad.clone()
        x.grad = None
        (x ** 0.5).sign().sum().backward()
        return first, x.grad, lib.grad(x.sgn().sum(), [x])

    same_as_torch(program)


def test_nan_to_num_lets_a_nan_gradient_through():
    def program(lib):
        x = lib.leaf([float("nan"), float("inf"), 1.0])
        y = torch.nan_to_num(x, nan=1.0)
        y.backward(lib.const([float("nan"), 2.0, float("inf")]))
        return y, x.grad

    same_as_torch(program)


@pytest.mark.parametrize("shapes", [((0,), (0,)), ((2, 0), (3, 0)), ((0,), (2, 0))],
                         ids=["vectors", "matrices", "vector_matrix"])
def test_inner_of_empty_tensors(shapes):
    def program(lib):
        a, b = lib.leaf(torch.zeros(shapes[0])), lib.leaf(torch.zeros(shapes[1]))
        out = torch.inner(a, b)
        (out + 1).sum().backward()
        return out, a.grad, b.grad

    same_as_torch(program)


# -- item 16: what each rule keeps -----------------------------------------------------------
def _pos(lib):
    return lib.leaf([0.5, 1.25, 2.0])


SAVED_LIKE_TORCH = {  # name: (inputs, op); each input and the output is changed in turn
    "pow_tensor": (lambda lib: [_pos(lib), lib.leaf([1.5, -0.5, 2.0])], torch.pow),
    "pow_tensor_const": (lambda lib: [_pos(lib), lib.const([1.5, -0.5, 2.0])], torch.pow),
    "pow_number_exponent": (lambda lib: [_pos(lib)], lambda x: x ** 3),
    "pow_number_base": (lambda lib: [_pos(lib)], lambda x: torch.pow(2.0, x)),
    # once deliberate differences; torch's fused kernels made them the same (branch 'fused')
    "max_pool1d": (lambda lib: [lib.leaf([[[0.5, 1.0, 2.0]]])], lambda x: F.max_pool1d(x, 2)),
    "instance_norm_weight": (lambda lib: [lib.leaf([[[0.5, 1.0, 2.0]]]), lib.leaf([1.5])],
                             lambda x, w: F.instance_norm(x, weight=w)),
    "nll_loss": (lambda lib: [lib.leaf([[0.5, 1.0, 2.0]]), lib.const([1]).long()], F.nll_loss),
    "layer_norm": (lambda lib: [lib.leaf([[0.5, 1.0, 2.0]]), lib.leaf([1.0, 2.0, 3.0]),
                                lib.leaf([0.1, 0.2, 0.3])], lambda x, w, b: F.layer_norm(x, (3,), w, b)),
    "rpow": (lambda lib: [_pos(lib)], lambda x: 2 ** x),
    "rdiv": (lambda lib: [_pos(lib)], lambda x: 2 / x),
    "float_power": (lambda lib: [_pos(lib), lib.leaf([1.5, -0.5, 2.0])], torch.float_power),
    "max_binary": (lambda lib: [_pos(lib), lib.leaf([1.0, 1.0, 1.0])], torch.max),
    "min_binary": (lambda lib: [_pos(lib), lib.leaf([1.0, 1.0, 1.0])], torch.min),
    "maximum": (lambda lib: [_pos(lib), lib.leaf([1.0, 1.0, 1.0])], torch.maximum),
    "hardtanh": (lambda lib: [lib.leaf([-2.0, 0.5, 3.0])], F.hardtanh),
    "relu6": (lambda lib: [lib.leaf([-2.0, 0.5, 7.0])], F.relu6),
    "erfinv": (lambda lib: [lib.leaf([-0.5, 0.1, 0.7])], torch.erfinv),
    "sgn": (lambda lib: [lib.leaf([-2.0, 0.0, 3.0])], torch.sgn),
    "sign": (lambda lib: [lib.leaf([-2.0, 0.0, 3.0])], torch.sign),
    "fmod_scalar": (lambda lib: [_pos(lib)], lambda x: torch.fmod(x, 0.75)),
    "remainder_scalar": (lambda lib: [_pos(lib)], lambda x: x % 0.75),
    "fmod_tensor": (lambda lib: [_pos(lib), lib.leaf([0.75, 0.5, 1.5])], torch.fmod),
    "remainder_tensor_const": (lambda lib: [_pos(lib), lib.const([0.75, 0.5, 1.5])], torch.remainder),
    "index_add": (lambda lib: [_pos(lib), lib.const([0, 2]).long(), lib.const([1.0, 2.0])],
                  lambda x, i, s: x.index_add(0, i, s)),
    "l1_loss": (lambda lib: [_pos(lib), lib.leaf([1.0, 0.0, 1.0])], F.l1_loss),
    "kl_div": (lambda lib: [lib.leaf([-0.7, 0.2, 0.7]), lib.leaf([0.2, 0.3, 0.5])],
               lambda a, b: F.kl_div(a, b, reduction="batchmean")),
    "kl_div_log_target": (lambda lib: [_pos(lib), lib.leaf([0.2, 0.3, 0.5])],
                          lambda a, b: F.kl_div(a, b, reduction="sum", log_target=True)),
    "margin_ranking": (lambda lib: [_pos(lib), lib.leaf([1.0, 0.0, 1.0]), lib.const([1.0, -1.0, 1.0])],
                       F.margin_ranking_loss),
    "xlogy": (lambda lib: [lib.leaf([0.0, 1.0, 2.0]), _pos(lib)], torch.xlogy),
    "tensor_split": (lambda lib: [_pos(lib), lib.const([1]).long()],
                     lambda x, i: torch.tensor_split(x, i)[1]),
}


def _changed_in_place(make, op, which, twice=False):
    """Change input ``which`` (or the output: -1) in place after the op, then backward (twice
    when ``twice``, without retain_graph); return the gradients."""
    def program(lib):
        inputs = make(lib)
        out = op(*inputs)
        if which is not None:
            with torch.no_grad():
                (out if which == -1 else inputs[which]).add_(0)  # a new version, same values
        out.sum().backward()
        if twice:
            out.sum().backward()
        return [t.grad for t in inputs]
    return program


def _outcome(program, lib):
    try:
        program(Lib(lib))
        return "ok"
    except RuntimeError as e:
        return "modified" if "modified by an inplace" in str(e) else \
            "freed" if "second time" in str(e) else str(e)


@pytest.mark.parametrize("name", SAVED_LIKE_TORCH)
def test_rules_keep_what_torch_keeps(name):
    make, op = SAVED_LIKE_TORCH[name]
    n = len(make(Lib("torch")))
    for which in [None, -1, *range(n)]:
        program = _changed_in_place(make, op, which)
        want = _outcome(program, "torch")
        assert _outcome(program, "gg") == want, f"changing {which} in place: torch {want}"
        if want == "ok":
            same_as_torch(program)
    twice = _changed_in_place(make, op, None, twice=True)
    assert _outcome(twice, "gg") == _outcome(twice, "torch"), "second backward"


# Deliberate: torch keeps a tensor whose values its backward never reads (only the shape, or
# whether it was given); graphgrad keeps the shape. An in-place change of it afterwards is an
# error in torch only; the gradient does not depend on it.
KEPT_ONLY_BY_TORCH = {  # name: (inputs, op, which input torch keeps)
    "gather": (lambda lib: [_pos(lib), lib.const([2, 0]).long()], lambda x, i: x.gather(0, i), 0),
    "take": (lambda lib: [_pos(lib), lib.const([2, 0]).long()], torch.take, 0),
    "masked_select": (lambda lib: [_pos(lib), lib.const([1, 0, 1]).bool()], torch.masked_select, 0),
    "index_add_source_shape": (lambda lib: [_pos(lib), lib.const([0, 2]).long(), lib.leaf([1.0, 2.0])],
                               lambda x, i, s: x.index_add(0, i, s), 2),
    "pad_reflect": (lambda lib: [lib.leaf([[[0.5, 1.0, 2.0]]])], lambda x: F.pad(x, (1, 1), "reflect"), 0),
    "pad_replicate": (lambda lib: [lib.leaf([[[0.5, 1.0, 2.0]]])],
                      lambda x: F.pad(x, (1, 1), "replicate"), 0),
    "avg_pool1d": (lambda lib: [lib.leaf([[[0.5, 1.0, 2.0]]])], lambda x: F.avg_pool1d(x, 2), 0),
    "cummax": (lambda lib: [_pos(lib)], lambda x: x.cummax(0).values, 0),
    "cummin": (lambda lib: [_pos(lib)], lambda x: x.cummin(0).values, 0),
    "lerp_weight_alone": (lambda lib: [lib.const([1.0, 2.0]), lib.const([3.0, 4.0]), lib.leaf([0.3, 0.6])],
                          torch.lerp, 2),
}

# Deliberate: torch's composite keeps intermediates (scaled or broadcast copies) where
# graphgrad's single rule keeps the input itself: an in-place change of it is an error in
# graphgrad only.
KEPT_ONLY_BY_GRAPHGRAD = {
    "scaled_dot_product_attention": (
        lambda lib: [lib.leaf([[[0.5, 1.0], [2.0, 0.5]]]), lib.leaf([[[1.0, 0.0], [0.5, 1.5]]]),
                     lib.leaf([[[1.0, 2.0], [3.0, 4.0]]])], F.scaled_dot_product_attention, 0),
    "take_along_dim_indices": (lambda lib: [lib.leaf(A), lib.const([[0], [2]]).long()],
                               lambda x, i: torch.take_along_dim(x, i, 1), 1),
}



@pytest.mark.parametrize("table,torch_raises", [(KEPT_ONLY_BY_TORCH, True),
                                                (KEPT_ONLY_BY_GRAPHGRAD, False)],
                         ids=["kept_only_by_torch", "kept_only_by_graphgrad"])
def test_documented_differences_in_what_rules_keep(table, torch_raises):
    for name, (make, op, which) in table.items():
        program = _changed_in_place(make, op, which)
        got = (_outcome(program, "torch"), _outcome(program, "gg"))
        assert got == (("modified", "ok") if torch_raises else ("ok", "modified")), (name, got)
        same_as_torch(_changed_in_place(make, op, None))  # unchanged: the same gradients



# Deliberate (issue 39, item 11): a backward through these runs a second time in graphgrad,
# whose rules keep no tensor for them; torch refuses it as a second backward (its CopySlices
# drops the op it wraps after one pass). The first pass's gradients are the same.
SECOND_BACKWARD_ONLY_IN_GRAPHGRAD = {
    "setitem_slice": (lambda lib: [_pos(lib), lib.leaf([4.0])],
                      lambda x, z: _set_first(x * 2, z)),
    "setitem_number": (lambda lib: [_pos(lib)], lambda x: _set_first(x.clone(), 5.0)),
}


def test_as_strided_keeps_its_input_so_a_second_backward_is_refused():
    """Deliberate (found by the extended fuzzer): torch's AsStridedBackward keeps the input's
    geometry, graphgrad's rule the input itself, which a pass without retain_graph frees: a
    second backward runs in torch only. The first pass's gradients are the same."""
    make, op = (lambda lib: [_pos(lib)]), (lambda x: x.as_strided((2,), (0,)))
    twice = _changed_in_place(make, op, None, twice=True)
    assert (_outcome(twice, "torch"), _outcome(twice, "gg")) == ("ok", "freed")
    same_as_torch(_changed_in_place(make, op, None))


def _set_first(y, value):
    y[:1] = value
    return y


@pytest.mark.parametrize("name", SECOND_BACKWARD_ONLY_IN_GRAPHGRAD)
def test_documented_second_backwards_that_torch_refuses(name):
    make, op = SECOND_BACKWARD_ONLY_IN_GRAPHGRAD[name]
    twice = _changed_in_place(make, op, None, twice=True)
    assert (_outcome(twice, "torch"), _outcome(twice, "gg")) == ("freed", "ok")
    same_as_torch(_changed_in_place(make, op, None))


def test_fill_zero_and_xlogy_spellings_match_torch():
    """Rules added with this comparison: fill_/zero_ (a zero gradient for the old values, the
    sum for a tensor fill value) and every spelling of xlogy."""
    def program(lib):
        x, v = lib.leaf([0.5, 1.5, 2.0]), lib.leaf(0.25)
        a, b, c = x * 1, x * 2, x * 3
        a.fill_(v)
        b.zero_()
        c.fill_(2.0)
        d = x * 1
        d.xlogy_(lib.leaf([1.0, 2.0, 3.0]))
        e = x.xlogy(x) + torch.special.xlogy(x, 2.0) + torch.xlogy(0.0, x)
        (a * 2 + b + c * 3 + d + e).sum().backward()
        return x.grad, v.grad, a, d, e

    same_as_torch(program)


@pytest.mark.parametrize("op", ["max", "min", "median"])
@pytest.mark.parametrize("data", [[[float("nan"), 0.5], [0.5, 2.0]], [[2.0, 0.5], [2.0, -2.0]]])
def test_a_nan_gradient_into_a_whole_tensor_reduction_as_torch(op, data):
    """Found by the fuzzer: a NaN gradient into ``x.max()`` reached every element of x where
    torch's CPU kernel puts zeros off the chosen ones (``evenly_distribute_backward`` fills a
    mask); ties and a NaN result share the gradient evenly in both."""
    def program(lib):
        x = lib.leaf(data)
        y = getattr(x, op)()
        y.atan().backward()  # atan(NaN) is NaN: the gradient into the reduction is NaN
        first = x.grad
        x.grad = None
        (g,) = lib.grad(getattr(x, op)() * 3, [x], create_graph=True)
        (gg_,) = lib.grad((g * x).sum(), [x])
        return first, g, gg_

    same_as_torch(program)


@pytest.mark.parametrize("dim", [None, -1, 0])
def test_prod_with_a_zero_and_a_nan_as_torch(dim):
    """Found by the fuzzer: with a zero in the input, torch multiplies the other elements out
    (a NaN among them gives NaN), where graphgrad gave 0 off the zero."""
    def program(lib):
        x = lib.leaf([[float("nan"), 0.5, 0.0], [2.0, 0.0, 0.0], [1.5, 2.0, 3.0]])
        y = x.prod() if dim is None else x.prod(dim)
        (g,) = lib.grad(y.sum(), [x], create_graph=True)
        x.grad = None
        y = x.prod() if dim is None else x.prod(dim)
        y.sum().backward()
        return g, x.grad

    same_as_torch(program)


# -- issue 39, item 1: an output that aliases an input is a view of it -----------------------
ALIASING_EQUATIONS = {"transpose": "ij->ji", "identity": "ij->ij", "implicit": "ij",
                      "diagonal": "ii->i", "permute3": "ijk->kji"}


def _square(lib, equation):
    data = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.75], [1.0, 2.0, 3.0]]
    if equation.count(",") == 0 and len(equation.split("->")[0]) == 3:
        return lib.leaf([data, [[2 * v for v in row] for row in data]])
    return lib.leaf(data)


@pytest.mark.parametrize("equation", ALIASING_EQUATIONS.values(), ids=ALIASING_EQUATIONS.keys())
def test_einsum_that_returns_its_operand_is_a_view_of_it(equation):
    """Found by random programs against torch.autograd: ``einsum('ij->ji', y)`` is ``y``'s
    transpose in both libraries, but graphgrad did not make it a view for autograd, so an
    in-place change through one alias missed the other's gradient (x.grad 1 where torch's
    is 3), and an in-place op on such a view of a leaf was allowed."""
    def operand_changed(lib):
        x = _square(lib, equation)
        y = x * 1
        e = torch.einsum(equation, y)
        y.mul_(3)
        (e * e).sum().backward()
        return x.grad, e

    def result_changed(lib):
        x = _square(lib, equation)
        y = x * 1
        torch.einsum(equation, y).mul_(3)
        (y * y).sum().backward()
        return x.grad, y

    def of_a_leaf(lib):
        torch.einsum(equation, _square(lib, equation)).relu_()

    def made_under_no_grad(lib):
        y = _square(lib, equation) * 1
        with torch.no_grad():
            e = torch.einsum(equation, y)
        e.mul_(2)

    same_as_torch(operand_changed)
    same_as_torch(result_changed)
    same_as_torch(of_a_leaf, RuntimeError, "a view of a leaf Variable", "view of a leaf Variable")
    same_as_torch(made_under_no_grad, RuntimeError, "no_grad mode", "no_grad mode")


def test_einsum_of_a_view_inherits_how_that_view_was_made():
    """Found by the extended fuzzer: einsum's view of a view made under no_grad, of an output
    of unbind, or of a custom Function's output returned as is, may not be changed in place,
    as that view itself may not (torch refuses each)."""
    def no_grad_view(lib):
        a = lib.leaf([[1.0, 2.0], [3.0, 4.0]]) * 1
        with torch.no_grad():
            v = a.view_as(a)
        torch.einsum("ii->i", v).add_(1)

    def unbound(lib):
        a = lib.leaf([[1.0, 2.0], [3.0, 4.0]]) * 1
        torch.einsum("i->i", a.unbind(0)[-1]).add_(1)

    def function_output(lib):
        a = lib.leaf([[1.0, 2.0], [3.0, 4.0]]) * 1
        torch.einsum("ij->ji", identity(lib).apply(a)).add_(1)

    same_as_torch(no_grad_view, RuntimeError, "no_grad mode", "no_grad mode")
    same_as_torch(unbound, RuntimeError, "modified inplace", "multiple views")
    same_as_torch(function_output, RuntimeError, "modified inplace", "custom Function")


# -- issue 39, item 5: in-place ops on views that overlap themselves --------------------------
OVERLAPPING = {
    "unfold": lambda y: y.unfold(0, 2, 1),
    "as_strided": lambda y: y.as_strided((2, 2), (1, 1)),
}


@pytest.mark.parametrize("make", OVERLAPPING.values(), ids=OVERLAPPING.keys())
def test_an_in_place_op_on_a_view_that_overlaps_itself_is_refused(make):
    """``y.unfold(0, 2, 1).lerp_(w, .5)`` writes two elements of the view to one location;
    the op has no derivative there. torch's overlap check gives up on such layouts and its
    gradient comes out wrong ([.5, 2, .5] for [.5, .5, .5]); graphgrad refuses it as it
    refuses an in-place op on an expanded view (a deliberate difference,
    docs/reliability.md)."""
    x = gg.as_tensor(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), requires_grad=True)
    y = x * 1
    with pytest.raises(RuntimeError, match="single memory location"):
        make(y).lerp_(torch.ones(2, 2, dtype=torch.float64), 0.5)
    y.sum().backward()  # nothing changed: the graph is intact
    assert torch.equal(x.grad, torch.ones(3, dtype=torch.float64))


def test_an_in_place_op_on_a_view_that_does_not_overlap_is_recorded():
    """The exact check: a stepped unfold, and a layout no sort-by-stride test clears."""
    def program(lib):
        x = lib.leaf([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
        y = x * 1
        y.unfold(0, 2, 2).mul_(2)  # windows side by side
        y.as_strided((3, 2), (2, 3)).mul_(3)  # offsets 0, 3, 2, 5, 4, 7: all distinct
        (y * y).sum().backward()
        return x.grad, y

    same_as_torch(program)


@pytest.mark.parametrize("mode", ["floor", "trunc"])
def test_a_rounding_division_gives_its_divisor_a_zero_gradient(mode):
    """Found by the extended fuzzer (a 0-d leaf as divisor): torch's formula gives both inputs
    of a floor/trunc division zeros; graphgrad gave the divisor None (its .grad stayed None,
    Node hooks saw None)."""
    def program(lib):
        x, d = lib.leaf([[0.5], [1.5]]), lib.leaf(2.0)
        y = x.abs().div(d, rounding_mode=mode)
        seen = []
        y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_inputs))
        (y * 3).sum().backward()
        return x.grad, d.grad, seen

    same_as_torch(program)


@pytest.mark.parametrize("x, d", [(1e300, 1e200), (1e-300, 1e-200), (3.0, 1e-170)])
def test_a_divisor_gradient_is_computed_in_torchs_order(x, d):
    """Silently wrong divisor gradient: graphgrad computed -g * x / (d * d), whose d * d
    overflows (or underflows) where torch's -g * ((x / d) / d) does not: for x / d at
    1e300 / 1e200 it gave -0 for torch's -1e-100. Found by the fuzzer (seed 901) as a second
    derivative of a norm at 7e200: NaN for torch's -inf."""
    grads = []
    for make in (lambda v: gg.as_tensor(torch.tensor(v, dtype=torch.float64), requires_grad=True),
                 lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=True)):
        a, b = make(x), make(d)
        (a / b).backward()
        grads.append((a.grad, b.grad))
    (ga, gb), (ta, tb) = grads
    assert torch.equal(ga, ta) and torch.equal(gb, tb), (gb, tb)  # exact: 1e-100 is not 0


def test_second_order_of_a_norm_near_overflow():
    """The fuzzer's program: the second derivative of a norm at 7e200 through its own value."""
    def program(lib):
        x = lib.leaf([[-0.5781]])
        y = (800 * x.abs()).exp()
        n = y.norm()
        g = lib.grad((n.sin() + n * n).sum(), [n, y], create_graph=True)
        return lib.grad(sum((t.sin() + t * t).sum() for t in g), [n, y])

    same_as_torch(program)
