"""rl_kernels.strict(): raises (or, warn, records) on every op not known to be batch-invariant,
naming the op, the reason and the caller's line; lets through what is."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import rl_kernels
from rl_kernels.strict import BatchInvarianceError, BatchInvarianceWarning, Violation
from conftest import randn


@pytest.fixture(autouse=True)
def _mode_off_after():
    yield
    rl_kernels.disable_batch_invariant()


def _line_of(marker):
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return number
    raise AssertionError(marker)


def test_raises_naming_op_reason_and_call_site():
    a, b = randn(8, 16, seed=1), randn(16, 4, seed=2)
    with pytest.raises(BatchInvarianceError) as info, rl_kernels.strict():
        a @ b  # <- matmul outside the mode
    message = str(info.value)
    assert message.startswith("aten.mm.default is a matmul")
    assert "run it inside rl_kernels.batch_invariant()" in message
    assert f"test_strict.py:{_line_of('# <- matmul outside the mode')} in " \
           f"test_raises_naming_op_reason_and_call_site" in message
    assert issubclass(BatchInvarianceError, RuntimeError) and rl_kernels.strict.Error is BatchInvarianceError


def test_allowed_inside_the_mode():
    x, w = randn(6, 32, seed=1), randn(20, 32, seed=2)
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    table = randn(10, 32, seed=3)
    q = randn(1, 2, 9, 64, seed=4)
    with rl_kernels.batch_invariant(), rl_kernels.strict():
        y = F.linear(x, w) + 1.0                           # covered GEMM, pointwise
        y = torch.softmax(y, -1) * F.silu(y)               # covered softmax, pointwise
        y = y / y.pow(2).mean(-1, keepdim=True).sqrt()     # covered mean
        y = torch.cat([y, y[:, :4]], 1).t().contiguous()   # cat, views, copy
        e = F.embedding(ids, table)                        # index without accumulation
        e = e[:, 1:].reshape(-1, 32).index_select(0, torch.tensor([0, 2]))
        e.masked_fill_(e > 0, 0.0)
        m = (ids > 0).sum(-1) + ids.cumsum(-1)[:, -1]      # integer reductions, integer scan
        i = y.argmax(-1), y.amax(0), y.max(-1).values, (y > 0).any(), torch.zeros(3), torch.arange(4)
        s = torch.sort(y[0], stable=True)                  # a stable sort: order fixed by values
        z = torch.where(y > 0, y, torch.zeros_like(y))
        k = torch.empty(4, 32).index_put_((torch.tensor([0, 1]),), x[:2])  # no accumulation
        F.scaled_dot_product_attention(q, q, q, is_causal=True)  # covered: rl_kernels.attention
        F.rms_norm(x, (32,))
        rl_kernels.linear_logp(x, w, torch.tensor([0, 1, 2, 3, 4, 5]))
    k = randn(1, 5, 2, 64, seed=5)
    with rl_kernels.strict():  # an rl_kernels op is fine without the mode
        rl_kernels.matmul(x, w.t())
        rl_kernels.attention(k, k, k)


REFUSED = {
    "mm outside the mode": (lambda x: x @ x.t(), "aten.mm.default", "matmul"),
    "sum over a dim": (lambda x: x.sum(-1), "aten.sum.dim_IntList", "reduction"),
    "full sum": (lambda x: x.sum(), "aten.sum.default", "every element"),
    "softmax": (lambda x: torch.softmax(x, -1), "aten._softmax.default", "softmax"),
    "float cumsum": (lambda x: x.cumsum(0), "aten.cumsum.default", "scan"),
    "scatter_add": (lambda x: torch.zeros(3, 5).scatter_add(0, torch.zeros(4, 5, dtype=torch.long), x[:, :5]),
                    "aten.scatter_add.default", "accumulation"),
    "index_add": (lambda x: torch.zeros(3, 8).index_add(0, torch.tensor([0, 0, 1, 2]), x),
                  "aten.index_add.default", "accumulation"),
    "index_put accumulate": (lambda x: torch.zeros(3, 8).index_put_((torch.tensor([0, 0]),), x[:2], accumulate=True),
                             "aten.index_put_.default", "accumulation"),
    "unstable sort": (lambda x: torch.sort(x, -1), "aten.sort.default", "sort"),
    "topk": (lambda x: torch.topk(x, 2), "aten.topk.default", "sort"),
    "random": (lambda x: F.dropout(x, 0.5, training=True), "aten.", "random"),  # bernoulli_ on CPU
    "layer_norm": (lambda x: F.layer_norm(x, (8,)), "aten.native_layer_norm.default", "normalization"),
    "sdpa": (lambda x: F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None]),
             "aten._scaled_dot_product_flash_attention_for_cpu.default", "attention"),
    "unknown": (lambda x: torch.linalg.qr(x), "aten.linalg_qr.default", "not known"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused(case):
    fn, op, reason = REFUSED[case]
    x = randn(4, 8, seed=1)
    with pytest.raises(BatchInvarianceError) as info, rl_kernels.strict():
        fn(x)
    assert str(info.value).startswith(op), str(info.value)
    assert reason in str(info.value)
    assert "test_strict.py:" in str(info.value)


def test_the_mode_handing_a_call_back_to_torch_is_refused():
    c, x = randn(4, 4).to(torch.complex64), randn(4, 4)
    out = torch.empty(4, 4)
    q, mask = randn(1, 1, 4, 64), torch.ones(4, 4, dtype=torch.bool).tril()
    with rl_kernels.batch_invariant():
        with pytest.raises(BatchInvarianceError, match="hands this call to torch"), rl_kernels.strict():
            torch.mm(c, c)
        with pytest.raises(BatchInvarianceError, match="every element"), rl_kernels.strict():
            x.mean()
        with pytest.raises(BatchInvarianceError, match="covers other overloads"), rl_kernels.strict():
            torch.mm(x, x, out=out)
        with pytest.raises(BatchInvarianceError, match="attention"), rl_kernels.strict():
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)  # masks are not mapped


def test_integer_and_bool_tensors_are_exact():
    a = torch.randint(0, 9, (5, 6))
    with rl_kernels.strict():
        a @ a.t(), a.sum(), a.cumsum(1), torch.zeros(3, dtype=torch.long).index_add(0, a[0, :3] % 3, a[1, :3])
        torch.sort(a, -1), (a > 3).sum(-1)


def test_warn_collects_sites_and_counts():
    x = randn(4, 8, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rl_kernels.strict("warn") as check:
            for _ in range(3):
                x @ x.t()  # <- three matmuls, one site
            x.sum(-1)  # <- one reduction
            F.relu(x)
    found = check.violations
    assert [(v.op, v.count) for v in found] == [("aten.mm.default", 3), ("aten.sum.dim_IntList", 1)]
    assert all(isinstance(v, Violation) for v in found)
    assert found[0].site.endswith(f"test_strict.py:{_line_of('# <- three matmuls')} in "
                                  f"test_warn_collects_sites_and_counts")
    mine = [w for w in caught if issubclass(w.category, BatchInvarianceWarning)]
    assert len(mine) == 2  # once per (op, site)
    assert mine[0].filename == __file__ and mine[0].lineno == _line_of("# <- three matmuls")
    text = check.report()
    assert "4 call(s) of 2 op(s)" in text and "3 x aten.mm.default" in text
    check.clear()
    assert check.violations == [] and "no op" in check.report()
    with pytest.raises(ValueError):
        rl_kernels.strict("ignore")


def test_backward_ops_are_checked_and_named():
    x = randn(4, 8, seed=1).requires_grad_()
    w = randn(8, 8, seed=2)
    with rl_kernels.batch_invariant():
        y = torch.softmax(F.linear(x, w), -1)
    with pytest.raises(BatchInvarianceError) as info, rl_kernels.strict():
        y.backward(torch.ones_like(y))  # outside the mode: torch's backward kernels
    assert "backward of" in str(info.value)
    x.grad = None
    with rl_kernels.batch_invariant():
        y = torch.softmax(F.linear(x, w), -1)
        with rl_kernels.strict():
            y.backward(torch.ones_like(y))


def test_composites_seen_undecomposed_in_inference_mode():
    q = randn(1, 2, 6, 64, seed=1)
    x, w = randn(3, 8, seed=2), randn(5, 8, seed=3)
    with torch.inference_mode():
        with rl_kernels.batch_invariant(), rl_kernels.strict():
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
            F.linear(x, w)
            F.rms_norm(x, (8,))
        with pytest.raises(BatchInvarianceError, match="flash_attention_for_cpu"), rl_kernels.strict():
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with pytest.raises(BatchInvarianceError, match="aten.mm.default"), rl_kernels.strict():
            F.linear(x, w)
