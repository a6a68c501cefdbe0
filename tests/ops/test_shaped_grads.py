"""``derivative(shaped=...)``: rules that return a parameter's gradient shaped like it, in the
output's dtype and on its device. The engine keeps no metadata for such an argument when it
has the output's dtype and device (nothing to reduce, cast or move in backward), and keeps it
otherwise. The rule's promise is checked here on its raw outputs (``Node.apply``, before the
engine fits anything); op_db's comparisons with torch.autograd check the same gradients end
to end."""

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from graphgrad.rules import RULES, derivative
from helpers import F64


def r(*shape, dtype=F64):
    return torch.randn(shape, dtype=dtype)


def _find(node, name):
    """The first node named ``name`` reachable from ``node`` (depth first)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if n.name() == name:
            return n
        stack.extend(n.next_nodes)
    raise AssertionError(f"no {name} in the graph")


# name: (function of graphgrad tensors, input factories, node name, output shape of that node)
CASES = {
    "linear_2d": (F.linear, [lambda: r(5, 3), lambda: r(4, 3), lambda: r(4)], "LinearBackward"),
    "linear_3d": (F.linear, [lambda: r(2, 5, 3), lambda: r(4, 3), lambda: r(4)], "LinearBackward"),
    "linear_1d": (F.linear, [lambda: r(3), lambda: r(4, 3)], "LinearBackward"),
    "conv2d": (F.conv2d, [lambda: r(2, 3, 6, 6), lambda: r(4, 3, 3, 3), lambda: r(4)],
               "ConvBackward"),
    "conv1d_same": (lambda x, w: F.conv1d(x, w, padding="same"),  # (an even kernel: padded)
                    [lambda: r(2, 3, 7), lambda: r(4, 3, 2)], "ConvBackward"),
    "softmax_0d": (lambda x: torch.softmax(x, 0), [lambda: r()], "SoftmaxBackward"),
    "softmax_3d": (lambda x: torch.softmax(x, 1), [lambda: r(2, 3, 4)], "SoftmaxBackward"),
    "log_softmax": (lambda x: F.log_softmax(x, -1), [lambda: r(3, 5)], "LogSoftmaxBackward"),
    "nll_loss_1d": (lambda x: F.nll_loss(x, torch.tensor(2)), [lambda: r(5)], "NllLossBackward"),
    "nll_loss_2d": (lambda x: F.nll_loss(x, torch.tensor([0, 2, 1]), reduction="none"),
                    [lambda: r(3, 4)], "NllLossBackward"),
    "nll_loss_4d": (lambda x: F.nll_loss(x, torch.zeros(2, 3, 3, dtype=torch.long)),
                    [lambda: r(2, 4, 3, 3)], "NllLoss2dBackward"),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (4,), w, b),
                   [lambda: r(3, 4), lambda: r(4), lambda: r(4)], "NativeLayerNormBackward"),
    "batch_norm": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                   [lambda: r(4, 3, 2), lambda: r(3), lambda: r(3)], "NativeBatchNormBackward"),
    # views: the gradient is the input's shape by construction
    "reshape": (lambda x: x.reshape(6, 2), [lambda: r(3, 4)], "ReshapeBackward"),
    "flatten": (lambda x: x.flatten(1), [lambda: r(2, 3, 4)], "ReshapeBackward"),
    "view": (lambda x: x.view(4, 3), [lambda: r(3, 4)], "ViewBackward"),
    "unsqueeze": (lambda x: x.unsqueeze(1), [lambda: r(3, 4)], "UnsqueezeBackward"),
    "transpose": (lambda x: x.transpose(0, 2), [lambda: r(2, 3, 4)], "TransposeBackward"),
    "t": (lambda x: x.t(), [lambda: r(3, 4)], "TBackward"),
    "mT": (lambda x: x.mT, [lambda: r(2, 3, 4)], "TBackward"),
    "T": (lambda x: x.T, [lambda: r(3, 4)], "ReverseDimsBackward"),
    "permute": (lambda x: x.permute(2, 0, 1), [lambda: r(2, 3, 4)], "PermuteBackward"),
    "movedim": (lambda x: x.movedim(0, -1), [lambda: r(2, 3, 4)], "MovedimBackward"),
    "select": (lambda x: x.select(1, 2), [lambda: r(2, 3, 4)], "SelectBackward"),
    "narrow": (lambda x: x.narrow(2, -3, 2), [lambda: r(2, 3, 4)], "NarrowBackward"),
    "diagonal": (lambda x: x.diagonal(1), [lambda: r(3, 4)], "DiagonalBackward"),
    "getitem_basic": (lambda x: x[1:, None, ..., 0], [lambda: r(3, 4, 5)], "GetitemBackward"),
    "getitem_advanced": (lambda x: x[:, torch.tensor([0, 2, 2])], [lambda: r(3, 4)],
                         "GetitemBackward"),
    "getitem_mask": (lambda x: x[torch.tensor([True, False, True])], [lambda: r(3, 4)],
                     "GetitemBackward"),
}


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_shaped_rule_returns_gradients_shaped_like_its_inputs(name):
    fn, makers, node_name = CASES[name]
    torch.manual_seed(0)
    values = [m() for m in makers]
    ours = [gg.as_tensor(v.clone(), requires_grad=True) for v in values]
    out = fn(*ours)
    node = _find(out.grad_fn, node_name)
    rule = node.rule
    assert rule.shaped is not None, f"{node_name}'s rule is not declared shaped"
    # the node's own output: the tensor the rule differentiates (out itself, or a step below)
    grads = [torch.randn(s, dtype=F64) if s is not None else None for s in _output_shapes(node, out)]
    raw = node.apply(grads, False)
    raw = raw if isinstance(raw, tuple) else (raw,)
    for j, nxt in enumerate(node.next_nodes):
        pos = node.slot_pos[j]
        if nxt is None or type(pos) is tuple or not rule.shaped[pos] or pos >= len(raw):
            continue
        g = raw[pos]
        assert g is None or tuple(g.shape) == tuple(_input_shape(nxt, node, j)), (
            f"{node_name}: gradient {pos} ({rule.params[pos]}) has shape {tuple(g.shape)}")
        assert node.input_meta[j] is None  # nothing kept: same dtype and device as the output
    # and end to end, torch's gradients
    ref = [v.clone().requires_grad_(True) for v in values]
    gout = torch.randn_like(fn(*ref))
    torch.autograd.backward(fn(*ref), gout)
    torch.autograd.backward(out, gg.as_tensor(gout))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(torch.Tensor(a.grad), b.grad)


def _output_shapes(node, out):
    """The shapes of the gradients ``node.apply`` takes: its op's outputs."""
    if node is out.grad_fn:
        return [tuple(out.shape)] + [None] * (node.num_outputs - 1)
    if node.name().startswith("NllLoss2d"):  # nll_loss on 4-d: the loss of the flattened view
        return [tuple(out.shape) if out.dim() else ()] + [None] * (node.num_outputs - 1)
    # layer_norm / batch_norm: the first output has the input's shape
    return [tuple(out.shape)] + [None] * (node.num_outputs - 1)


def _input_shape(parent, node, j):
    """The shape of the node's j-th input, as the engine would fit to: the leaf's, or the
    parent op's output."""
    if parent.name() == "AccumulateGrad":
        return parent.variable.shape
    raise AssertionError("the cases above feed leaves to the shaped node")


def test_linear_keeps_metadata_for_its_bias_only():
    x, w, b = (gg.as_tensor(r(*s), requires_grad=True) for s in ((5, 3), (4, 3), (4,)))
    node = F.linear(x, w, b).grad_fn
    assert node.input_meta[0] is None and node.input_meta[1] is None
    assert node.input_meta[2] is not None  # the engine sums grad to the bias's shape
    F.linear(x, w, b).sum().backward()
    assert b.grad.shape == (4,)


def test_a_leafs_record_is_kept_until_the_leaf_changes():
    """A leaf's (size, dtype, device) record is made once and reused by later recordings (a
    bias in every step), and made again after ``.data =`` gives the leaf another size, dtype
    or device: the gradient is then fitted to what the leaf is at recording time."""
    x = gg.as_tensor(r(5, 3))
    w = gg.as_tensor(r(4, 3), requires_grad=True)
    b = gg.as_tensor(r(4), requires_grad=True)
    first = F.linear(x, w, b).grad_fn.input_meta[2]
    assert F.linear(x, w, b).grad_fn.input_meta[2] is first
    for data in (r(1), r(4, dtype=torch.float32), r()):  # broadcast, another dtype, 0-d
        b.data = data
        xd, wd = x.to(data.dtype), w.to(data.dtype)
        node = F.linear(xd, wd, b).grad_fn
        assert node.input_meta[2] is not first
        assert node.input_meta[2] == (data.shape, data.dtype, data.device)
        b.grad = None
        F.linear(xd, wd, b).sum().backward()
        assert b.grad.shape == data.shape and b.grad.dtype == data.dtype
        want = torch.full(data.shape, 20.0, dtype=data.dtype)  # 5 rows x 4 columns (or 5 x 1)
        if data.shape == (4,):
            want = torch.full((4,), 5.0, dtype=data.dtype)
        torch.testing.assert_close(torch.Tensor(b.grad), want)
        first = node.input_meta[2]


def test_another_dtype_keeps_metadata_and_casts_back():
    """log_softmax(dtype=float64) of a float32 input: the gradient comes in float64, the
    input's is float32."""
    v = torch.randn(3, 4)
    x = gg.as_tensor(v.clone(), requires_grad=True)
    out = torch.log_softmax(x, 1, dtype=F64)
    assert out.grad_fn.input_meta[0] is not None
    out.sum().backward()
    t = v.clone().requires_grad_(True)
    torch.log_softmax(t, 1, dtype=F64).sum().backward()
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(torch.Tensor(x.grad), t.grad)


def test_autocast_linear_casts_gradients_to_each_input():
    torch.manual_seed(0)
    values = [torch.randn(5, 3), torch.randn(4, 3), torch.randn(4)]
    ours = [gg.as_tensor(v.clone(), requires_grad=True) for v in values]
    ref = [v.clone().requires_grad_(True) for v in values]
    for args in (ours, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = F.linear(*args)
        out.float().sum().backward()
    for a, b in zip(ours, ref):
        assert a.grad.dtype == b.grad.dtype == torch.float32
        torch.testing.assert_close(torch.Tensor(a.grad), b.grad)


def test_a_mixed_device_scalar_keeps_its_metadata():
    """A shaped rule whose argument is on another device than the output (only a CPU scalar
    can be, beside a CUDA tensor) keeps that argument's metadata; on CPU every argument has
    the output's device, and the test is that ``same_kind`` says so."""
    from graphgrad.fastcalls import tensor_same_kind
    a, b = torch.randn(2), torch.randn(3)
    assert tensor_same_kind(a, b) and tensor_same_kind(gg.as_tensor(a), b)
    assert not tensor_same_kind(a, b.double())


def test_shaped_names_parameters():
    def op(x):
        return x

    def op_rule(grad, input):
        return grad

    with pytest.raises(ValueError, match="unknown parameters"):
        derivative(op, shaped=("nope",))(op_rule)
    assert op not in RULES
    with pytest.raises(ValueError, match="elementwise"):
        derivative(op, elementwise=True, shaped=("input",))
    assert op not in RULES
