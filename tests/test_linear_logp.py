"""linear_logp on the CPU backend: values and gradients vs fp64, options, bad targets, bitwise
invariance, opcheck and torch.compile."""

import pytest
import torch

import rl_kernels
from rl_kernels.ops import linear_logp as linear_logp_module
from conftest import randn, rel_err

REF64 = rl_kernels.NativeLinearLogpOp(torch.float64)


def _problem(n, d, v, dtype=torch.float32, seed=0, bias=True):
    h = randn(n, d, dtype=dtype, seed=seed)
    w = randn(v, d, dtype=dtype, seed=seed + 1, scale=d ** -0.5 * 3)
    b = randn(v, dtype=dtype, seed=seed + 2) if bias else None
    gen = torch.Generator().manual_seed(seed + 3)
    t = torch.randint(0, v, (n,), generator=gen)
    return h, w, b, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logp_and_entropy_match_fp64(dtype, temperature):
    h, w, b, t = _problem(40, 96, 5003, dtype)
    logp, ent = rl_kernels.linear_logp(h, w, t, b, temperature=temperature, return_entropy=True)
    ref_logp, ref_ent = REF64(h, w, t, b, temperature=temperature, return_entropy=True)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert (logp.double() - ref_logp).abs().max() <= 1e-4
    assert (ent.double() - ref_ent).abs().max() <= 1e-4
    assert torch.equal(rl_kernels.linear_logp(h, w, t, b, temperature=temperature), logp)


def test_ignore_index_rows_are_zero_and_leading_dims_kept():
    h, w, _, t = _problem(12, 32, 100, bias=False)
    t[3] = -100
    t[7] = -100
    logp, ent = rl_kernels.linear_logp(h.view(3, 4, 32), w, t.view(3, 4), return_entropy=True)
    assert logp.shape == (3, 4) and ent.shape == (3, 4)
    assert logp.view(-1)[3] == 0 and ent.view(-1)[7] == 0
    ref = REF64(h, w, t)
    assert (logp.view(-1).double() - ref).abs().max() <= 1e-5
    custom = t.clone()
    custom[3] = 99  # a valid vocabulary id becomes the ignore index
    custom[7] = 5  # -100 is now an ordinary (and out-of-range) id: replace it
    out = rl_kernels.linear_logp(h, w, custom, ignore_index=99)
    assert out[3] == 0 and out[7] != 0


@pytest.mark.parametrize("bad", [100, -1, 2**40])
def test_bad_target_raises(bad):
    h, w, _, t = _problem(5, 16, 100, bias=False)
    t[2] = bad
    with pytest.raises(ValueError, match=r"target: a value is outside \[0, 100\)"):
        rl_kernels.linear_logp(h, w, t)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(target_dtype=torch.int32), TypeError, "target must be int64"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(weight_dtype=torch.float64), TypeError, "weight and bias"),
    (dict(target_shape=(4,)), ValueError, "target shape"),
])
def test_bad_arguments(kwargs, exc, match):
    h, w, _, t = _problem(5, 16, 100, bias=False)
    if "target_dtype" in kwargs:
        t = t.to(kwargs["target_dtype"])
    if "weight_dtype" in kwargs:
        w = w.to(kwargs["weight_dtype"])
    if "target_shape" in kwargs:
        t = t[:4]
    with pytest.raises(exc, match=match):
        rl_kernels.linear_logp(h, w, t, temperature=kwargs.get("temperature", 1.0))


def test_nan_in_hidden_poisons_only_its_row():
    h, w, b, t = _problem(6, 32, 300)
    h[2, 5] = float("nan")
    logp = rl_kernels.linear_logp(h, w, t, b)
    assert torch.isnan(logp[2]) and torch.isfinite(logp[torch.arange(6) != 2]).all()


def _grads(h, w, b, t, g_logp, g_ent, temperature, fn):
    leaves = [x.detach().clone().requires_grad_() for x in (h, w, b)]
    logp, ent = fn(leaves[0], leaves[1], t, leaves[2], temperature=temperature,
                   return_entropy=True)
    torch.autograd.backward((logp, ent), (g_logp.to(logp.dtype), g_ent.to(ent.dtype)))
    return [x.grad for x in leaves]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_gradients_random_cotangents_vs_fp64(dtype, tol, temperature):
    h, w, b, t = _problem(37, 64, linear_logp_module.VOCAB_CHUNK + 904, dtype)  # two vocabulary chunks
    t[4] = -100
    g_logp, g_ent = randn(37, seed=7), randn(37, seed=8)
    got = _grads(h, w, b, t, g_logp, g_ent, temperature, rl_kernels.linear_logp)
    want = _grads(h.double(), w.double(), b.double(), t, g_logp, g_ent, temperature, REF64)
    for name, x, ref in zip(("hidden", "weight", "bias"), got, want):
        assert x.dtype == dtype
        assert rel_err(x, ref) <= tol, name
    assert torch.all(got[0][4] == 0)  # an ignored row gets no gradient


def test_empty_batch_gives_zero_gradients():
    h, w, b, t = _problem(3, 16, 40, torch.float32, seed=14)
    x, ww, bb = (y.clone().requires_grad_() for y in (h[:0], w, b))
    logp, ent = rl_kernels.linear_logp(x, ww, t[:0], bb, return_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert torch.equal(ww.grad, torch.zeros_like(w)) and torch.equal(bb.grad, torch.zeros_like(b))
    assert x.grad.shape == (0, 16)


def test_backward_row_chunks_and_invariance(monkeypatch):
    h, w, b, t = _problem(50, 32, linear_logp_module.VOCAB_CHUNK + 104, torch.float32, seed=11)
    g_logp, g_ent = randn(50, seed=12), randn(50, seed=13)
    one_chunk = _grads(h, w, b, t, g_logp, g_ent, 1.0, rl_kernels.linear_logp)
    # force row blocks of 8 rows (fp32 dH row + fp32 logits + fp32 dz per row): dW and db are then
    # accumulated over 7 row blocks
    per_row = 4 * 32 + linear_logp_module.VOCAB_CHUNK * 8
    monkeypatch.setattr(linear_logp_module, "BACKWARD_BYTES", 8 * per_row)
    chunked = _grads(h, w, b, t, g_logp, g_ent, 1.0, rl_kernels.linear_logp)
    assert torch.equal(chunked[0], one_chunk[0])  # dH rows do not depend on row chunking
    want = _grads(h.double(), w.double(), b.double(), t, g_logp, g_ent, 1.0, REF64)
    for x, ref in zip(chunked, want):
        assert rel_err(x, ref) <= 2e-5
    again = _grads(h, w, b, t, g_logp, g_ent, 1.0, rl_kernels.linear_logp)
    for x, y in zip(again, chunked):
        assert torch.equal(x, y)  # deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_bitwise_invariant(dtype):
    h, w, b, t = _problem(129, 64, 3000, dtype, seed=20)
    full, full_ent = rl_kernels.linear_logp(h, w, t, b, return_entropy=True)
    for m in (1, 2, 3, 7, 16, 17, 64):
        assert torch.equal(rl_kernels.linear_logp(h[:m], w, t[:m], b), full[:m])
    alone, alone_ent = rl_kernels.linear_logp(h[50:51], w, t[50:51], b, return_entropy=True)
    assert torch.equal(alone, full[50:51]) and torch.equal(alone_ent, full_ent[50:51])
    chunks = [rl_kernels.linear_logp(h[s:e], w, t[s:e], b) for s, e in ((0, 40), (40, 41), (41, 129))]
    assert torch.equal(torch.cat(chunks), full)
    padded_h = torch.cat([h, randn(20, 64, dtype=dtype, seed=21) * 50])
    padded_t = torch.cat([t, torch.full((20,), -100)])
    assert torch.equal(rl_kernels.linear_logp(padded_h, w, padded_t, b)[:129], full)
    rl_kernels.set_num_threads(1)
    assert torch.equal(rl_kernels.linear_logp(h, w, t, b), full)


def test_grad_hidden_rows_invariant_and_weight_grad_deterministic():
    h, w, b, t = _problem(64, 32, 4500, seed=30)
    g_logp, g_ent = randn(64, seed=31), randn(64, seed=32)
    full = _grads(h, w, b, t, g_logp, g_ent, 1.0, rl_kernels.linear_logp)
    part = _grads(h[10:13], w, b, t[10:13], g_logp[10:13], g_ent[10:13], 1.0,
                  rl_kernels.linear_logp)
    assert torch.equal(part[0], full[0][10:13])
    again = _grads(h, w, b, t, g_logp, g_ent, 1.0, rl_kernels.linear_logp)
    assert torch.equal(again[1], full[1]) and torch.equal(again[2], full[2])


def test_module_and_registry_op():
    head = rl_kernels.LinearLogp(16, 50, bias=True)
    h = randn(3, 16, seed=40)
    t = torch.tensor([1, 2, 3])
    ref = REF64(h, head.weight.detach(), t, head.bias.detach())
    assert (head(h, t).double() - ref).abs().max() <= 1e-5
    op = rl_kernels.get_op("linear_logp")
    assert torch.equal(op(h, head.weight.detach(), t, head.bias.detach()), head(h, t).detach())


def test_opcheck():
    h, w, b, t = _problem(6, 16, 40, seed=50)
    args = (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), t, 0.9, -100, "auto")
    torch.library.opcheck(torch.ops.rl_kernels.linear_logp.default, args)
    logp, ent, lse = torch.ops.rl_kernels.linear_logp(*[x.detach() if torch.is_tensor(x) else x
                                                         for x in args])
    torch.library.opcheck(torch.ops.rl_kernels.linear_logp_backward.default,
                          (h.detach(), w.detach(), b.detach(), t, lse, ent, randn(6, seed=1),
                           randn(6, seed=2), 0.9, -100, "auto"))


def test_compile_fullgraph_forward_backward():
    def loss(h, w, t):
        logp, ent = rl_kernels.linear_logp(h, w, t, return_entropy=True)
        return (logp * 2 + 0.1 * ent).sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (4, 9):
        h, w, _, t = _problem(n, 16, 60, seed=n, bias=False)
        h.requires_grad_()
        w.requires_grad_()
        out = compiled(h, w, t)
        ref = loss(h, w, t)
        assert torch.equal(out, ref)
        assert all(torch.equal(x, y) for x, y in zip(torch.autograd.grad(out, (h, w)),
                                                     torch.autograd.grad(ref, (h, w))))
