"""gg.capture: the API, what a replay reproduces, guards, refusals and check=N.

Every replay is compared with the eager graphgrad step on an identical copy of the state
(``torch.equal``, float64): results, ``.grad`` (set, accumulated or None), buffers, random
numbers. Whole models over 100 steps are in test_capture_models.py.
"""

import copy
import shutil
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg
from graphgrad.capture import CaptureError, CaptureMismatch
from graphgrad.capture import runner as capture_runner

DT = torch.float64
# the replay loop: graphgrad's C++ one where the C++ module is built (not on the pure-Python
# engine, GRAPHGRAD_PURE_PYTHON=1), else the Python loop
RUNNER = "native" if gg.native_meta else "python loop"


def leaf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return gg.as_tensor(torch.randn(*shape, dtype=DT, generator=g), requires_grad=True)


def twin(*tensors):
    """Independent copies (same values, same requires_grad) for the eager side."""
    out = []
    for t in tensors:
        c = gg.as_tensor(t.detach().clone(), requires_grad=t.requires_grad)
        if t.grad is not None:
            c.grad = t.grad.clone()
        out.append(c)
    return out


def grads_equal(a, b):
    for x, y in zip(a, b):
        if x.grad is None or y.grad is None:
            assert x.grad is None and y.grad is None
        else:
            assert torch.equal(x.grad, y.grad)


def side_by_side(make_step, tensors, calls=5, args=lambda i: ()):
    """Run make_step(*copy) eagerly and captured for `calls` calls; compare everything."""
    mine = list(tensors)
    theirs = twin(*tensors)
    eager, captured = make_step(*theirs), gg.capture(make_step(*mine))
    for i in range(calls):
        torch.manual_seed(i)
        r1 = eager(*args(i))
        torch.manual_seed(i)
        r2 = captured(*args(i))
        for a, b in zip(torch.utils._pytree.tree_leaves(r1), torch.utils._pytree.tree_leaves(r2)):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.detach(), b), f"call {i}: result differs"
            else:
                assert a == b
        for x, y in zip(theirs, mine):
            assert torch.equal(x.detach(), y.detach()), f"call {i}: state differs"
        grads_equal(theirs, mine)
    return captured


# -- the API ------------------------------------------------------------------------------
def test_decorator_forms_warmup_record_replay():
    w = leaf(3, 3)

    @gg.capture
    def step(x):
        w.grad = None
        loss = (x @ w).tanh().sum()
        loss.backward()
        return loss

    @gg.capture(warmup=2)
    def step2(x):
        return (x * 2).sum()

    x = torch.randn(4, 3, dtype=DT)
    for _ in range(4):
        out = step(x)
        step2(x)
    assert (step.eager_calls, step.records, step.replays) == (2, 1, 2)
    assert (step2.eager_calls, step2.records, step2.replays) == (3, 1, 1)
    assert type(out) is gg.Tensor and not out.requires_grad and out.grad_fn is None
    assert step.__name__ == "step" and step.plan is step.plans[0]
    s = step.plan.summary()
    assert s.kernels > 0 and s.recorded_ops >= s.kernels and s.segments[0]["runner"] == RUNNER
    assert s.memory.peak_bytes > 0 and "peak intermediate memory" in str(s)
    assert s.as_dict()["effects"] == 1


def test_results_keep_their_structure():
    def make(w):
        def step(x):
            w.grad = None
            y = x * w
            loss = y.pow(2).sum()
            loss.backward()
            return {"loss": loss, "parts": (y.detach(), 3)}
        return step
    w = leaf(3)
    captured = side_by_side(make, [w], args=lambda i: (torch.full((3,), float(i), dtype=DT),))
    out = captured(torch.ones(3, dtype=DT))
    assert set(out) == {"loss", "parts"} and out["parts"][1] == 3
    assert type(out["loss"]) is gg.Tensor and type(out["parts"][0]) is gg.Tensor


def test_results_are_fresh_tensors():
    w = leaf(2)

    def step():
        w.grad = None
        loss = (w * w).sum()
        loss.backward()
        with gg.no_grad():
            w.sub_(0.1 * w.grad)
        return loss
    captured = gg.capture(step)
    outs = [captured() for _ in range(4)]
    assert len({id(o) for o in outs}) == 4 and not torch.equal(outs[2], outs[3])


# -- what a replay reproduces -------------------------------------------------------------
def test_zero_grad_set_to_none_inside_the_step():
    w, b = leaf(4, 4), leaf(4, seed=1)

    def make(w, b):
        opt = torch.optim.SGD([w, b], lr=0.1)

        def step(x):
            opt.zero_grad(set_to_none=True)
            loss = F.softplus(x @ w + b).sum()
            loss.backward()
            opt.step()
            return loss
        return step
    side_by_side(make, [w, b], calls=6, args=lambda i: (torch.randn(3, 4, dtype=DT),))


def test_accumulation_across_calls_and_leaf_left_alone():
    """No zero_grad: each call adds to .grad (in place, as eagerly); a leaf the step never
    reaches keeps its .grad."""
    w, unused = leaf(3, 3), leaf(2, seed=1)
    unused.grad = torch.ones(2, dtype=DT)

    def make(w, unused):
        def step(x):
            (x @ w).sin().sum().backward()
        return step
    captured = side_by_side(make, [w, unused], calls=6, args=lambda i: (torch.randn(2, 3, dtype=DT),))
    assert captured.records == 1
    held = w.grad
    captured(torch.randn(2, 3, dtype=DT))
    assert w.grad is held  # accumulated in place
    w.grad = None  # a different starting point: the guard sees it, the step records anew
    captured(torch.randn(2, 3, dtype=DT))
    assert captured.records == 2 and "grad" in captured.misses[-1]


def test_rng_new_each_step_and_equal_to_eager():
    def make(w):
        def step(x):
            w.grad = None
            y = F.dropout(x @ w, 0.5, training=True)
            z = y + 0.1 * torch.randn_like(y)
            z.sum().backward()
            return z.detach()
        return step
    mine = leaf(8, 8)
    (theirs,) = twin(mine)
    runs = []
    for step in (make(theirs), gg.capture(make(mine))):
        torch.manual_seed(0)
        x = torch.randn(4, 8, dtype=DT)
        runs.append([step(x) for _ in range(5)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)  # the same random numbers as eager, for the same seed
    assert not torch.equal(runs[1][3], runs[1][4])  # and new ones on every replay
    assert torch.equal(theirs.grad, mine.grad)


@pytest.mark.parametrize("check", [0, 3])
def test_batchnorm_running_stats_and_inplace_views(check):
    """With check=3 too: native_batch_norm writes its running statistics with no (a!) in its
    schema; check=N must put them back before its eager run, else they are updated twice."""
    def make(w, bn):
        def step(x):
            w.grad = None
            h = bn(x @ w)
            h2 = h.clone()
            h2[:, 0].mul_(2)  # in place through views
            h2.view(-1)[:3].add_(1.0)
            loss = h2.pow(2).sum()
            loss.backward()
            x.add_(0.5)  # the argument itself, in place
            return loss
        return step
    bn_mine = gg.nn.adopt(nn.BatchNorm1d(4).to(DT))
    bn_theirs = copy.deepcopy(bn_mine)
    mine = leaf(4, 4)
    (theirs,) = twin(mine)
    eager, captured = make(theirs, bn_theirs), gg.capture(make(mine, bn_mine), check=check)
    for i in range(5):
        x1 = torch.randn(6, 4, dtype=DT, generator=torch.Generator().manual_seed(i))
        x2 = x1.clone()
        assert torch.equal(eager(x1).detach(), captured(x2))
        assert torch.equal(x1, x2)
        for b1, b2 in zip(bn_theirs.buffers(), bn_mine.buffers()):
            assert torch.equal(b1, b2)
        assert torch.equal(theirs.grad, mine.grad)
    assert int(bn_mine.num_batches_tracked) == 5 and captured.replays == 3


def test_gradient_penalty_create_graph_and_retain_graph():
    w = leaf(5, 5)

    def make(w):
        opt = torch.optim.SGD([w], lr=0.05)

        def step(x):
            opt.zero_grad()
            loss = (x @ w).tanh().pow(2).mean()
            (g,) = gg.grad(loss, [w], create_graph=True)
            total = loss + 0.1 * g.pow(2).sum()
            total.backward(retain_graph=True)
            (0.5 * loss).backward()  # the retained graph, a second time
            opt.step()
            return total
        return step
    side_by_side(make, [w], calls=6, args=lambda i: (torch.randn(3, 5, dtype=DT),))


def test_constants_from_python_data():
    w = leaf(3)

    def make(w):
        def step():
            w.grad = None
            scale = torch.tensor([1.0, 2.0, 3.0], dtype=DT)  # a constant of the plan
            acc = torch.tensor([0.0], dtype=DT)
            acc += (w * scale).sum()  # written into: copied afresh for each replay
            acc.sum().backward()
            return acc
        return step
    captured = side_by_side(make, [w], calls=5)
    assert captured.plan.summary().constants == 2


def test_leaf_argument_gets_its_grad():
    w = leaf(3)

    def step(x):
        w.grad = None
        (x * w).sum().backward()
    captured = gg.capture(step)
    for i in range(4):
        x = gg.as_tensor(torch.full((3,), float(i), dtype=DT), requires_grad=True)
        captured(x)
        assert torch.equal(x.grad, w.detach()) and torch.equal(w.grad, x.detach())


def test_a_generator_argument_replays_in_the_native_loop():
    w = leaf(4)

    def make(w):
        gen = torch.Generator().manual_seed(5)

        def step():
            w.grad = None
            noise = torch.randn(4, dtype=DT, generator=gen)
            loss = (w * noise).sum()
            loss.backward()
            return loss
        return step
    captured = side_by_side(make, [w], calls=4)  # (the replay loop takes the generator itself)
    assert captured.plan.summary().segments[0]["runner"] == RUNNER


def test_the_python_loop_where_the_cpp_module_is_absent(monkeypatch):
    """Without the C++ module every segment runs in the Python loop, with one warning each,
    and replays still equal the eager step."""
    monkeypatch.setattr(capture_runner, "native_meta", None)
    w = leaf(4)

    def make(w):
        def step():
            w.grad = None
            loss = (w * w).tanh().sum()
            loss.backward()
            return loss
        return step
    with pytest.warns(UserWarning, match="Python loop .*not built"):
        captured = side_by_side(make, [w], calls=4)
    assert captured.plan.summary().segments[0]["runner"] == "python loop"


# -- guards ---------------------------------------------------------------------------------
def mlp_step(model=None):
    model = model or gg.nn.adopt(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2),
                                               nn.Linear(8, 2)).to(DT))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss
    return model, step


def test_guard_misses_record_again_and_plans_are_reused():
    model, step = mlp_step()
    captured = gg.capture(step)
    a, b = torch.randn(5, 4, dtype=DT), torch.randn(7, 4, dtype=DT)
    for x in (a, a, b, b, a, b):
        captured(x)
    assert captured.records == 2 and len(captured.plans) == 2 and captured.replays == 3
    assert "shape (7, 4)" in captured.misses[0] and len(captured.misses) == 1
    captured(a.float().double().t().contiguous().t())  # same values, other strides
    assert captured.records == 3 and "strides" in captured.misses[-1]
    model.eval()  # another mode: another plan
    captured(a)
    assert captured.records == 4 and "training" in captured.misses[-1]
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            captured(a)  # eager semantics: backward under no_grad fails as it would eagerly


def test_a_changed_dtype_records_again():
    w = leaf(4)

    def step(x):
        w.grad = None
        loss = (w * x).sum()
        loss.backward()
        return loss
    captured = gg.capture(step)
    x64 = torch.randn(4, dtype=DT)
    for x in (x64, x64, x64.float(), x64.float(), x64, x64.float()):
        want = (w.detach() * x).sum()
        assert torch.equal(captured(x), want) and torch.equal(w.grad, x.to(DT))
    assert captured.records == 2 and captured.replays == 3
    assert "float32" in captured.misses[0]


def test_full_cache_runs_eagerly_with_one_warning():
    _, step = mlp_step()
    captured = gg.capture(step, cache_size=2)
    captured(torch.randn(2, 4, dtype=DT))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(3, 9):
            captured(torch.randn(n, 4, dtype=DT))
    msgs = [str(w.message) for w in caught if "cache holds 2 plans" in str(w.message)]
    assert len(msgs) == 1 and captured.records == 2 and captured.eager_calls == 7


def test_replaced_parameter_and_optimizer_state_are_guarded():
    model, step = mlp_step()
    captured = gg.capture(step)
    x = torch.randn(3, 4, dtype=DT)
    for _ in range(3):
        captured(x)
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    gg.nn.adopt(model)
    captured(x)
    assert captured.records == 2 and "weight" in captured.misses[-1]


def test_pre_existing_grad_read_by_a_captured_optimizer_is_guarded():
    """The step only applies gradients made outside it: the plan holds that .grad by
    reference, so a new .grad object must not be ignored."""
    w = leaf(3)
    opt = torch.optim.SGD([w], lr=0.5)
    captured = gg.capture(opt.step)
    w.grad = torch.ones(3, dtype=DT)
    before = w.detach().clone()
    for _ in range(3):
        captured()
    assert torch.equal(w.detach(), before - 1.5)
    w.grad = torch.full((3,), 2.0, dtype=DT)  # another tensor: the plan would read the old one
    captured()
    assert torch.equal(w.detach(), before - 2.5) and captured.records == 2
    assert "grad" in captured.misses[-1]


def test_non_tensor_arguments_and_objects():
    w = leaf(3)

    def step(x, scale, mode):
        w.grad = None
        loss = (x * w * scale).sum() if mode == "sum" else (x * w * scale).mean()
        loss.backward()
        return loss
    captured = gg.capture(step)
    x = torch.randn(3, dtype=DT)
    captured(x, 2.0, "sum")
    captured(x, 2.0, "sum")
    r = captured(x, 3.0, "sum")
    assert torch.equal(r, (x * w * 3.0).sum().detach()) and captured.records == 2
    r = captured(x, 3.0, "mean")
    assert torch.equal(r, (x * w * 3.0).mean().detach()) and captured.records == 3
    captured(x, 3, "mean")  # an int is not a float
    assert captured.records == 4 and "argument 1" in captured.misses[-1]


def test_keyword_arguments_and_returned_externals():
    w = leaf(3)

    def step(x, *, scale=1.0):
        w.grad = None
        (x * w * scale).sum().backward()
        return w, w.grad
    captured = gg.capture(step)
    x = torch.ones(3, dtype=DT)
    for scale in (1.0, 1.0, 1.0, 2.0, 2.0):
        out, g = captured(x, scale=scale)
        assert out is w and torch.equal(g, torch.full((3,), scale, dtype=DT)) and g is w.grad
    assert captured.records == 2 and captured.replays == 2


def test_same_tensor_twice_is_guarded():
    w = leaf(3)

    def step(a, b):
        w.grad = None
        a.mul_(2)
        loss = (b * w).sum()
        loss.backward()
        return loss
    captured = gg.capture(step)
    x = torch.ones(3, dtype=DT)
    captured(x, x)
    captured(x, x)
    y, z = torch.ones(3, dtype=DT), torch.ones(3, dtype=DT)
    r = captured(y, z)
    assert torch.equal(r, w.detach().sum()) and captured.records == 2


# -- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize("read, what", [
    (lambda t: t.sum().item(), "item"),
    (lambda t: t.tolist(), "tolist"),
    (lambda t: print(t), "printing"),
    (lambda t: bool(t.sum() > 0), "bool"),
    (lambda t: float(t.sum()), "float"),
    (lambda t: t.detach().numpy(), "numpy"),
    (lambda t: t[t > 0], "shape of its result depends on the values"),
    (lambda t: t.nonzero(), "shape of its result depends on the values"),
])
def test_reading_values_into_python_is_refused(read, what, capsys):
    w = leaf(3)

    def step():
        w.grad = None
        y = w * 2
        read(y)
        y.sum().backward()
    captured = gg.capture(step)
    captured()
    with pytest.raises(CaptureError, match=what) as info:
        captured()
    assert "captured function" in str(info.value) and "test_capture.py" in str(info.value)


def test_python_state_changes_inside_the_step_are_refused():
    model, _ = mlp_step()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    x = torch.randn(2, 4, dtype=DT)

    def with_scheduler():
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        sched.step()

    def with_seed():
        torch.manual_seed(3)
        model(x).sum().backward()

    def with_eval():
        model(x).sum().backward()
        model.eval()
    for fn, what in ((with_scheduler, "scheduler"), (with_seed, "manual_seed"), (with_eval, "train")):
        model.train()
        captured = gg.capture(fn, warmup=0)
        with pytest.raises(CaptureError, match=what):
            captured()


def test_graph_left_in_grad_is_refused():
    w = leaf(3)

    def step():
        w.grad = None
        (w * w).sum().backward(create_graph=True)
    with pytest.raises(CaptureError, match="create_graph"):
        gg.capture(step, warmup=0)()


def test_escaping_tensors_record_again_then_refuse():
    w = leaf(3)
    kept = {}

    def step():
        w.grad = None
        y = w * 3
        kept["y"] = y
        y.sum().backward()
    captured = gg.capture(step, warmup=0)
    captured()  # first record: held by Python state -> treated as eager, record again
    with pytest.raises(CaptureError, match="still held after it.*'y'"):
        captured()


def test_optimizer_state_made_in_the_recorded_call_needs_warmup():
    """warmup=0: the momentum buffers are created by the recorded call; it is not kept and
    the next call records again, by then the buffers exist."""
    model, step = mlp_step()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_model = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin_model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(3, 4, dtype=DT)

    def make(m, o):
        def s():
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        return s
    eager, captured = make(twin_model, twin_opt), gg.capture(make(model, opt), warmup=0)
    for i in range(5):
        torch.manual_seed(i)
        eager()
        torch.manual_seed(i)
        captured()
    assert captured.records == 2
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)


# -- check=N ------------------------------------------------------------------------------------
def test_check_passes_for_a_faithful_step():
    model, step = mlp_step()
    captured = gg.capture(step, check=3)
    for _ in range(5):
        captured(torch.randn(4, 4, dtype=DT))
    assert captured.check_left == 0 and captured.replays == 3


def test_check_catches_python_state_the_guards_cannot_see():
    w = leaf(3)
    calls = [0]

    def step(x):
        calls[0] += 1
        w.grad = None
        loss = (x * w).sum() * calls[0]  # a Python number that changes every call
        loss.backward()
        return loss
    captured = gg.capture(step, check=2)
    x = torch.randn(3, dtype=DT)
    captured(x)
    captured(x)
    with pytest.raises(CaptureMismatch, match="result 0"):
        captured(x)


# -- pictures of plans --------------------------------------------------------------------
def _sgd_step():
    torch.manual_seed(0)
    model = gg.nn.adopt(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    captured = gg.capture(step)
    for i in range(3):
        captured(torch.randn(4, 6, dtype=DT, generator=torch.Generator().manual_seed(i)),
                 torch.tensor([0, 1, 2, 1]))
    assert captured.replays == 1
    return captured, model


def test_draw_plan_shows_every_kernel_segment_and_named_tensor(tmp_path):
    captured, model = _sgd_step()
    plan = captured.plan
    params = dict(model.named_parameters())
    path = gg.viz.draw(plan, tmp_path / "plan.dot", params=params)
    text = (tmp_path / "plan.dot").read_text()
    assert path.endswith("plan.dot") and text == plan.to_dot(params=params)
    s = plan.summary()
    kernels = [line for line in text.splitlines() if line.lstrip().startswith("k") and "[label" in line]
    assert len(kernels) == s.kernels  # one box per kernel
    assert text.count("subgraph cluster_") == len(s.segments)
    assert "optimizer SGD (captured)" in text
    for name in params:  # parameters by the user's names, momentum buffers under them
        assert f"<B>{name}</B>" in text and f"<B>{name}: SGD momentum_buffer</B>" in text
        assert f"<B>{name}.grad</B>" in text  # the .grad each replay assigns
    assert "<B>argument 0</B>" in text and "<B>result 0</B>" in text
    assert "addmm" in text and f"{s.kernels} kernels in {len(s.segments)} segments" in text
    # every edge joins two nodes the picture declares
    declared = {line.split()[0] for line in text.splitlines() if "[label" in line}
    edges = [line.split() for line in text.splitlines() if " -> " in line]
    assert edges and all(e[0] in declared and e[2].rstrip(";") in declared for e in edges)


def test_draw_plan_links_inplace_updates_in_order():
    """An optimizer's in-place chain on a parameter: the update reads the parameter itself, and
    whatever reads it later hangs off the update, not the parameter."""
    captured, model = _sgd_step()
    text = captured.plan.to_dot(params=dict(model.named_parameters()))
    lines = text.splitlines()
    label = {ln.split()[0]: ln for ln in lines if "[label" in ln}
    weight = next(k for k, ln in label.items() if "<B>0.weight</B>" in ln)
    readers = [ln.split()[2].rstrip(";") for ln in lines if ln.strip().startswith(f"{weight} -> ")]
    # the forward pass reads the weight (t/addmm), and so does SGD's final add_ into it
    assert any("add_" in label[r] or "<B>add</B>" in label[r] for r in readers if "fdf2d0" in label[r])


def test_draw_plan_svg(tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed (scripts/setup_env.sh installs it)")
    captured, _ = _sgd_step()
    path = gg.viz.draw(captured.plan, tmp_path / "plan.svg")
    assert "<svg" in (tmp_path / "plan.svg").read_text() and path.endswith(".svg")


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_grads_set_for_an_eager_optimizer_and_cleared_after_it(optimizer):
    """Silently wrong replay: Adam's step runs eagerly inside a replay, so the replay sets each
    .grad before it; the step then cleared them (zero_grad: None), which is what the call found,
    so the end effect was skipped and the replay left the .grad tensors set: the next call
    accumulated into them (found by gg.capture(memory_budget=...)'s tests)."""
    def make_step(w1, w2):
        opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)([w1, w2], lr=1e-2)

        def step():
            loss = (torch.tanh(w1 @ torch.ones(4, 3, dtype=DT)) @ w2).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()  # set_to_none: .grad back to None
            return loss
        return step

    step = side_by_side(make_step, [leaf(2, 4), leaf(3, 1, seed=1)], calls=6)
    assert step.replays == 4
