"""Recurrent layers: torch.lstm, gru, rnn_tanh, rnn_relu (padded and packed overloads, several
layers, both directions, batch_first, dropout between layers, LSTM projections), their cells,
and the packing ops under nn.utils.rnn; then nn.LSTM/GRU/RNN and their cells trained step by
step beside torch.

Each functional call is compared with torch.autograd in float64: outputs, the gradients of
every input, initial state and weight for a random upstream gradient, and second derivatives
(``op_cases.compare``); ``gg.gradcheck`` checks a few against finite differences. op_db has no
OpInfo for these functions (``test_op_db_has_no_recurrent_opinfo`` says when one appears).
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call
from torch.nn.utils import rnn as rnn_utils

import graphgrad as gg
from op_cases import F64, TOL, plain
from op_cases import compare as compare_leaves

REFERENCE = {}  # no OpInfo in op_db (see test_op_db_has_no_recurrent_opinfo)

MODES = {"lstm": torch.lstm, "gru": torch.gru, "rnn_tanh": torch.rnn_tanh,
         "rnn_relu": torch.rnn_relu}
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
CELLS = {"lstm": torch.lstm_cell, "gru": torch.gru_cell, "rnn_tanh": torch.rnn_tanh_cell,
         "rnn_relu": torch.rnn_relu_cell}
INPUT, HIDDEN, PROJ = 3, 4, 2
LENGTHS = [5, 3, 3, 1]  # packed: batch_sizes [4, 3, 3, 1, 1]
STEPS, BATCH = 5, 4


def compare(fn, tensors, **kw):
    """op_cases.compare, every input required to reach an output."""
    return compare_leaves(fn, tensors, allow_unused=False, **kw)


def rand(gen, *shape, scale=0.5):
    return torch.randn(shape, dtype=F64, generator=gen) * scale


def weights(gen, mode, layers, directions, bias=True, proj=0, hidden=HIDDEN):
    """The flat parameter list torch.lstm & co. take: per layer and direction
    ``w_ih, w_hh[, b_ih, b_hh][, w_hr]``."""
    gates, out = GATES[mode] * hidden, proj or hidden
    params = []
    for layer in range(layers):
        for _ in range(directions):
            size = INPUT if layer == 0 else out * directions
            params += [rand(gen, gates, size), rand(gen, gates, out)]
            if bias:
                params += [rand(gen, gates), rand(gen, gates)]
            if proj:
                params.append(rand(gen, proj, hidden))
    return params


def batch_sizes_of(lengths):
    return torch.tensor([sum(n > t for n in lengths) for t in range(max(lengths))])


def stack_case(mode, layout, bidirectional, layers=2, bias=True, proj=0, dropout=0.0,
               train=False, seed=0, hidden=HIDDEN, lengths=LENGTHS):
    """``(fn, tensors)``: ``fn(input, h0[, c0], *params)`` calls ``MODES[mode]`` with the
    padded (``layout`` "padded" or "batch_first") or the packed overload; ``len(lengths)``
    sequences of ``lengths`` steps (padded: all ``max(lengths)`` long)."""
    gen = torch.Generator().manual_seed(seed)
    directions = 2 if bidirectional else 1
    batch, steps = len(lengths), max(lengths)
    if layout == "packed":
        sizes = batch_sizes_of(lengths)
        x = rand(gen, int(sizes.sum()), INPUT, scale=1.0)
    else:
        x = rand(gen, *((batch, steps) if layout == "batch_first" else (steps, batch)), INPUT,
                 scale=1.0)
    states = [rand(gen, layers * directions, batch, proj or hidden)]
    if mode == "lstm":
        states.append(rand(gen, layers * directions, batch, hidden))
    params = weights(gen, mode, layers, directions, bias, proj, hidden)
    n_states = len(states)

    def fn(x, *rest):
        hx = list(rest[:n_states]) if mode == "lstm" else rest[0]
        params = list(rest[n_states:])
        if layout == "packed":
            return MODES[mode](x, sizes, hx, params, bias, layers, dropout, train, bidirectional)
        return MODES[mode](x, hx, params, bias, layers, dropout, train, bidirectional,
                           layout == "batch_first")

    return fn, [x, *states, *params]


def seeded(fn, seed=0):
    def run(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return run


# -- whole stacks -------------------------------------------------------------------------------
@pytest.mark.parametrize("bidirectional", [False, True], ids=["forward", "bidirectional"])
@pytest.mark.parametrize("layout", ["padded", "batch_first", "packed"])
@pytest.mark.parametrize("mode", list(MODES))
def test_stack(mode, layout, bidirectional):
    """Two layers: values, gradients of input, states and weights, second derivatives."""
    compare(*stack_case(mode, layout, bidirectional))


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("mode", list(MODES))
def test_stack_without_biases_one_layer(mode, layout):
    compare(*stack_case(mode, layout, True, layers=1, bias=False, seed=1))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("layout", ["padded", "batch_first", "packed"])
def test_lstm_projections(layout, bias):
    """proj_size: h has PROJ features, c has HIDDEN; each layer ends with h @ w_hr.T."""
    compare(*stack_case("lstm", layout, True, layers=2, bias=bias, proj=PROJ, seed=2))


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("mode", list(MODES))
def test_dropout_between_layers_same_masks_as_torch(mode, layout):
    """train=True with dropout: the same seed gives torch's masks (values agree to 1e-7 only if
    every mask element does), on three layers in both directions; the RNG is left where
    torch leaves it."""
    fn, tensors = stack_case(mode, layout, True, layers=3, dropout=0.4, train=True, seed=3)
    have = compare(seeded(fn), tensors)
    without, _ = stack_case(mode, layout, True, layers=3, dropout=0.4, train=False, seed=3)
    assert not torch.allclose(plain(have[0]), plain(without(*tensors)[0]))  # dropout did drop
    after = []
    for lib in ("torch", "gg"):
        args = [gg.as_tensor(t, requires_grad=True) if lib == "gg" else t.clone().requires_grad_()
                for t in tensors]
        seeded(fn, 7)(*args)
        after.append(torch.rand(3))
    assert torch.equal(*after)


def test_dropout_eval_and_zero_draw_nothing():
    """No dropout at train=False or p=0, as torch: the RNG is not touched."""
    for train, p in ((False, 0.5), (True, 0.0)):
        fn, tensors = stack_case("gru", "padded", False, layers=2, dropout=p, train=train)
        torch.manual_seed(0)
        fn(*[gg.as_tensor(t, requires_grad=True) for t in tensors])
        after = torch.rand(2)
        torch.manual_seed(0)
        assert torch.equal(after, torch.rand(2))


def test_dropout_masks_float32():
    """float32 on CPU (where torch's own kernel is oneDNN's): the masks still match."""
    fn, tensors = stack_case("lstm", "padded", True, layers=2, dropout=0.5, train=True, seed=4)
    tensors = [t.float() for t in tensors]
    want = seeded(fn)(*tensors)[0]
    have = seeded(fn)(*[gg.as_tensor(t, requires_grad=True) for t in tensors])[0]
    torch.testing.assert_close(plain(have), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", list(MODES))
def test_keyword_spellings(mode):
    """Both overloads called with keywords bind like torch's own parser."""
    fn, tensors = stack_case(mode, "packed", False, layers=1)
    x, states, params = tensors[0], tensors[1:-4], tensors[-4:]
    sizes = batch_sizes_of(LENGTHS)

    def packed(x, *rest):
        hx = list(rest[:len(states)]) if mode == "lstm" else rest[0]
        return MODES[mode](data=x, batch_sizes=sizes, hx=hx, params=list(rest[len(states):]),
                           has_biases=True, num_layers=1, dropout=0.0, train=False,
                           bidirectional=False)

    def padded(x, *rest):
        hx = list(rest[:len(states)]) if mode == "lstm" else rest[0]
        return MODES[mode](x, hx=hx, params=list(rest[len(states):]), has_biases=True,
                           num_layers=1, dropout=0.0, train=False, bidirectional=False,
                           batch_first=False)

    compare(packed, [x, *states, *params], second_order=False)
    compare(padded, [x[:8].reshape(2, 4, INPUT), *states, *params], second_order=False)


@pytest.mark.parametrize("mode", list(MODES))
def test_stack_gradcheck(mode):
    """Finite differences, packed and bidirectional (input, initial state, the reversed
    direction's weights), and padded on two layers (the second layer's weights)."""
    tiny = {"hidden": 2, "lengths": [3, 1]}
    fn, tensors = stack_case(mode, "packed", True, layers=1, **tiny)
    n = 2 if mode == "lstm" else 1
    grad_at = {0, 1, 1 + n + 4, 1 + n + 5}  # x, h0, the reversed direction's w_hh and b_ih
    args = [gg.as_tensor(t, requires_grad=k in grad_at) for k, t in enumerate(tensors)]
    assert gg.gradcheck(fn, args)
    fn, tensors = stack_case(mode, "padded", False, layers=2, **tiny)
    grad_at = {1 + n + 4, 1 + n + 5, 1 + n + 6}  # the second layer's w_ih, w_hh, b_ih
    args = [gg.as_tensor(t, requires_grad=k in grad_at) for k, t in enumerate(tensors)]
    assert gg.gradcheck(fn, args)


def test_lstm_gradgradcheck():
    fn, tensors = stack_case("lstm", "packed", True, layers=1, proj=1, hidden=2, lengths=[2, 1])
    grad_at = {0, 2, 3 + 1}  # x, c0, the forward direction's w_hh
    args = [gg.as_tensor(t, requires_grad=k in grad_at) for k, t in enumerate(tensors)]
    assert gg.gradgradcheck(lambda *a: fn(*a)[0], args)


def test_only_weights_require_grad():
    """Input and initial state plain, weights graphgrad leaves: the weights get torch's gradients."""
    fn, tensors = stack_case("gru", "packed", True, layers=2)
    x, h0, params = tensors[0], tensors[1], tensors[2:]
    ref = [p.clone().requires_grad_() for p in params]
    want = torch.autograd.grad(fn(x, h0, *ref)[0].sum(), ref)
    ours = [gg.as_tensor(p.clone(), requires_grad=True) for p in params]
    have = gg.grad(fn(x, h0, *ours)[0].sum(), ours)
    for h, w in zip(have, want):
        torch.testing.assert_close(plain(h), w, **TOL)


def test_no_grad_runs_torchs_kernel():
    fn, tensors = stack_case("lstm", "padded", True)
    with torch.no_grad():
        out = fn(*[gg.as_tensor(t, requires_grad=True) for t in tensors])
    assert all(not o.requires_grad for o in out)
    for o, w in zip(out, fn(*tensors)):
        torch.testing.assert_close(plain(o), w, **TOL)


def test_records_steps_not_one_opaque_node():
    """The decomposition records ops that have rules; the output's grad_fn is one of them."""
    fn, tensors = stack_case("rnn_tanh", "padded", False, layers=1)
    out, h_n = fn(*[gg.as_tensor(t, requires_grad=True) for t in tensors])
    assert out.grad_fn.name() == "StackBackward" and h_n.grad_fn.name() == "StackBackward"


def test_wrong_number_of_parameters_raises():
    fn, tensors = stack_case("gru", "padded", False, layers=2)
    x, h0 = (gg.as_tensor(t, requires_grad=True) for t in tensors[:2])
    params = tensors[2:]
    with pytest.raises(RuntimeError, match="got 7 parameters, expected 4 per layer"):
        torch.gru(x, h0, params[:-1], True, 2, 0.0, False, False, False)
    with pytest.raises(RuntimeError, match="lstm expects two hidden states"):
        torch.lstm(x, [h0], params, True, 2, 0.0, False, False, False)


# -- cells ----------------------------------------------------------------------------------------
CELL_BIASES = {"both": (True, True), "none": (False, False), "ih_only": (True, False)}


@pytest.mark.parametrize("biases", list(CELL_BIASES))
@pytest.mark.parametrize("mode", list(CELLS))
def test_cell(mode, biases):
    gen = torch.Generator().manual_seed(5)
    gates = GATES[mode] * HIDDEN
    x, h = rand(gen, 3, INPUT, scale=1.0), rand(gen, 3, HIDDEN)
    c = rand(gen, 3, HIDDEN)
    w = [rand(gen, gates, INPUT), rand(gen, gates, HIDDEN)]
    b_ih, b_hh = CELL_BIASES[biases]
    bias = [rand(gen, gates) if b_ih else None, rand(gen, gates) if b_hh else None]
    given = [b for b in bias if b is not None]

    def fn(x, h, c, w_ih, w_hh, *given_biases):
        it = iter(given_biases)
        b = [next(it) if present else None for present in (b_ih, b_hh)]
        hx = [h, c] if mode == "lstm" else h
        out = CELLS[mode](x, hx, w_ih, w_hh, *b)
        return out if mode == "lstm" else (out, c * 1)  # c reaches an output either way

    compare(fn, [x, h, c, *w, *given])
    args = [gg.as_tensor(t, requires_grad=True) for t in (x, h, c, *w, *given)]
    assert gg.gradcheck(fn, args)


def test_cell_keywords_and_checks():
    gen = torch.Generator().manual_seed(6)
    x, h = rand(gen, 2, INPUT), rand(gen, 2, HIDDEN)
    w_ih, w_hh = rand(gen, 3 * HIDDEN, INPUT), rand(gen, 3 * HIDDEN, HIDDEN)
    compare(lambda x, h, a, b: torch.gru_cell(input=x, hx=h, w_ih=a, w_hh=b), [x, h, w_ih, w_hh])
    bad = [(rand(gen, 2, INPUT + 1), h), (x, rand(gen, 3, HIDDEN)), (x, rand(gen, 2, HIDDEN + 1)),
           (x[0], h)]  # the last: unbatched, which torch's cells reject
    for xb, hb in bad:
        with pytest.raises((RuntimeError, IndexError)) as want:
            torch.gru_cell(xb, hb, w_ih, w_hh)
        with pytest.raises(want.type) as have:
            torch.gru_cell(gg.as_tensor(xb, requires_grad=True), hb, w_ih, w_hh)
        assert str(have.value) == str(want.value)
    with pytest.raises(RuntimeError, match="lstm_cell expects two hidden states"):
        torch.lstm_cell(gg.as_tensor(x, requires_grad=True), [h], w_ih, w_hh)


# -- packing ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_first", [False, True], ids=["time_first", "batch_first"])
@pytest.mark.parametrize("enforce_sorted", [True, False], ids=["sorted", "unsorted"])
def test_pack_then_pad(batch_first, enforce_sorted):
    """pack_padded_sequence of an input that requires grad, pad_packed_sequence back (with a
    padding value and a longer total_length): values, gradients, second derivatives."""
    lengths = LENGTHS if enforce_sorted else [3, 5, 1, 3]
    gen = torch.Generator().manual_seed(7)
    x = rand(gen, *((BATCH, STEPS) if batch_first else (STEPS, BATCH)), 2, scale=1.0)

    def fn(x):
        packed = rnn_utils.pack_padded_sequence(x * x, lengths, batch_first, enforce_sorted)
        out, out_lengths = rnn_utils.pad_packed_sequence(packed, batch_first, -2.0, STEPS + 1)
        assert out_lengths.tolist() == lengths
        return packed.data, out

    compare(fn, [x])
    assert gg.gradcheck(fn, [gg.as_tensor(x, requires_grad=True)])


def test_pad_packed_of_a_computed_packed_sequence():
    gen = torch.Generator().manual_seed(8)
    data = rand(gen, int(batch_sizes_of(LENGTHS).sum()), 3)
    sizes = batch_sizes_of(LENGTHS)
    compare(lambda d: torch._pad_packed_sequence(d.exp(), sizes, False, 0.5, STEPS)[0], [data])
    compare(lambda d: torch._pad_packed_sequence(d, sizes, True, 0.0, STEPS + 2)[0], [data])


def test_pad_sequence_and_pack_sequence():
    gen = torch.Generator().manual_seed(9)
    seqs = [rand(gen, n, 2) for n in (2, 4, 1)]
    for kw in ({}, {"batch_first": True, "padding_value": 3.0}, {"padding_side": "left"}):
        compare(lambda *s, kw=kw: rnn_utils.pad_sequence(list(s), **kw), seqs)
    compare(lambda *s: rnn_utils.pack_sequence(list(s), enforce_sorted=False).data, seqs)
    for one in (torch.ones(2, requires_grad=True), gg.as_tensor(torch.ones(2), requires_grad=True)):
        with pytest.raises(RuntimeError, match="padding_side to be one of left or right"):
            rnn_utils.pad_sequence([one], padding_side="middle")


def test_packing_errors_are_torchs():
    x = rand(torch.Generator().manual_seed(0), STEPS, BATCH, 2)
    for lengths in ([3, 5, 1, 3], [5, 3, 3]):  # unsorted; wrong batch size
        with pytest.raises(RuntimeError) as want:
            torch._pack_padded_sequence(x, torch.tensor(lengths), False)
        with pytest.raises(RuntimeError) as have:
            torch._pack_padded_sequence(gg.as_tensor(x, requires_grad=True),
                                        torch.tensor(lengths), False)
        assert str(have.value) == str(want.value)
    with pytest.raises(RuntimeError, match="Cannot pack empty tensors"):
        torch._pack_padded_sequence(gg.as_tensor(x[:, :, :0], requires_grad=True),
                                    torch.tensor(LENGTHS), False)


# -- models trained beside torch ---------------------------------------------------------------------
class Packed(nn.Module):
    """Linear features, packed (unsorted lengths), a bidirectional 2-layer LSTM with dropout
    on the packed rows between its layers, from learned initial states (which nn.LSTM reorders
    to the sorted batch), padded back."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(INPUT, 3)
        self.rnn = nn.LSTM(3, HIDDEN, num_layers=2, bidirectional=True, batch_first=True,
                           dropout=0.25)
        self.head = nn.Linear(2 * HIDDEN, 1)
        self.h0 = nn.Parameter(torch.randn(4, BATCH, HIDDEN) * 0.1)
        self.c0 = nn.Parameter(torch.randn(4, BATCH, HIDDEN) * 0.1)

    def forward(self, x, lengths):
        packed = rnn_utils.pack_padded_sequence(self.inp(x), lengths, True, enforce_sorted=False)
        out, (h, c) = self.rnn(packed, (self.h0, self.c0))
        padded, _ = rnn_utils.pad_packed_sequence(out, batch_first=True)
        return self.head(padded).sum() + h.pow(2).sum() + c.sum()


class LearnedState(nn.Module):
    """A GRU (or RNN) whose initial state is a parameter: initial states given, and learned."""

    def __init__(self, cls, **kw):
        super().__init__()
        self.rnn = cls(INPUT, HIDDEN, num_layers=2, **kw)
        self.h0 = nn.Parameter(torch.randn(2, 1, HIDDEN) * 0.1)

    def forward(self, x):
        out, h = self.rnn(x, self.h0.expand(2, x.shape[1], HIDDEN).contiguous())
        return out.tanh().sum() + h.sum()


class Unrolled(nn.Module):
    """A cell applied step by step."""

    def __init__(self, cls, **kw):
        super().__init__()
        self.cell = cls(INPUT, HIDDEN, **kw)

    def forward(self, x):
        state, total = None, 0
        for x_t in x.unbind(0):
            state = self.cell(x_t, state)
            h = state[0] if isinstance(state, tuple) else state
            total = total + h.sin().sum()
        return total


def _sum_outputs(model, x):
    out, hidden = model(x)
    hidden = hidden if isinstance(hidden, tuple) else (hidden,)
    return out.pow(2).sum() + sum(h.sum() for h in hidden)


MODELS = {
    "lstm": (lambda: nn.LSTM(INPUT, HIDDEN, num_layers=2), "padded", _sum_outputs),
    "lstm_unbatched": (lambda: nn.LSTM(INPUT, HIDDEN), "unbatched", _sum_outputs),
    "lstm_bidirectional_proj_dropout": (
        lambda: nn.LSTM(INPUT, HIDDEN, num_layers=3, bidirectional=True, proj_size=PROJ,
                        dropout=0.3, batch_first=True), "batch_first", _sum_outputs),
    "gru_bidirectional_batch_first": (
        lambda: nn.GRU(INPUT, HIDDEN, num_layers=2, bidirectional=True, batch_first=True,
                       dropout=0.2), "batch_first", _sum_outputs),
    "rnn_tanh_no_bias": (lambda: nn.RNN(INPUT, HIDDEN, num_layers=2, bias=False), "padded",
                         _sum_outputs),
    "rnn_relu_bidirectional": (
        lambda: nn.RNN(INPUT, HIDDEN, num_layers=2, nonlinearity="relu", bidirectional=True),
        "padded", _sum_outputs),
    "gru_learned_state": (lambda: LearnedState(nn.GRU), "padded", lambda m, x: m(x)),
    "rnn_relu_learned_state": (lambda: LearnedState(nn.RNN, nonlinearity="relu"), "padded",
                               lambda m, x: m(x)),
    "packed_lstm": (Packed, "packed", lambda m, x: m(*x)),
    "lstm_cell": (lambda: Unrolled(nn.LSTMCell), "padded", lambda m, x: m(x)),
    "gru_cell": (lambda: Unrolled(nn.GRUCell), "padded", lambda m, x: m(x)),
    "rnn_cell_tanh": (lambda: Unrolled(nn.RNNCell), "padded", lambda m, x: m(x)),
    "rnn_cell_relu_no_bias": (lambda: Unrolled(nn.RNNCell, nonlinearity="relu", bias=False),
                              "padded", lambda m, x: m(x)),
}


def _batch(layout, step):
    gen = torch.Generator().manual_seed(100 + step)
    if layout == "packed":
        return rand(gen, BATCH, STEPS, INPUT, scale=1.0), [3, 5, 1, 3]
    shape = {"padded": (STEPS, BATCH), "batch_first": (BATCH, STEPS), "unbatched": (STEPS,)}
    return rand(gen, *shape[layout], INPUT, scale=1.0)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_like_torch(name):
    """Three SGD steps with momentum, side by side (``torch.manual_seed(step)`` before each
    forward: the same dropout masks): the loss and every parameter after every step agree."""
    make, layout, loss_fn = MODELS[name]
    torch.manual_seed(0)
    ref = make().to(F64)
    ours = gg.nn.adopt(copy.deepcopy(ref))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    for step in range(3):
        losses = []
        for model, opt in zip((ref, ours), opts):
            opt.zero_grad()
            torch.manual_seed(step)
            loss = loss_fn(model, _batch(layout, step))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-7, abs=1e-9), step
        for (k, p), q in zip(ref.named_parameters(), ours.parameters()):
            assert q.grad is not None and type(q.grad) is torch.Tensor
            torch.testing.assert_close(plain(q), p.detach(), **TOL,
                                       msg=lambda m, k=k, step=step: f"{k} at step {step}: {m}")
    assert all(isinstance(p, gg.nn.Parameter) for p in ours.parameters())


# -- PyTorch's own module samples ------------------------------------------------------------------
RECURRENT_MODULES = ["LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell"]


@pytest.mark.parametrize("name", RECURRENT_MODULES)
def test_module_db_samples(name):
    """Every sample of torch's ModuleInfo for the module (unbatched input, with and without
    initial states, projections, both directions, batch_first, bias or not), called with its
    parameters as arguments (``torch.func.functional_call``): outputs, gradients of input,
    states and parameters, second derivatives."""
    from torch.testing._internal.common_modules import module_db

    (info,) = [m for m in module_db if m.module_cls.__name__ == name]
    samples = info.module_inputs_func(info, device="cpu", dtype=F64, requires_grad=True,
                                      training=True)
    assert samples
    for sample in samples:
        torch.manual_seed(0)
        module = info.module_cls(*sample.constructor_input.args,
                                 **sample.constructor_input.kwargs).to(F64)
        names = [k for k, _ in module.named_parameters()]
        params = [p.detach() for p in module.parameters()]
        # the forward's arguments, tuples (LSTM's (h_0, c_0)) flattened
        shape = [len(a) if isinstance(a, tuple) else 0 for a in sample.forward_input.args]
        flat = [t.detach() for a in sample.forward_input.args
                for t in (a if isinstance(a, tuple) else (a,))]

        def fn(*tensors, shape=shape, n=len(flat), module=module, names=names):
            it = iter(tensors[:n])
            args = tuple(tuple(next(it) for _ in range(k)) if k else next(it) for k in shape)
            out = functional_call(module, dict(zip(names, tensors[n:])), args)
            if not isinstance(out, tuple):
                return out
            return out if isinstance(out[1], torch.Tensor) else (out[0], *out[1])

        compare(fn, flat + params)


def test_op_db_has_no_recurrent_opinfo():
    """When torch adds an OpInfo for these functions, it belongs in REFERENCE."""
    from opdb_harness import OPS_BY_NAME

    names = [n for n in OPS_BY_NAME
             if any(k in n for k in ("lstm", "gru", "rnn", "pack_padded", "pad_packed", "pad_sequence"))]
    assert names == [] or set(names) <= set(REFERENCE), names
