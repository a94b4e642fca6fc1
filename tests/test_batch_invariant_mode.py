"""rl_kernels.batch_invariant(): torch's ops on rl_kernels while on, torch's exact kernels after.

Each overridden op inside the mode gives rl_kernels' result bit for bit, a row's result does not
depend on the batch around it, leaving the mode restores the dispatcher's previous kernels (and
results) exactly, nesting works, and calls the kernels do not take go to torch unchanged."""

import pytest
import torch
import torch.nn.functional as F

import rl_kernels
from rl_kernels.batch_invariant import covered_ops, covers
from conftest import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
DTYPE_IDS = ["fp32", "bf16", "fp16", "fp64"]


@pytest.fixture(autouse=True)
def _mode_off_after():
    yield
    rl_kernels.disable_batch_invariant()


def test_state_nesting_and_decorator():
    assert not rl_kernels.is_batch_invariant()
    with rl_kernels.batch_invariant():
        assert rl_kernels.is_batch_invariant()
        with rl_kernels.batch_invariant():
            assert rl_kernels.is_batch_invariant()
        assert rl_kernels.is_batch_invariant()  # the inner block restored "on"
        with rl_kernels.batch_invariant(False):
            assert not rl_kernels.is_batch_invariant()
            with rl_kernels.batch_invariant():
                assert rl_kernels.is_batch_invariant()
            assert not rl_kernels.is_batch_invariant()
        assert rl_kernels.is_batch_invariant()
    assert not rl_kernels.is_batch_invariant()
    rl_kernels.enable_batch_invariant()
    rl_kernels.enable_batch_invariant()  # idempotent
    assert rl_kernels.is_batch_invariant()
    rl_kernels.disable_batch_invariant()
    rl_kernels.disable_batch_invariant()
    assert not rl_kernels.is_batch_invariant()

    @rl_kernels.batch_invariant()
    def decorated():
        return rl_kernels.is_batch_invariant()

    assert decorated() and not rl_kernels.is_batch_invariant()
    with pytest.raises(ValueError), rl_kernels.batch_invariant():
        raise ValueError("an exception leaves the mode too")
    assert not rl_kernels.is_batch_invariant()
    with pytest.raises(TypeError):
        rl_kernels.batch_invariant("yes")


def _torch_results():
    a, b = randn(37, 64, seed=1), randn(64, 48, seed=2)
    bias = randn(48, seed=3)
    x3 = randn(3, 37, 64, seed=4)
    q, k = randn(2, 4, 30, 64, seed=5), randn(2, 2, 30, 64, seed=6)
    h = randn(5, 7, 96, dtype=torch.bfloat16, seed=7)
    return {
        "mm": a @ b, "addmm": torch.addmm(bias, a, b, beta=0.5, alpha=2.0),
        "bmm": torch.bmm(x3, b.expand(3, 64, 48)), "linear": F.linear(x3, b.t(), bias),
        "baddbmm": torch.baddbmm(randn(3, 37, 48, seed=8), x3, b.expand(3, 64, 48)),
        "softmax": torch.softmax(h, -1), "log_softmax": torch.log_softmax(h.float(), 1),
        "sum": h.sum(-1), "mean": h.float().mean((0, 2)), "rms_norm": F.rms_norm(h, (96,)),
        "sdpa": F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True),
    }


def test_leaving_the_mode_restores_torch_exactly():
    names = covered_ops()
    tables = {name: torch._C._dispatch_dump(name) for name in names}
    before = _torch_results()
    with rl_kernels.batch_invariant():
        during = _torch_results()
        assert any(torch._C._dispatch_dump(name) != tables[name] for name in names)
    after = _torch_results()
    for name in names:  # the dispatcher's tables are exactly what they were
        assert torch._C._dispatch_dump(name) == tables[name], name
    for key in before:
        assert torch.equal(after[key], before[key]), key
        assert torch.allclose(during[key].float(), before[key].float(), rtol=2e-2, atol=2e-2), key


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemm_ops_are_rl_kernels(dtype):
    a, w, bias = randn(37, 200, dtype=dtype, seed=1), randn(72, 200, dtype=dtype, seed=2), \
        randn(72, dtype=dtype, seed=3)
    x3 = randn(4, 33, 200, dtype=dtype, seed=4)
    b3 = randn(4, 200, 40, dtype=dtype, seed=5)
    c3 = randn(4, 33, 40, dtype=dtype, seed=6)
    v = randn(200, dtype=dtype, seed=7)
    with rl_kernels.batch_invariant():
        mm, linear, linear3 = a @ w.t(), F.linear(a, w, bias), F.linear(x3, w)
        addmm = torch.addmm(bias, a, w.t(), beta=0.5, alpha=2.0)
        addmm_col = torch.addmm(bias[:37, None], a, w.t())  # a column bias: materialized
        bmm, matmul4 = torch.bmm(x3, b3), torch.matmul(x3[None], b3[None])
        baddbmm = torch.baddbmm(c3, x3, b3, beta=0.25, alpha=1.5)
        mv = torch.mv(a, v)
        grad_bias_free = torch.addmm(torch.full((1, 72), float("nan"), dtype=dtype), a, w.t(), beta=0)
    assert torch.equal(mm, rl_kernels.matmul(a, w.t()))
    assert torch.equal(linear, rl_kernels.addmm(bias, a, w.t()))
    assert torch.equal(linear3, rl_kernels.matmul(x3, w.t()))
    assert torch.equal(addmm, rl_kernels.addmm(bias, a, w.t(), beta=0.5, alpha=2.0))
    assert torch.equal(addmm_col, rl_kernels.addmm(bias[:37, None].expand(37, 72).contiguous(), a, w.t()))
    assert torch.equal(bmm, rl_kernels.matmul(x3, b3)) and torch.equal(matmul4[0], bmm)
    for i in range(4):  # rl_kernels.gemm is 2-D: one batch entry at a time
        assert torch.equal(baddbmm[i], rl_kernels.gemm(1.5, x3[i], b3[i], 0.25, c3[i]))
    assert torch.equal(mv, rl_kernels.matmul(a, v))
    assert torch.equal(grad_bias_free, rl_kernels.matmul(a, w.t()))  # beta = 0 ignores NaN


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_ops_are_rl_kernels(dtype):
    x = randn(6, 9, 300, dtype=dtype, seed=1, scale=3)
    w = randn(300, dtype=dtype, seed=2)
    half = dtype in (torch.bfloat16, torch.float16)
    with rl_kernels.batch_invariant():
        got = {
            "softmax": torch.softmax(x, -1), "log_softmax": F.log_softmax(x, dim=-1),
            "softmax_dim1": torch.softmax(x, 1), "sum": x.sum(-1), "mean": x.mean(-1, keepdim=True),
            "sum_dims": x.sum((0, 1)), "mean_dim0": x.mean(0), "rms_norm": F.rms_norm(x, (300,), w, 1e-5),
            "rms_norm_default_eps": F.rms_norm(x, (300,)),
        }
        if half:
            got["softmax_fp32"] = torch.softmax(x, -1, dtype=torch.float32)  # half_to_float on CUDA
            got["sum_fp32"] = x.sum(-1, dtype=torch.float32)
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    want = {
        "softmax": rl_kernels.softmax(x), "log_softmax": rl_kernels.log_softmax(x),
        "softmax_dim1": rl_kernels.softmax(x, 1), "sum": rl_kernels.row_sum(x),
        "mean": rl_kernels.row_mean(x, keepdim=True),
        "sum_dims": rl_kernels.row_sum(x.permute(2, 0, 1).reshape(300, -1)),
        "mean_dim0": rl_kernels.row_mean(x.permute(1, 2, 0).reshape(9, 300, 6)),
        "rms_norm": rl_kernels.rms_norm(x, w, 1e-5), "rms_norm_default_eps": rl_kernels.rms_norm(x, None, eps),
    }
    if half:
        want["softmax_fp32"] = rl_kernels.softmax(x.float())
        want["sum_fp32"] = rl_kernels.row_sum(x, dtype=torch.float32)
    for key, value in want.items():  # (softmax(dtype=fp32) on the CPU converts x, then _softmax)
        assert got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key
    assert got["softmax_dim1"].is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_are_batch_invariant(dtype):
    x = randn(300, 256, dtype=dtype, seed=1)
    w = randn(200, 256, dtype=dtype, seed=2)
    q, k = randn(3, 8, 70, 64, dtype=dtype, seed=3), randn(3, 2, 70, 64, dtype=dtype, seed=4)
    seq = randn(5, 40, 96, dtype=dtype, seed=5)
    with rl_kernels.batch_invariant():
        def ops(rows):
            return {"linear": F.linear(rows, w), "softmax": torch.softmax(rows, -1),
                    "mean": rows.float().pow(2).mean(-1, keepdim=True), "sum": rows.sum(-1),
                    "rms_norm": F.rms_norm(rows, (256,))}
        full = ops(x)
        for m in (1, 3, 17, 64, 129):
            part = ops(x[:m])
            for key in full:
                assert torch.equal(part[key], full[key][:m]), (key, m)
        # attention: a sequence alone, in a batch, and its decode rows against the prefill
        out = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        alone = F.scaled_dot_product_attention(q[1:2], k[1:2], k[1:2], is_causal=True, enable_gqa=True)
        assert torch.equal(alone, out[1:2])
        prefix = F.scaled_dot_product_attention(q[:, :, :41], k[:, :, :41], k[:, :, :41],
                                                is_causal=True, enable_gqa=True)
        assert torch.equal(prefix, out[:, :, :41])
        for p in (0, 40, 63, 69):  # one query against its prefix: a KV-cache decode step
            step = F.scaled_dot_product_attention(q[:, :, p:p + 1], k[:, :, :p + 1], k[:, :, :p + 1],
                                                  enable_gqa=True)
            assert torch.equal(step, out[:, :, p:p + 1]), p
        # a reduction over the sequence dim, per sequence: independent of the other sequences
        per_seq = seq.sum(1)
        assert torch.equal(seq[2:3].sum(1), per_seq[2:3])


def test_backward_ops():
    x = randn(13, 77, seed=1, scale=2)
    w = randn(50, 77, seed=2)
    g = randn(13, 77, seed=3)
    with rl_kernels.batch_invariant():
        for fn, ref in ((torch.softmax, rl_kernels.softmax), (torch.log_softmax, rl_kernels.log_softmax)):
            xa = x.clone().requires_grad_()
            fn(xa, -1).backward(g)
            xb = x.clone().requires_grad_()
            ref(xb).backward(g)
            assert torch.equal(xa.grad, xb.grad)
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = F.linear(xa, wa)
        gy = randn(*y.shape, seed=4)
        y.backward(gy)
    assert torch.equal(xa.grad, rl_kernels.matmul(gy, w))
    assert torch.equal(wa.grad, rl_kernels.matmul(gy.t(), x))
    # rms_norm through the CompositeImplicitAutograd override: rl_kernels' own backward
    xr, wr = x.clone().requires_grad_(), torch.ones(77).requires_grad_()
    with rl_kernels.batch_invariant():
        F.rms_norm(xr, (77,), wr, 1e-6).backward(g)
    xs, ws = x.clone().requires_grad_(), torch.ones(77).requires_grad_()
    rl_kernels.rms_norm(xs, ws, 1e-6).backward(g)
    assert torch.equal(xr.grad, xs.grad) and torch.equal(wr.grad, ws.grad)


def test_calls_the_kernels_do_not_take_pass_through():
    a, b = torch.randint(-5, 5, (9, 7)), torch.randint(-5, 5, (7, 4))
    af, bf = randn(9, 7, seed=1), randn(7, 4, seed=2)
    mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    q = randn(2, 2, 6, 64, seed=3)
    cases = {
        "int mm": lambda: a @ b, "bool sum": lambda: (a > 0).sum(-1), "int mean-free sum": lambda: a.sum(0),
        "complex mm": lambda: af.to(torch.complex64) @ bf.to(torch.complex64),
        "full sum": lambda: af.sum(), "all-dims mean": lambda: af.mean((0, 1)),
        "empty mm": lambda: af[:0] @ bf, "sdpa with a mask": lambda: F.scaled_dot_product_attention(q, q, q, mask),
        "sdpa causal, fewer queries": lambda: F.scaled_dot_product_attention(q[:, :, :2], q, q, is_causal=True),
        "softmax of a scalar": lambda: torch.softmax(af[0, 0], 0),
    }
    outside = {key: fn() for key, fn in cases.items()}
    with rl_kernels.batch_invariant():
        inside = {key: fn() for key, fn in cases.items()}
        assert not covers(torch.ops.aten.mm.default, (a, b))
        assert covers(torch.ops.aten.mm.default, (af, bf))
        assert not covers(torch.ops.aten.sum.dim_IntList, (af, None))
    for key in cases:
        assert torch.equal(inside[key], outside[key]), key
    assert not covers(torch.ops.aten.mm.default, (af, bf))  # off: nothing is covered
    with pytest.raises(RuntimeError), rl_kernels.batch_invariant():
        torch.mm(af, af)  # torch's own error for bad shapes


def test_torch_compile_runs_under_the_mode_but_is_not_covered():
    """Documented as unsupported: a compiled graph runs Inductor's code (its own reductions and GEMM
    calls), not the mode's kernels, and keeps what it traced. It runs and gives close results."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 32))
    x = randn(17, 64, seed=1)
    compiled = torch.compile(model, dynamic=False)
    with torch.no_grad(), rl_kernels.batch_invariant():
        eager = model(x)
        out = compiled(x)
    assert torch.allclose(out, eager, rtol=1e-5, atol=1e-5)


def test_blocks_in_two_threads_keep_the_mode_on_until_the_last_closes():
    """Process-wide mode, blocks in two threads interleaved: A enters, B enters, A leaves (B is still
    inside: on), B leaves (off). A block asking for the opposite state meanwhile raises."""
    import threading
    steps = [threading.Event() for _ in range(4)]
    seen, errors = [], []

    def thread_b():
        steps[0].wait()
        with rl_kernels.batch_invariant():
            steps[1].set()
            steps[2].wait()
            seen.append(("B after A left", rl_kernels.is_batch_invariant()))
        seen.append(("B left", rl_kernels.is_batch_invariant()))
        steps[3].set()

    b = threading.Thread(target=thread_b)
    b.start()
    with rl_kernels.batch_invariant():
        steps[0].set()
        steps[1].wait()
    try:
        with rl_kernels.batch_invariant(False):
            pass
    except RuntimeError as e:
        errors.append(str(e))
    steps[2].set()
    steps[3].wait()
    b.join()
    assert seen == [("B after A left", True), ("B left", False)]
    assert len(errors) == 1 and "another thread" in errors[0]
    assert not rl_kernels.is_batch_invariant()


def test_exit_without_enter_raises():
    with pytest.raises(RuntimeError, match="without a matching __enter__"):
        rl_kernels.batch_invariant().__exit__(None, None, None)
