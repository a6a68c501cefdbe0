"""Recurrent layers: torch.lstm, gru, rnn_tanh, rnn_relu (padded or packed input, several
layers, both directions, dropout between layers, LSTM projections), their cells, and the
packing ops under nn.utils.rnn (_pack_padded_sequence, _pad_packed_sequence, pad_sequence).

Every one is a decomposition: it records, step by step, the computation of torch's own CPU
implementation (``aten/src/ATen/native/RNN.cpp``: the input projection of a whole layer at
once, then per step the hidden state's projection, the gates, the new state), so the values are
torch's up to rounding, the gradients are those of ops that already have rules, and a
gradient's graph differentiates again (double backward) without a hand-written backward
through time to get wrong. The price is one recorded op per gate operation and step (about ten
per LSTM step). Dropout between layers is ``torch.dropout`` on each layer's whole output,
called where torch calls it, so the same seed draws the same masks. A packed sequence is run
as torch runs it: step ``t`` updates the first ``batch_sizes[t]`` states; a reversed direction
starts from the last step, taking in a sequence's initial state at the step where that
sequence ends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._compat import VariableFunctions as _VF  # torch._pack_padded_sequence is _VF's
from .._compat import nn_functions as _nn
from ..rules import decomposition

T = torch.Tensor


# -- one step of each cell (RNN.cpp's LSTMCell, GRUCell, SimpleCell) ------------------------
class _Weights:
    """One layer and direction's parameters: ``w_ih, w_hh[, b_ih, b_hh][, w_hr]``."""

    __slots__ = ("w_ih", "w_hh", "b_ih", "b_hh", "w_hr", "w_hh_t", "w_hr_t")

    def __init__(self, w_ih, w_hh, b_ih=None, b_hh=None, w_hr=None):
        self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr = w_ih, w_hh, b_ih, b_hh, w_hr
        self.w_hh_t = self.w_hr_t = None  # transposes, taken once per layer by _input_projection

    @classmethod
    def of(cls, params, has_biases, has_projections):
        if has_biases:
            return cls(*params[:4], params[4] if has_projections else None)
        return cls(params[0], params[1], None, None, params[2] if has_projections else None)


def _lstm_step(gi, state, w):
    """``gi``: this step's input projection plus ``b_hh``. Returns (output, (h, c))."""
    h, c = state
    i, f, g, o = torch.addmm(gi, h, w.w_hh_t).chunk(4, 1)
    c = torch.addcmul(f.sigmoid() * c, i.sigmoid(), g.tanh())
    h = o.sigmoid() * c.tanh()
    if w.w_hr_t is not None:
        h = h.matmul(w.w_hr_t)
    return h, (h, c)


def _gru_step(gi, state, w):
    """``gi``: this step's input projection (``b_hh`` stays inside ``n``'s reset product)."""
    (h,) = state
    i_r, i_z, i_n = gi.chunk(3, 1)
    h_r, h_z, h_n = F.linear(h, w.w_hh, w.b_hh).chunk(3, 1)
    r = (h_r + i_r).sigmoid()
    z = (h_z + i_z).sigmoid()
    n = (i_n + h_n * r).tanh()
    h = (h - n) * z + n
    return h, (h,)


def _tanh_step(gi, state, w):
    h = torch.addmm(gi, state[0], w.w_hh_t).tanh()
    return h, (h,)


def _relu_step(gi, state, w):
    h = torch.addmm(gi, state[0], w.w_hh_t).relu()
    return h, (h,)


_STEPS = {"lstm": _lstm_step, "gru": _gru_step, "rnn_tanh": _tanh_step, "rnn_relu": _relu_step}


def _input_projection(mode, x, w):
    """The whole layer's (or cell's) input projection, once. Except in a GRU (whose ``b_hh``
    is inside the reset gate's product) it includes ``b_hh`` too, so a step is one ``addmm``:
    ``b_hh + h @ w_hh.T + gi`` in another order than torch's sum, the same up to rounding."""
    gi = F.linear(x, w.w_ih, w.b_ih)
    if w.w_hr is not None:
        w.w_hr_t = w.w_hr.t()
    if mode != "gru":
        w.w_hh_t = w.w_hh.t()
        if w.b_hh is not None:
            gi = gi + w.b_hh
    return gi


# -- one layer, one direction ---------------------------------------------------------------
def _padded_layer(step, gi, state, w, reverse):
    """``gi``: ``(T, B, gates)``. Returns the output ``(T, B, H)`` and the final state."""
    steps = gi.unbind(0)
    outputs = [None] * len(steps)
    for t in (reversed(range(len(steps))) if reverse else range(len(steps))):
        outputs[t], state = step(steps[t], state, w)
    return torch.stack(outputs), state


def _packed_layer(step, gi, sizes, state, w, reverse):
    """``gi``: packed rows, ``sizes[t]`` of them at step ``t``. Forward, a sequence's final state
    is set aside at its last step (RNN.cpp's PackedLayer); reversed, its initial state joins
    at its last step (ReversedPackedLayer)."""
    steps = gi.split(sizes)
    outputs = [None] * len(sizes)
    if not reverse:
        finished = []
        for t, n in enumerate(sizes):
            if n < state[0].shape[0]:
                finished.append(tuple(s[n:] for s in state))
                state = tuple(s[:n] for s in state)
            outputs[t], state = step(steps[t], state, w)
        if finished:
            finished.append(state)
            state = tuple(torch.cat(parts[::-1]) for parts in zip(*finished))
    else:
        initial = state
        state = tuple(s[:sizes[-1]] for s in initial)
        for t in reversed(range(len(sizes))):
            have = state[0].shape[0]
            if sizes[t] > have:
                state = tuple(torch.cat((s, s0[have:sizes[t]])) for s, s0 in zip(state, initial))
            outputs[t], state = step(steps[t], state, w)
    return torch.cat(outputs), state


# -- whole stacks: torch.lstm & co. (RNN.cpp's _rnn_impl) -------------------------------------
_PADDED = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train",
           "bidirectional", "batch_first")
_PACKED = ("data", "batch_sizes", "hx", "params", "has_biases", "num_layers", "dropout", "train",
           "bidirectional")


def _arguments(mode, args, kwargs) -> dict:
    """Either overload's arguments by name. The packed one has a tensor ``batch_sizes`` second;
    the padded one has ``hx`` there, which for the GRU and Elman RNNs is a tensor too: then
    the third (``hx`` packed, ``params`` padded) tells them apart."""
    if "data" in kwargs or "batch_sizes" in kwargs:
        packed = True
    elif mode == "lstm":
        packed = len(args) > 1 and isinstance(args[1], T)
    else:
        packed = (len(args) > 2 and isinstance(args[2], T)) or (len(args) == 2 and "hx" in kwargs)
    names = _PACKED if packed else _PADDED
    if len(args) > len(names):
        raise TypeError(f"torch.{mode}() takes {len(names)} arguments, {len(args)} given")
    bound = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in names or name in bound:
            raise TypeError(f"torch.{mode}() got an unexpected or repeated argument '{name}'")
        bound[name] = value
    missing = [n for n in names if n not in bound]
    if missing:
        raise TypeError(f"torch.{mode}() missing arguments {missing}")
    if packed:
        bound["input"] = bound.pop("data")
        bound["batch_first"] = False
    else:
        bound["batch_sizes"] = None
    return bound


def _stack(mode, args, kwargs):
    a = _arguments(mode, args, kwargs)
    x, params, has_biases = a["input"], list(a["params"]), bool(a["has_biases"])
    num_layers, p, train = a["num_layers"], a["dropout"], a["train"]
    if mode == "lstm":
        if len(a["hx"]) != 2:
            raise RuntimeError("lstm expects two hidden states")
        hx = tuple(a["hx"])
        has_projections = hx[0].shape[2] != hx[1].shape[2]  # as torch decides
    else:
        hx = (a["hx"],)
        has_projections = False
    directions = 2 if a["bidirectional"] else 1
    per_layer = 2 + 2 * has_biases + has_projections
    if len(params) != per_layer * num_layers * directions:
        raise RuntimeError(
            f"torch.{mode}: got {len(params)} parameters, expected {per_layer} per layer and "
            f"direction for {num_layers} layer(s) and {directions} direction(s)"
            + (" (an LSTM with projections has w_hr too)" if has_projections else ""))
    sizes = None if a["batch_sizes"] is None else [int(n) for n in a["batch_sizes"].tolist()]
    if a["batch_first"]:
        x = x.transpose(0, 1)
    step = _STEPS[mode]
    finals = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            w = _Weights.of(params[k * per_layer:(k + 1) * per_layer], has_biases, has_projections)
            gi = _input_projection(mode, x, w)
            state = tuple(s[k] for s in hx)
            if sizes is None:
                out, state = _padded_layer(step, gi, state, w, direction == 1)
            else:
                out, state = _packed_layer(step, gi, sizes, state, w, direction == 1)
            outputs.append(out)
            finals.append(state)
        x = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if p != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, p, True)
    if a["batch_first"]:
        x = x.transpose(0, 1)
    return (x, *(torch.stack(parts) for parts in zip(*finals)))


@decomposition(torch.lstm, view=False)
def lstm(*args, **kwargs):
    """``(output, h_n, c_n)``: every step of every layer and direction recorded."""
    return _stack("lstm", args, kwargs)


@decomposition(torch.gru, view=False)
def gru(*args, **kwargs):
    """``(output, h_n)``: every step of every layer and direction recorded."""
    return _stack("gru", args, kwargs)


@decomposition(torch.rnn_tanh, view=False)
def rnn_tanh(*args, **kwargs):
    """``(output, h_n)``: every step of every layer and direction recorded."""
    return _stack("rnn_tanh", args, kwargs)


@decomposition(torch.rnn_relu, view=False)
def rnn_relu(*args, **kwargs):
    """``(output, h_n)``: every step of every layer and direction recorded."""
    return _stack("rnn_relu", args, kwargs)


# -- cells: one step ----------------------------------------------------------------------------
def _check_cell(input, hx, w_ih, w_hh):
    """torch's cell checks (check_rnn_cell_forward_input / _hidden), with its messages."""
    if input.size(1) != w_ih.size(1):
        raise RuntimeError(f"input has inconsistent input_size: got {input.size(1)} expected "
                           f"{w_ih.size(1)}")
    for label, h in enumerate(hx):
        if input.size(0) != h.size(0):
            raise RuntimeError(f"Input batch size {input.size(0)} doesn't match hidden{label} "
                               f"batch size {h.size(0)}")
        if h.size(1) != w_hh.size(1):
            raise RuntimeError(f"hidden{label} has inconsistent hidden_size: got {h.size(1)}, "
                               f"expected {w_hh.size(1)}")


def _cell(mode, input, hx, w_ih, w_hh, b_ih, b_hh):
    _check_cell(input, hx, w_ih, w_hh)
    w = _Weights(w_ih, w_hh, b_ih, b_hh)
    return _STEPS[mode](_input_projection(mode, input, w), hx, w)


@decomposition(torch.lstm_cell, view=False)
def lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """``(h, c)`` one step after ``hx = (h, c)``."""
    if len(hx) != 2:
        raise RuntimeError("lstm_cell expects two hidden states")
    return _cell("lstm", input, tuple(hx), w_ih, w_hh, b_ih, b_hh)[1]


@decomposition(torch.gru_cell, view=False)
def gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """The hidden state one step after ``hx``."""
    return _cell("gru", input, (hx,), w_ih, w_hh, b_ih, b_hh)[0]


@decomposition(torch.rnn_tanh_cell, view=False)
def rnn_tanh_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """The hidden state one step after ``hx``."""
    return _cell("rnn_tanh", input, (hx,), w_ih, w_hh, b_ih, b_hh)[0]


@decomposition(torch.rnn_relu_cell, view=False)
def rnn_relu_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """The hidden state one step after ``hx``."""
    return _cell("rnn_relu", input, (hx,), w_ih, w_hh, b_ih, b_hh)[0]


# -- packed sequences -----------------------------------------------------------------------------
@decomposition(_VF._pack_padded_sequence, view=False)
def pack_padded_sequence(input, lengths, batch_first):
    """``(data, batch_sizes)``: packing picks rows, so it is a recorded ``index_select``. Which
    rows, and every check, come from torch's own kernel run on the rows' numbers."""
    if input.numel() == 0:
        raise RuntimeError("Cannot pack empty tensors.")
    where = torch.arange(input.shape[0] * input.shape[1]).view(input.shape[0], input.shape[1])
    rows, batch_sizes = _VF._pack_padded_sequence(where, lengths, batch_first)
    data = input.flatten(0, 1).index_select(0, rows.to(input.device))
    return data, batch_sizes


@decomposition(_VF._pad_packed_sequence, view=False)
def pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length):
    """``(padded, lengths)``: each padded position reads a packed row, or (past a sequence's
    end) one extra row of ``padding_value``: a recorded ``index_select``. Where each row goes,
    the lengths and every check come from torch's own kernel run on the rows' numbers."""
    n = data.shape[0]
    where, lengths = _VF._pad_packed_sequence(torch.arange(n), batch_sizes, batch_first, -1,
                                                total_length)
    index = torch.where(where < 0, n, where).reshape(-1).to(data.device)
    rows = torch.cat((data, data.new_full((1, *data.shape[1:]), padding_value)))
    return rows.index_select(0, index).view(*where.shape, *data.shape[1:]), lengths


@decomposition(_nn.pad_sequence, view=False)
def pad_sequence(sequences, batch_first=False, padding_value=0.0, padding_side="right"):
    """Each sequence padded to the longest one along its first dimension (with
    ``padding_value``, on the right or the left), then stacked along the batch dimension."""
    if padding_side not in ("left", "right"):
        raise RuntimeError(f"Expected padding_side to be one of left or right, but got {padding_side}.")
    if len(sequences) == 0:
        raise RuntimeError("received an empty list of sequences")
    dtype = sequences[0].dtype
    longest = max(s.shape[0] for s in sequences)
    padded = []
    for s in sequences:
        s = s.to(dtype)
        if s.shape[0] < longest:
            pad = s.new_full((longest - s.shape[0], *s.shape[1:]), padding_value)
            s = torch.cat((pad, s) if padding_side == "left" else (s, pad))
        padded.append(s)
    return torch.stack(padded, 0 if batch_first else 1)
