"""Row ops (rms_norm, softmax, log_softmax, row_sum, row_mean) on the CPU backend: values against
fp64 references with error bounds derived from the rounding of each step, torch's semantics for
inf / NaN / empty / width-1 rows, the documented CPU summation order bit for bit, gradients
(gradcheck in fp64, random cotangents against fp64 autograd), bitwise batch invariance of forward
and backward rows (row counts, positions, strided and transposed views, 4096 and 151936 widths,
thread counts, repeats), the deterministic RMSNorm weight gradient, opcheck and torch.compile.
The GPU section at the end (marked gpu) sweeps row counts at the Qwen3-8B widths on CUDA."""

import math

import pytest
import torch
import torch.nn.functional as F

import rl_kernels
from rl_kernels import kernel_registry
from conftest import HAS_CUDA, randn, rel_err

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HALF = (torch.bfloat16, torch.float16)
IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
WIDTHS = [1, 7, 33, 1000, 4096, 4097]  # odd widths around the 16 lanes, Qwen3-8B hidden, past it
HIDDEN, VOCAB = 4096, 151936  # Qwen3-8B
LANES = 16  # csrc/cpu/row_reduce.h: 16 interleaved partial sums, then a tree of 4 levels
# (input dtype, dtype=torch.float32 asked for): an fp32 result is for 16-bit inputs only
DTYPE_OUT32 = [pytest.param(d, o, id=IDS[d] + ("-out_fp32" if o else ""))
               for d in FLOATS for o in (False, True) if d in HALF or not o]


def unit_roundoff(dtype):
    return torch.finfo(dtype).eps / 2


def compute_dtype(dtype):
    """What the kernels compute in: fp64 for fp64, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ulp(ref, dtype):
    """The spacing of `dtype` at |ref| (ref fp64), the subnormal spacing below the normal range."""
    fi = torch.finfo(dtype)
    mag = ref.double().abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def out_rounding(ref, err, out_dtype):
    """Half an ulp of out_dtype (at |ref| + err: the computed value may sit a binade up) when the
    result is rounded from the compute dtype to a narrower out_dtype, else 0."""
    if out_dtype in HALF:
        return 0.5 * ulp(ref.abs() + err, out_dtype)
    return torch.zeros_like(ref)


def cpu_sum_steps(n):
    """Roundings on any path of the CPU row sum: ceil(n / 16) - 1 adds in a lane (its first add to
    +0 is exact), 4 tree levels; one spare."""
    return math.ceil(n / LANES) + 4


def exact_row_sums(x64):
    """Correctly rounded fp64 sums of the rows of a 2-D fp64 tensor (math.fsum)."""
    return torch.tensor([math.fsum(row) for row in x64.tolist()], dtype=torch.float64)


def assert_within(got, ref, bound, what=""):
    """|got - ref| <= bound elementwise (ref and bound fp64); the message names the worst element."""
    err = (got.double() - ref).abs()
    bound = bound.expand_as(err)
    bad = ~(err <= bound)
    if bad.any():
        i = int(torch.argmax((err - bound).masked_fill(~bad, -math.inf).flatten()))
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.numel()} elements out of bounds; "
                             f"worst at flat index {i}: got {got.flatten()[i].item()!r}, "
                             f"ref {ref.flatten()[i].item()!r}, |err| {err.flatten()[i].item():.3e} "
                             f"> bound {bound.flatten()[i].item():.3e}")


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def grads_of(fn, x, w, cotangent):
    """(y, dx, dweight) of fn(x, w) with the given cotangent; w may be None."""
    x, w = leaves(x, w)
    y = fn(x, w)
    y.backward(cotangent.to(y.dtype))
    return y.detach(), x.grad, None if w is None else w.grad


# --------------------------------------------------------------------------------------------
# fp64 references
# --------------------------------------------------------------------------------------------

def kernel_eps(eps, dtype):
    """eps as the kernels add it: rounded to fp32 for fp32 / bf16 / fp16 (as torch adds a Python
    float to an fp32 tensor), as given for fp64."""
    return eps if dtype == torch.float64 else torch.tensor(eps, dtype=torch.float32).item()


def ref_rstd(x, eps):
    """1 / sqrt(mean(x^2) + eps) of each row of x [rows, n] in fp64 (exact sum of the squares)."""
    x64 = x.double()
    return 1.0 / torch.sqrt(exact_row_sums(x64 * x64) / x.shape[-1] + eps)


def ref_softmax(x, log=False):
    """fp64 softmax / log_softmax over the last dim of x [rows, n] (finite x), exact row sums:
    (y, d = x - max)."""
    x64 = x.double()
    d = x64 - x64.amax(-1, keepdim=True)
    z = exact_row_sums(torch.exp(d))[:, None]
    return (d - torch.log(z) if log else torch.exp(d) / z), d


def softmax_bound(d, ref, log, steps, out_dtype, compute=torch.float32):
    """|y - ref| bound of softmax / log_softmax computed in `compute` with a row sum of `steps`
    roundings on any path, from d = x - max and the fp64 ref; in units of compute's roundoff u:
    e = exp(d) is off by |d| (the rounding of d) + 2 (exp within an ulp), z by steps on top of its
    terms' error; softmax y = e / z adds 1 (relative); log_softmax y = d - log z is off absolutely
    by |d| + (z's relative error) + 2 |log z| + |y|. Then half an ulp of a 16-bit out_dtype."""
    u = unit_roundoff(compute)
    ad = d.abs()
    z_rel = steps + 2 + ad.amax(-1, keepdim=True)
    if log:
        err = u * (ad + z_rel + 2 * (d - ref).abs() + ref.abs())
    else:
        err = u * (ad + 2 + z_rel + 1) * ref
    err = err + 8 * unit_roundoff(torch.float64) * ref.abs()  # the reference's own error
    return (err + out_rounding(ref, err, out_dtype)) * 1.01


# --------------------------------------------------------------------------------------------
# Accuracy against fp64
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=IDS.get)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("mode", ["no_weight", "weight", "round_before_weight"])
def test_rms_norm_matches_fp64(dtype, width, mode):
    """rstd and y against fp64 of the same (rounded) inputs, bounded by the roundings of the fp32
    (fp64) computation: the sum of squares (cpu_sum_steps), / n, + eps, sqrt, 1 / (rstd: relative
    (steps + 3) / 2 + 2 u), then x * rstd and * w (2 u), then the output rounding (half an ulp of
    a 16-bit dtype); with round_before_weight also the rounding of h to the dtype before * w."""
    rows, eps = 64, 1e-6
    x = randn(rows, width, dtype=dtype, seed=width, scale=2.0)
    w = None if mode == "no_weight" else randn(width, dtype=dtype, seed=width + 1)
    rbw = mode == "round_before_weight"
    y, rstd = torch.ops.rl_kernels.rms_norm(x, w, eps, rbw, "auto")
    assert kernel_registry.last_kernel() == "rms_norm_fwd_cpu"
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (rows,)
    assert torch.equal(rl_kernels.rms_norm(x, w, eps, round_before_weight=rbw), y)

    u = unit_roundoff(compute_dtype(dtype))
    rstd64 = ref_rstd(x, kernel_eps(eps, dtype))
    rstd_rel = ((cpu_sum_steps(width) + 3) / 2 + 2) * u
    # the saved rstd is fp32: fp64 inputs add its rounding
    rstd_bound = rstd64 * (rstd_rel + (unit_roundoff(torch.float32) if dtype == torch.float64 else 0))
    assert_within(rstd, rstd64, rstd_bound * 1.01, "rstd")

    h = x.double() * rstd64[:, None]
    w64 = torch.ones(width, dtype=torch.float64) if w is None else w.double()
    ref = h * w64
    err = (rstd_rel + 2 * u) * ref.abs() + 4 * unit_roundoff(torch.float64) * ref.abs()  # + the reference's
    if rbw and dtype in HALF:  # w * round(h): h's rounding scaled by w, then w * h' rounded
        h_err = (rstd_rel + u) * h.abs() + out_rounding(h, (rstd_rel + u) * h.abs(), dtype)
        err = w64.abs() * h_err + u * (ref.abs() + w64.abs() * h_err)
    assert_within(y, ref, (err + out_rounding(ref, err, dtype)) * 1.01, "y")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=IDS.get)
@pytest.mark.parametrize("width", [7, 33, 4096])
def test_rms_norm_output_is_exactly_the_documented_formula_of_its_rstd(dtype, width):
    """Given the forward's rstd, y is fixed bit for bit: round(x * rstd * w) (F.rms_norm),
    round(w * round(x * rstd)) (transformers' Llama / Qwen RMSNorm), round(x * rstd) without a
    weight, each product one fp32 rounding. For fp32 both weight modes are the same bits."""
    x = randn(40, width, dtype=dtype, seed=3, scale=1.7)
    w = randn(width, dtype=dtype, seed=4)
    for weight, rbw in ((None, False), (w, False), (w, True)):
        y, rstd = torch.ops.rl_kernels.rms_norm(x, weight, 1e-5, rbw, "auto")
        h = x.float() * rstd[:, None]
        if weight is None:
            want = h.to(dtype)
        elif rbw:
            want = (weight.float() * h.to(dtype).float()).to(dtype)
        else:
            want = (h * weight.float()).to(dtype)
        assert torch.equal(y, want), (weight is None, rbw)
    if dtype == torch.float32:
        assert torch.equal(rl_kernels.rms_norm(x, w, round_before_weight=True), rl_kernels.rms_norm(x, w))
    else:  # the intermediate rounding changes some bits: the flag is not ignored
        assert not torch.equal(rl_kernels.rms_norm(x, w, round_before_weight=True), rl_kernels.rms_norm(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=IDS.get)
@pytest.mark.parametrize("width", [7, 1000, 4096])
def test_rms_norm_matches_torch_and_transformers(dtype, width):
    """Against torch's own implementations on the same dtype: F.rms_norm (round_before_weight
    False) and transformers' Qwen3RMSNorm formula (True). Both sides round the same fp32 value up
    to their fp32 error, so they differ by at most one ulp of the output (16-bit) or a few fp32 ulps;
    the transformers formula also rounds h, which may land one ulp of h apart, scaled by |w|."""
    eps = 1e-6
    x = randn(50, width, dtype=dtype, seed=5, scale=3.0)
    w = randn(width, dtype=dtype, seed=6)
    ulps = 1 if dtype in HALF else 8
    ours = rl_kernels.rms_norm(x, w, eps).double()
    theirs = F.rms_norm(x, (width,), w, eps).double()
    assert_within(ours, theirs, ulps * ulp(theirs, dtype), "vs F.rms_norm")

    xf = x.float()
    hf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    transformers = (w * hf.to(dtype)).double()
    ours = rl_kernels.rms_norm(x, w, eps, round_before_weight=True).double()
    slack = w.double().abs() * ulp(hf.double(), dtype) if dtype in HALF else 0
    assert_within(ours, transformers, ulps * ulp(transformers, dtype) + slack * 1.01,
                  "vs transformers RMSNorm")


@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-5, 0.01, 1.0, 2.0 ** -20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_rms_norm_eps(eps, dtype):
    """eps enters as mean(x^2) + eps (float eps, a 0-d tensor, int 0): rows scaled so that eps
    matters, against F.rms_norm on the same dtype (one ulp of a bf16 output, 8 fp32 ulps: both
    round nearly the same fp32 value)."""
    for scale in (1e-3, 1.0):
        x = randn(20, 300, dtype=dtype, seed=7, scale=scale)
        w = randn(300, dtype=dtype, seed=8)
        want = F.rms_norm(x, (300,), w, eps).double()
        got = rl_kernels.rms_norm(x, w, eps)
        tol = (1 if dtype in HALF else 8) * ulp(want, dtype)
        assert_within(got, want, tol, f"eps {eps}, scale {scale}")
        assert torch.equal(rl_kernels.rms_norm(x, w, torch.tensor(eps)), got)
        if eps == 0.0:
            assert torch.equal(rl_kernels.rms_norm(x, w, 0), got)


def test_fp64_rms_norm_adds_eps_in_fp64():
    x = randn(8, 64, dtype=torch.float64, seed=10, scale=1e-4)  # mean(x^2) ~ 1e-8 << eps
    want = F.rms_norm(x, (64,), None, 1e-6)
    got = rl_kernels.rms_norm(x, None, 1e-6)
    assert_within(got, want, 16 * unit_roundoff(torch.float64) * want.abs(), "fp64 rms_norm, eps 1e-6")


@pytest.mark.parametrize("dtype,out32", DTYPE_OUT32)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_matches_fp64(dtype, out32, width, log):
    """softmax / log_softmax against fp64, within softmax_bound (the roundings of each step, the
    CPU sum's steps)."""
    x = randn(64, width, dtype=dtype, seed=11 + width, scale=3.0)
    fn = rl_kernels.log_softmax if log else rl_kernels.softmax
    y = fn(x, dtype=torch.float32 if out32 else None)
    out_dtype = torch.float32 if out32 else dtype
    assert y.dtype == out_dtype and y.shape == x.shape
    assert kernel_registry.last_kernel() == "softmax_fwd_cpu"

    ref, d = ref_softmax(x, log)
    assert_within(y, ref, softmax_bound(d, ref, log, cpu_sum_steps(width), out_dtype,
                                        compute_dtype(dtype)), "y")


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS.get)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_matches_torch_on_the_same_dtype(dtype, log):
    """torch.softmax / torch.log_softmax (dtype=None and dtype=torch.float32) compute the same
    function: ours is within torch's own error (against fp64) plus one ulp of a 16-bit output, or
    64 fp32 / fp64 ulps (absolute near 0 for log_softmax), of torch's result. (torch's own error is
    not negligible: its CPU bf16 log_softmax is up to ~7 bf16 ulps off near -0.08, ours half an ulp.)
    And ours is never less accurate than torch's beyond that slack."""
    x = randn(80, 1000, dtype=dtype, seed=12, scale=3.0)
    mine, theirs = (rl_kernels.log_softmax, torch.log_softmax) if log else (rl_kernels.softmax, torch.softmax)
    ref = theirs(x.double(), -1)
    for out_dtype in ([None, torch.float32] if dtype in HALF else [None]):
        want = theirs(x, -1, dtype=out_dtype)
        got = mine(x, dtype=out_dtype)
        assert got.dtype == want.dtype
        od = out_dtype or dtype
        slack = (1 if od in HALF else 64) * ulp(ref, od)
        if log:
            slack = slack + 64 * unit_roundoff(compute_dtype(dtype))
        theirs_err = (want.double() - ref).abs()
        assert_within(got, want.double(), theirs_err + slack, f"vs torch, out_dtype {od}")
        assert_within(got, ref, theirs_err + slack, f"vs fp64 no worse than torch, out_dtype {od}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=IDS.get)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_over_other_dims(dtype, log):
    """dim != -1 (0, 1, negative, on 4-D and 2-D x): the bits of moving `dim` last, contiguous,
    and back; the output is x's shape; values against fp64 torch."""
    fn = rl_kernels.log_softmax if log else rl_kernels.softmax
    ref_fn = torch.log_softmax if log else torch.softmax
    x = randn(6, 37, 5, 3, dtype=dtype, seed=13, scale=2.0)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float64: 1e-14}[dtype]
    for dim in (0, 1, 2, 3, -1, -2, -3, -4):
        got = fn(x, dim)
        assert got.shape == x.shape and got.dtype == dtype
        moved = fn(x.movedim(dim, -1).contiguous()).movedim(-1, dim)
        assert torch.equal(got, moved), dim
        assert rel_err(got, ref_fn(x.double(), dim)) <= tol, dim
    m = randn(300, 17, dtype=dtype, seed=14)
    assert torch.equal(fn(m, 0), fn(m.t().contiguous(), -1).t())
    assert torch.equal(fn(m.t(), 1), fn(m.t().contiguous(), 1))  # a transposed input, dim -1


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_over_other_dim_is_laid_out_like_torch(log):
    fn, ref_fn = (rl_kernels.log_softmax, torch.log_softmax) if log else (rl_kernels.softmax, torch.softmax)
    x = randn(2, 8, 6, seed=14)
    want = ref_fn(x, 1)
    got = fn(x, 1)
    assert got.stride() == want.stride()
    assert torch.equal(got.view(2, 48), fn(x, 1).reshape(2, 48))


@pytest.mark.parametrize("dtype,out32", DTYPE_OUT32)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("mean", [False, True], ids=["row_sum", "row_mean"])
def test_row_sum_and_mean_match_fp64(dtype, out32, width, mean):
    """Against the exact (fsum) row sum of the same inputs: the sum is off by at most
    cpu_sum_steps(n) * u * sum|x| (random signs: no relative bound), the mean's division adds u
    relative; then half an ulp of a 16-bit output. keepdim gives the same values as [rows, 1]."""
    x = randn(64, width, dtype=dtype, seed=15 + width, scale=2.0)
    fn = rl_kernels.row_mean if mean else rl_kernels.row_sum
    out_dtype = torch.float32 if out32 else None
    y = fn(x, dtype=out_dtype)
    od = out_dtype or dtype
    assert y.dtype == od and y.shape == (64,)
    assert kernel_registry.last_kernel() == "row_sum_cpu"
    kept = fn(x, keepdim=True, dtype=out_dtype)
    assert kept.shape == (64, 1) and torch.equal(kept[:, 0], y)

    u = unit_roundoff(compute_dtype(dtype))
    x64 = x.double()
    ref = exact_row_sums(x64)
    err = cpu_sum_steps(width) * u * x64.abs().sum(-1)
    if mean:
        ref, err = ref / width, err / width + u * (ref.abs() / width)
    err = err + unit_roundoff(torch.float64) * ref.abs()
    assert_within(y, ref, (err + out_rounding(ref, err, od)) * 1.01, "row sum")


def test_row_sum_and_mean_match_torch_semantics():
    """x.sum(-1) / x.mean(-1) on the same dtype for 16-bit x (torch sums in fp32, rounds once):
    within one ulp of the output; 3-D x keeps the leading dims; dtype=float32 is x.sum(-1,
    dtype=torch.float32) within fp32 summation error."""
    for dtype in HALF:
        x = randn(4, 30, 513, dtype=dtype, seed=16)
        for mine, theirs in ((rl_kernels.row_sum, torch.sum), (rl_kernels.row_mean, torch.mean)):
            want = theirs(x, -1).double()
            got = mine(x)
            assert got.shape == (4, 30)
            # both round an fp32 sum (errors << half an ulp) to the dtype: at most one ulp apart
            assert_within(got, want, ulp(want, dtype), mine.__name__)
            want32 = theirs(x, -1, dtype=torch.float32).double()
            bound = 64 * unit_roundoff(torch.float32) * x.double().abs().sum(-1) / (513 if mine is rl_kernels.row_mean else 1)
            assert_within(mine(x, dtype=torch.float32), want32, bound, mine.__name__ + " fp32")
            assert torch.equal(mine(x, keepdim=True), mine(x)[..., None])


# --------------------------------------------------------------------------------------------
# The documented CPU order, bit for bit (docs/operators/row_ops.md, csrc/cpu/row_reduce.h)
# --------------------------------------------------------------------------------------------

def lane_sum(t):
    """fp32 sums of the rows of t [rows, n] in the documented CPU order: lane l adds t[:, j] for
    j = l, l + 16, ... in increasing j from +0, then lanes l += l + 8, l += l + 4, += 2, += 1."""
    rows, n = t.shape
    lane = torch.zeros(rows, LANES, dtype=t.dtype)
    for j in range(0, n, LANES):
        chunk = t[:, j:j + LANES]
        lane[:, :chunk.shape[1]] = lane[:, :chunk.shape[1]] + chunk  # +0 pads: exact
    width = LANES // 2
    while width >= 1:
        lane = lane[:, :width] + lane[:, width:2 * width]
        width //= 2
    return lane[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=IDS.get)
@pytest.mark.parametrize("width", [1, 15, 16, 17, 33, 1000, 4097])
def test_cpu_sums_follow_the_documented_order(dtype, width):
    """row_sum, row_mean (sum / n), and rms_norm's rstd (1 / sqrt(sum(x*x) / n + eps)) are exactly
    the lane order above, in fp32: the order docs/operators/row_ops.md promises (and that rollouts
    and training share)."""
    x = randn(24, width, dtype=dtype, seed=17, scale=2.0)
    xf = x.float()
    s = lane_sum(xf)
    assert torch.equal(rl_kernels.row_sum(x, dtype=None if dtype == torch.float32 else torch.float32), s)
    assert torch.equal(rl_kernels.row_sum(x), s.to(dtype))
    assert torch.equal(rl_kernels.row_mean(x), (s / width).to(dtype))
    eps = torch.tensor(1e-6, dtype=torch.float32)
    v = lane_sum(xf * xf) / width + eps
    # sqrtf and 1 / s, each correctly rounded: in fp64, rounded to fp32 (53 >= 2 * 24 + 2 bits, so
    # the double rounding is exact); torch's fp32 sqrt on the CPU is not always correctly rounded
    s = torch.sqrt(v.double()).float()
    rstd = (1.0 / s.double()).float()
    assert torch.equal(torch.ops.rl_kernels.rms_norm(x, None, 1e-6, False, "auto")[1], rstd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
@pytest.mark.parametrize("rbw", [False, True], ids=["weight", "round_before_weight"])
def test_cpu_rms_norm_backward_is_the_documented_formula(dtype, rbw):
    """csrc/cpu/rms_norm.c's backward in fp32, bit for bit: g = dy * w, dot = lane_sum(g * x),
    c = rstd^3 * (dot / n), dx = rstd * g - x * c; dweight = sum over blocks of 16 rows (in
    increasing order) of each block's sum of dy * h' (rows in increasing order, from +0), h' =
    round(x * rstd) with round_before_weight. 40 rows: two full blocks and a partial one."""
    rows, n = 40, 33
    x = randn(rows, n, dtype=dtype, seed=18, scale=1.5)
    w = randn(n, dtype=dtype, seed=19)
    dy = randn(rows, n, dtype=dtype, seed=20)
    _, rstd = torch.ops.rl_kernels.rms_norm(x, w, 1e-6, rbw, "auto")
    dx, dw = torch.ops.rl_kernels.rms_norm_backward(x, w, rstd, dy, 1e-6, rbw, True, "auto")
    assert kernel_registry.last_kernel() == "rms_norm_bwd_cpu"
    xf, wf, dyf, r = x.float(), w.float(), dy.float(), rstd[:, None]
    g = dyf * wf
    c = r * r * r * (lane_sum(g * xf)[:, None] / n)
    assert torch.equal(dx, (r * g - xf * c).to(dtype))
    h = xf * r
    if rbw:
        h = h.to(dtype).float()
    total = torch.zeros(n)
    for b in range(0, rows, 16):
        part = torch.zeros(n)
        for i in range(b, min(b + 16, rows)):
            part = part + dyf[i] * h[i]
        total = total + part
    assert torch.equal(dw, total.to(dtype))


def test_cpu_softmax_backward_is_the_documented_formula():
    """softmax backward bit for bit: s = lane_sum(round(dy * y)), dx = y * (dy - s), for fp32 and
    for a bf16 input with an fp32 output (dx rounded to bf16)."""
    for dtype, out_dtype in ((torch.float32, None), (torch.bfloat16, torch.float32)):
        x = randn(30, 50, dtype=dtype, seed=21, scale=2.0)
        y = rl_kernels.softmax(x, dtype=out_dtype)
        dy = randn(30, 50, seed=22).to(y.dtype)
        dx = torch.ops.rl_kernels.softmax_backward(y, dy, dtype, False, "auto")
        yf, dyf = y.float(), dy.float()
        assert torch.equal(dx, (yf * (dyf - lane_sum(dyf * yf)[:, None])).to(dtype))


# --------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------

def test_gradcheck_rms_norm_fp64():
    x, w = leaves(randn(5, 37, dtype=torch.float64, seed=23), randn(37, dtype=torch.float64, seed=24))
    for rbw in (False, True):
        assert torch.autograd.gradcheck(
            lambda x, w: rl_kernels.rms_norm(x, w, 1e-3, round_before_weight=rbw), (x, w))
    assert torch.autograd.gradcheck(lambda x: rl_kernels.rms_norm(x, None, 0.5), (x,))
    # 3-D x, 40 rows: the weight gradient sums three row blocks
    x3 = leaves(randn(4, 10, 9, dtype=torch.float64, seed=25))[0]
    w9 = leaves(randn(9, dtype=torch.float64, seed=26))[0]
    assert torch.autograd.gradcheck(lambda x, w: rl_kernels.rms_norm(x, w, 1e-5), (x3, w9))


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_gradcheck_softmax_fp64(log):
    fn = rl_kernels.log_softmax if log else rl_kernels.softmax
    x = leaves(randn(5, 37, dtype=torch.float64, seed=27, scale=2.0))[0]
    assert torch.autograd.gradcheck(fn, (x,))
    x3 = leaves(randn(3, 6, 4, dtype=torch.float64, seed=28, scale=2.0))[0]
    for dim in (0, 1, -1):
        assert torch.autograd.gradcheck(lambda t: fn(t, dim), (x3,))
    # -inf entries (a mask): finite gradients elsewhere, zero at the masked entries
    masked = randn(4, 9, dtype=torch.float64, seed=29)
    masked[:, ::3] = -math.inf
    xm = leaves(masked)[0]
    y = fn(xm)
    (dx,) = torch.autograd.grad(y, xm, randn(4, 9, dtype=torch.float64, seed=30))
    ref = leaves(masked)[0]
    (want,) = torch.autograd.grad((torch.log_softmax if log else torch.softmax)(ref, -1), ref,
                                  randn(4, 9, dtype=torch.float64, seed=30))
    if not log:  # softmax: y = 0 there; log_softmax: dy - exp(-inf) * sum(dy) = dy there
        assert torch.equal(dx[:, ::3], torch.zeros_like(dx[:, ::3]))
    assert rel_err(dx, want) <= 1e-14


@pytest.mark.parametrize("mean", [False, True], ids=["row_sum", "row_mean"])
def test_gradcheck_row_sum_fp64(mean):
    fn = rl_kernels.row_mean if mean else rl_kernels.row_sum
    x = leaves(randn(3, 5, 37, dtype=torch.float64, seed=31))[0]
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradcheck(lambda t: fn(t, keepdim=True), (x,))


# relative (norm) error of gradients against fp64 autograd: 8 roundoffs of the output dtype (the
# cotangent, inputs and outputs each carry one rounding of the dtype; fp32 arithmetic adds ~1e-7)
GRAD_TOL = {torch.float32: 8 * unit_roundoff(torch.float32), torch.bfloat16: 8 * unit_roundoff(torch.bfloat16),
            torch.float16: 8 * unit_roundoff(torch.float16)}

GRAD_OPS = {
    "rms_norm": (lambda x, w: rl_kernels.rms_norm(x, w, 1e-6),
                 lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)),
    "rms_norm_rbw": (lambda x, w: rl_kernels.rms_norm(x, w, 1e-6, round_before_weight=True),
                     lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)),
    "rms_norm_no_weight": (lambda x, w: rl_kernels.rms_norm(x, None, 1e-5),
                           lambda x, w: F.rms_norm(x, (x.shape[-1],), None, 1e-5)),
    "softmax": (lambda x, w: rl_kernels.softmax(x), lambda x, w: torch.softmax(x, -1)),
    "log_softmax": (lambda x, w: rl_kernels.log_softmax(x), lambda x, w: torch.log_softmax(x, -1)),
    "softmax_out_fp32": (lambda x, w: rl_kernels.softmax(x, dtype=torch.float32),
                         lambda x, w: torch.softmax(x, -1)),
    "log_softmax_out_fp32": (lambda x, w: rl_kernels.log_softmax(x, dtype=torch.float32),
                             lambda x, w: torch.log_softmax(x, -1)),
    "row_sum": (lambda x, w: rl_kernels.row_sum(x), lambda x, w: x.sum(-1)),
    "row_mean": (lambda x, w: rl_kernels.row_mean(x, keepdim=True), lambda x, w: x.mean(-1, keepdim=True)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=IDS.get)
@pytest.mark.parametrize("width", [7, 1000, HIDDEN])
@pytest.mark.parametrize("op", list(GRAD_OPS))
def test_gradients_random_cotangents_vs_fp64(dtype, width, op):
    fn, ref_fn = GRAD_OPS[op]
    rows = 33
    x = randn(rows, width, dtype=dtype, seed=32 + width, scale=2.0)
    w = randn(width, dtype=dtype, seed=33) if op in ("rms_norm", "rms_norm_rbw") else None
    y_probe = fn(x, w)
    cot = randn(*y_probe.shape, seed=34).to(y_probe.dtype)  # rounded once: the fp64 side gets these bits
    y, dx, dw = grads_of(fn, x, w, cot)
    ry, rdx, rdw = grads_of(ref_fn, x.double(), None if w is None else w.double(), cot.double())
    assert dx.dtype == dtype and dx.shape == x.shape
    assert rel_err(dx, rdx) <= GRAD_TOL[dtype], "dx"
    if w is not None:
        assert dw.dtype == dtype and rel_err(dw, rdw) <= GRAD_TOL[dtype], "dweight"
    if op.startswith(("rms", "softmax", "log")):
        assert kernel_registry.last_kernel() in ("rms_norm_bwd_cpu", "softmax_bwd_cpu")


def test_fp64_gradients_match_torch_autograd():
    """fp64: y, dx and dweight to ~1e-15 of torch's fp64 autograd (random cotangents). eps 2^-17 is
    exact in fp32 (the kernels take a float eps: test_fp64_rms_norm_adds_eps_in_fp64)."""
    x, w = randn(20, 300, dtype=torch.float64, seed=35), randn(300, dtype=torch.float64, seed=36)
    cot = randn(20, 300, dtype=torch.float64, seed=37)
    eps = 2.0 ** -17
    ops = {"rms_norm": (lambda x, w: rl_kernels.rms_norm(x, w, eps), lambda x, w: F.rms_norm(x, (300,), w, eps)),
           "rms_norm_no_weight": (lambda x, w: rl_kernels.rms_norm(x, None, eps, round_before_weight=True),
                                  lambda x, w: F.rms_norm(x, (300,), None, eps)),
           "softmax": GRAD_OPS["softmax"], "log_softmax": GRAD_OPS["log_softmax"]}
    for op, (fn, ref_fn) in ops.items():
        ww = w if op == "rms_norm" else None
        got, want = grads_of(fn, x, ww, cot), grads_of(ref_fn, x, ww, cot)
        for name, a, b in zip(("y", "dx", "dweight"), got, want):
            if b is not None:
                assert rel_err(a, b) <= 1e-14, (op, name)


def test_rms_norm_weight_gradient_with_round_before_weight_uses_the_rounded_h():
    """dweight = sum_r dy * round(h) (transformers' weight * h.to(dtype)), not dy * h: one row
    (no sum), bf16, so each element is a single rounded product."""
    x, w = randn(1, 500, dtype=torch.bfloat16, seed=38), randn(500, dtype=torch.bfloat16, seed=39)
    dy = randn(1, 500, dtype=torch.bfloat16, seed=40)
    _, rstd = torch.ops.rl_kernels.rms_norm(x, w, 1e-6, True, "auto")
    _, _, dw = grads_of(lambda x, w: rl_kernels.rms_norm(x, w, round_before_weight=True), x, w, dy)
    h_rounded = (x.float() * rstd[:, None]).to(torch.bfloat16).float()
    assert torch.equal(dw, (dy.float() * h_rounded)[0].to(torch.bfloat16))
    xt, wt = leaves(x, w)  # transformers' formula under torch autograd, same dtype
    xf = xt.float()
    (wt * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)).backward(dy)
    assert_within(dw, wt.grad.double(), ulp(wt.grad.double(), torch.bfloat16) * 2, "vs transformers dweight")


def test_rms_norm_with_a_parameter_weight_runs_eagerly_and_still_records_autograd(monkeypatch):
    """nn.Parameter weights (every RMSNorm module's) take the direct eager path under no_grad, with
    the bits of a plain tensor weight; with grad on they go through the op and get gradients."""
    x = randn(5, 96, dtype=torch.bfloat16, seed=41)
    w = torch.nn.Parameter(randn(96, dtype=torch.bfloat16, seed=42))
    plain = rl_kernels.rms_norm(x, w.detach(), round_before_weight=True)
    with torch.no_grad():
        with monkeypatch.context() as m:  # the registered op must not be reached
            m.setattr(torch.ops.rl_kernels, "rms_norm", None)
            assert torch.equal(rl_kernels.rms_norm(x, w, round_before_weight=True), plain)
    dy = randn(5, 96, dtype=torch.bfloat16, seed=43)
    rl_kernels.rms_norm(x, w, round_before_weight=True).backward(dy)
    _, _, dw = grads_of(lambda x, w: rl_kernels.rms_norm(x, w, round_before_weight=True), x, w.detach(), dy)
    assert torch.equal(w.grad, dw)


# --------------------------------------------------------------------------------------------
# Bitwise batch invariance
# --------------------------------------------------------------------------------------------

# name -> fn(x, w); every output row depends on its x row (and w) alone
INV_OPS = {
    "rms_norm": lambda x, w: rl_kernels.rms_norm(x, w, 1e-6),
    "rms_norm_rbw": lambda x, w: rl_kernels.rms_norm(x, w, 1e-6, round_before_weight=True),
    "rms_norm_no_weight": lambda x, w: rl_kernels.rms_norm(x, None, 1e-5),
    "softmax": lambda x, w: rl_kernels.softmax(x),
    "log_softmax": lambda x, w: rl_kernels.log_softmax(x),
    "softmax_out_fp32": lambda x, w: rl_kernels.softmax(x, dtype=torch.float32),
    "log_softmax_out_fp32": lambda x, w: rl_kernels.log_softmax(x, dtype=torch.float32),
    "row_sum": lambda x, w: rl_kernels.row_sum(x),
    "row_sum_out_fp32": lambda x, w: rl_kernels.row_sum(x, dtype=torch.float32),
    "row_mean": lambda x, w: rl_kernels.row_mean(x, keepdim=True),
}
GRAD_INV_OPS = ["rms_norm", "rms_norm_rbw", "rms_norm_no_weight", "softmax", "log_softmax",
                "log_softmax_out_fp32", "row_mean"]
ROW_COUNTS = [1, 2, 3, 5, 7, 16, 17, 31, 129, 255, 1000, 2049, 4096]  # with ragged ones
N_ROWS = 4096 + 61  # the full batch: every count at several offsets


@pytest.fixture(scope="module")
def hidden_rows():
    """bf16 activations [N_ROWS, 4096] (Qwen3-8B hidden) with a weight, both with a spread."""
    return (randn(N_ROWS, HIDDEN, dtype=torch.bfloat16, seed=41, scale=2.0),
            randn(HIDDEN, dtype=torch.bfloat16, seed=42))


def _starts(n, total):
    """Offsets at which n rows are taken from `total`: the start, the end, an odd one between."""
    return sorted({0, total - n, (total - n) // 3 | 1} & set(range(total - n + 1)))


@pytest.mark.parametrize("op", list(INV_OPS))
def test_rows_bitwise_over_row_counts_and_positions(op, hidden_rows):
    """Rows of a batch of 4157 at width 4096 equal the same rows computed in batches of 1..4096
    taken at the start, the end and an odd offset, and in a permuted batch."""
    x, w = hidden_rows
    fn = INV_OPS[op]
    full = fn(x, w)
    for n in ROW_COUNTS:
        for s in _starts(n, N_ROWS):
            assert torch.equal(fn(x[s:s + n], w), full[s:s + n]), f"{n} rows at {s}"
    perm = torch.randperm(N_ROWS, generator=torch.Generator().manual_seed(43))[:777]
    assert torch.equal(fn(x[perm], w), full[perm])


@pytest.mark.parametrize("op", list(INV_OPS))
def test_rows_bitwise_in_strided_views(op, hidden_rows):
    """Non-contiguous inputs give the rows of the contiguous batch: every other row, rows of a
    wider buffer (a fused projection's slice), [64, 64, D] with transposed leading dims, and a
    [D]-vector (1-D x)."""
    x, w = hidden_rows
    fn = INV_OPS[op]
    x = x[:HIDDEN]
    full = fn(x, w)
    assert torch.equal(fn(x[::2], w), full[::2])
    assert torch.equal(fn(x[1::3], w), full[1::3])
    buf = torch.zeros(HIDDEN, HIDDEN + 72, dtype=x.dtype)
    buf[:, 40:40 + HIDDEN] = x
    assert torch.equal(fn(buf[:, 40:40 + HIDDEN], w), full)
    lead = x.view(64, 64, HIDDEN).transpose(0, 1)
    assert torch.equal(fn(lead, w), full.reshape(64, 64, *full.shape[1:]).transpose(0, 1))
    assert torch.equal(fn(x[17], w), full[17])
    expanded = x[5:6].expand(33, HIDDEN)  # a broadcast row (stride 0)
    assert torch.equal(fn(expanded, w), full[5:6].expand(33, *full.shape[1:]))


@pytest.mark.parametrize("op", GRAD_INV_OPS)
def test_backward_rows_bitwise_over_row_counts(op, hidden_rows):
    """dx rows (random cotangent) of a batch of 1040 equal those of sub-batches of 1..1000 rows
    at several offsets, and those of a strided view; the forward's grad path (torch.library op)
    gives the bits of the eager path."""
    x, w = hidden_rows
    fn = INV_OPS[op]
    x = x[:1040]
    y0 = fn(x, w)
    cot = randn(*y0.shape, seed=44).to(y0.dtype)
    y, dx, _ = grads_of(fn, x, w, cot)
    assert torch.equal(y, y0)  # requires_grad (dispatcher + autograd) vs eager
    for n in (1, 3, 17, 129, 1000):
        for s in _starts(n, 1040):
            yn, dxn, _ = grads_of(fn, x[s:s + n], w, cot[s:s + n])
            assert torch.equal(dxn, dx[s:s + n]), f"{n} rows at {s}"
    buf = torch.zeros(1040, HIDDEN + 8, dtype=x.dtype)
    buf[:, 8:] = x
    assert torch.equal(grads_of(fn, buf[:, 8:], w, cot)[1], dx)
    cot_t = cot.t().contiguous().t() if cot.dim() == 2 else cot  # a column-major cotangent
    assert torch.equal(grads_of(fn, x, w, cot_t)[1], dx)


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS.get)
@pytest.mark.parametrize("width", [1, 7, 33, 1000, 4097])
def test_odd_widths_rows_bitwise_forward_and_backward(dtype, width):
    """Every op at odd widths and every dtype: rows of 200 equal sub-batches of 1, 2, 3, 7, 17,
    129 at two offsets, forward and dx."""
    x = randn(200, width, dtype=dtype, seed=45 + width, scale=2.0)
    w = randn(width, dtype=dtype, seed=46)
    for op, fn in INV_OPS.items():
        if "fp32" in op and dtype == torch.float64:
            continue
        full = fn(x, w)
        for n in (1, 2, 3, 7, 17, 129):
            for s in (0, 200 - n):
                assert torch.equal(fn(x[s:s + n], w), full[s:s + n]), (op, n, s)
        if op in GRAD_INV_OPS:
            cot = randn(*full.shape, seed=47).to(full.dtype)
            dx = grads_of(fn, x, w, cot)[1]
            for n, s in ((1, 0), (1, 199), (7, 100), (129, 71)):
                assert torch.equal(grads_of(fn, x[s:s + n], w, cot[s:s + n])[1], dx[s:s + n]), (op, n, s)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("out32", [False, True], ids=["out_bf16", "out_fp32"])
def test_vocab_width_rows_bitwise(log, out32):
    """A 151936-entry vocabulary row (Qwen3): each row of 6 alone, in pairs, reversed and from a
    strided view gives the batch's bits, forward and backward; values against fp64."""
    fn = rl_kernels.log_softmax if log else rl_kernels.softmax
    od = torch.float32 if out32 else None
    x = randn(6, VOCAB, dtype=torch.bfloat16, seed=48, scale=3.0)
    full = fn(x, dtype=od)
    for r in range(6):
        assert torch.equal(fn(x[r:r + 1], dtype=od), full[r:r + 1]), r
    assert torch.equal(fn(x[2:4], dtype=od), full[2:4])
    assert torch.equal(fn(x.flip(0), dtype=od), full.flip(0))
    assert torch.equal(fn(x[::2], dtype=od), full[::2])
    ref, d = ref_softmax(x, log)
    assert_within(full, ref, softmax_bound(d, ref, log, cpu_sum_steps(VOCAB), full.dtype), "vs fp64")
    # normwise: no worse than torch's own op on the same input (its fp32 result is off by ~5e-6
    # too: 9496 positive terms per lane), above a floor of 8 fp32 roundoffs
    theirs = (torch.log_softmax if log else torch.softmax)(x, -1, dtype=od)
    assert rel_err(full, ref) <= max(1.25 * rel_err(theirs, ref), 8 * unit_roundoff(torch.float32))
    cot = randn(6, VOCAB, seed=49).to(full.dtype)
    _, dx, _ = grads_of(lambda t, _: fn(t, dtype=od), x, None, cot)
    for r in (0, 5):
        assert torch.equal(grads_of(lambda t, _: fn(t, dtype=od), x[r:r + 1], None, cot[r:r + 1])[1],
                           dx[r:r + 1]), r
    _, rdx, _ = grads_of(lambda t, _: (torch.log_softmax if log else torch.softmax)(t, -1),
                         x.double(), None, cot.double())
    assert rel_err(dx, rdx) <= GRAD_TOL[torch.bfloat16]


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_other_dim_slices_bitwise(log):
    """softmax over dim 1 of [A, D, B]: slices along A, a single B column (strided), and the
    transposed tensor with the matching dim all give the full result's bits, forward and dx."""
    fn = rl_kernels.log_softmax if log else rl_kernels.softmax
    x = randn(33, 300, 5, dtype=torch.bfloat16, seed=50, scale=2.0)
    full = fn(x, 1)
    for a0, a1 in ((0, 1), (7, 8), (3, 20), (0, 33)):
        assert torch.equal(fn(x[a0:a1], 1), full[a0:a1])
    assert torch.equal(fn(x[:, :, 3:4], 1), full[:, :, 3:4])
    assert torch.equal(fn(x.transpose(0, 2), 1), full.transpose(0, 2))
    assert torch.equal(fn(x.permute(1, 2, 0), 0), full.permute(1, 2, 0))
    cot = randn(33, 300, 5, seed=51).to(torch.bfloat16)
    dx = grads_of(lambda t, _: fn(t, 1), x, None, cot)[1]
    assert torch.equal(grads_of(lambda t, _: fn(t, 1), x[4:9], None, cot[4:9])[1], dx[4:9])
    assert torch.equal(grads_of(lambda t, _: fn(t, -2), x[:, :, 2:3], None, cot[:, :, 2:3])[1], dx[:, :, 2:3])


def _all_outputs(x, w, cot):
    """Forward of every op, dx of the differentiable ones, and rms_norm's dweight (both modes)."""
    out = []
    for op, fn in INV_OPS.items():
        out.append(fn(x, w))
        if op in GRAD_INV_OPS:
            _, dx, dw = grads_of(fn, x, w, cot[op])
            out += [dx] + ([dw] if dw is not None else [])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_thread_counts_and_repeats_change_no_bit(dtype):
    """1, 2, 3 threads and the default, and three repeats: the same bits for every forward, dx and
    the RMSNorm weight gradient (a sum over 1000 rows: blocks of 16, added in a fixed order)."""
    x = randn(1000, 1000, dtype=dtype, seed=52, scale=2.0)
    w = randn(1000, dtype=dtype, seed=53)
    cot = {op: randn(*INV_OPS[op](x, w).shape, seed=54 + i).to(INV_OPS[op](x, w).dtype)
           for i, op in enumerate(GRAD_INV_OPS)}
    want = _all_outputs(x, w, cot)
    for threads in (1, 2, 3, 0):
        rl_kernels.set_num_threads(threads)
        for _ in range(2 if threads else 3):
            got = _all_outputs(x, w, cot)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{threads} threads"


def test_rms_norm_weight_gradient_deterministic_and_layout_free():
    """dweight over 4096 rows (not batch-invariant by design: a sum over the rows) is bitwise
    equal over repeats and thread counts, for x / the cotangent strided or contiguous, on the
    dispatcher op and through autograd, and within the fp64 error bound."""
    x = randn(4096, 512, dtype=torch.bfloat16, seed=60, scale=2.0)
    w = randn(512, dtype=torch.bfloat16, seed=61)
    cot = randn(4096, 512, dtype=torch.bfloat16, seed=62)
    fn = INV_OPS["rms_norm"]
    _, _, dw = grads_of(fn, x, w, cot)
    for threads in (1, 2, 0, 3):
        rl_kernels.set_num_threads(threads)
        assert torch.equal(grads_of(fn, x, w, cot)[2], dw), threads
    buf = torch.zeros(4096, 600, dtype=torch.bfloat16)
    buf[:, 50:562] = x
    assert torch.equal(grads_of(fn, buf[:, 50:562], w, cot.t().contiguous().t())[2], dw)
    _, rstd = torch.ops.rl_kernels.rms_norm(x, w, 1e-6, False, "auto")
    _, dw_op = torch.ops.rl_kernels.rms_norm_backward(x, w, rstd, cot, 1e-6, False, True, "auto")
    assert torch.equal(dw_op, dw)
    rdw = grads_of(GRAD_OPS["rms_norm"][1], x.double(), w.double(), cot.double())[2]
    assert rel_err(dw, rdw) <= GRAD_TOL[torch.bfloat16]


def test_grad_path_and_no_grad_path_agree():
    """The eager fast path (no autograd), the torch.library op (requires_grad, under no_grad, in
    inference_mode) and the nn.Module registry ops give the same bits."""
    x = randn(37, 300, dtype=torch.bfloat16, seed=63, scale=2.0)
    w = randn(300, dtype=torch.bfloat16, seed=64)
    for op in ("rms_norm", "softmax", "log_softmax", "row_sum", "row_mean"):
        fn = INV_OPS[op]
        eager = fn(x, w)
        xr, wr = leaves(x, w)
        assert torch.equal(fn(xr, wr).detach(), eager), op
        with torch.no_grad():
            assert torch.equal(fn(xr, wr), eager), op
        with torch.inference_mode():
            assert torch.equal(fn(x, w), eager), op
    mod = rl_kernels.get_op("rms_norm")
    assert torch.equal(mod(x, w, 1e-6), rl_kernels.rms_norm(x, w, 1e-6))
    assert torch.equal(rl_kernels.get_op("softmax", backend="cpu")(x, 0), rl_kernels.softmax(x, 0))
    assert torch.equal(rl_kernels.get_op("log_softmax")(x), rl_kernels.log_softmax(x))
    assert torch.equal(rl_kernels.get_op("row_sum")(x), rl_kernels.row_sum(x))
    assert torch.equal(rl_kernels.get_op("row_mean")(x, keepdim=True), rl_kernels.row_mean(x, keepdim=True))
    assert torch.equal(rl_kernels.softmax(x, backend="cpu"), rl_kernels.softmax(x))


# --------------------------------------------------------------------------------------------
# Edge cases (torch's semantics)
# --------------------------------------------------------------------------------------------

def assert_same_specials(got, want, ref=None, what=""):
    """NaN where torch's want is NaN, the same infinities and exact zeros; finite values within
    torch's own error against `ref` (the fp64 result of the same function, when given) plus 4 ulps
    (fp32 / fp64) or one ulp (16-bit) of want's dtype."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN positions"
    for special in (math.inf, -math.inf, 0.0):
        assert torch.equal(got == special, want == special), f"{what}: {special} positions"
    finite = torch.isfinite(want)
    tol = (1 if want.dtype in HALF else 4) * ulp(want[finite], want.dtype)
    if ref is not None:
        tol = tol + (want[finite].double() - ref[finite]).abs()
    assert_within(got[finite], want[finite].double(), tol, what)


SPECIAL_ROWS = [
    [0.0, -math.inf, 1.0, 2.0],  # a masked entry
    [-math.inf, -math.inf, 5.0, -math.inf],  # one finite entry: 1 / 0 exactly
    [math.inf, 0.0, 1.0, 2.0],  # +inf: inf - inf = NaN for the row
    [math.inf, math.inf, 0.0, 0.0],
    [math.nan, 0.0, 1.0, 2.0],  # NaN: the whole row
    [-math.inf] * 4,  # all -inf: NaN
    [0.0, 0.0, 0.0, 0.0],
    [-0.0, 0.0, -0.0, 0.0],
    [60000.0, -60000.0, 1.0, 0.0],  # exp underflows to 0 for the far entries
    [1.0, 1.0, 1.0, math.nan],
]


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS.get)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_inf_nan_rows_as_torch(dtype, log):
    """inf / -inf / NaN / all -inf / huge-range rows: NaN, inf and exact 0 where torch.softmax /
    torch.log_softmax on the CPU (same dtype) have them, finite values within an ulp or few;
    also at width 33 (past the 16 lanes: a masked causal row) and with dtype=torch.float32."""
    mine, theirs = (rl_kernels.log_softmax, torch.log_softmax) if log else (rl_kernels.softmax, torch.softmax)
    x = torch.tensor(SPECIAL_ROWS, dtype=torch.float64).to(dtype)
    assert_same_specials(mine(x), theirs(x, -1), theirs(x.double(), -1), "width 4")
    wide = randn(10, 33, dtype=dtype, seed=65, scale=2.0)
    for i, row in enumerate(SPECIAL_ROWS):
        wide[i, 3:7] = torch.tensor(row, dtype=torch.float64).to(dtype)
    causal = torch.triu(torch.ones(33, 33, dtype=torch.bool), 1)
    masked = randn(33, 33, dtype=dtype, seed=66).masked_fill(causal, -math.inf)
    for name, t in (("width 33", wide), ("causal mask", masked), ("dim 0", masked.t())):
        dim = 0 if name == "dim 0" else -1
        ref = theirs(t.double(), dim)
        assert_same_specials(mine(t, dim), theirs(t, dim), ref, name)
        if dtype in HALF:
            assert_same_specials(mine(t, dim, dtype=torch.float32), theirs(t, dim, dtype=torch.float32),
                                 ref, name + " out fp32")


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS.get)
def test_log_softmax_all_masked_and_single_entry_rows(dtype):
    """log_softmax: an all -inf row is NaN (torch), a row with one finite entry is exactly 0
    there and -inf elsewhere; softmax of the latter is exactly 1 and 0; gradients through the
    single-entry row are 0 at the masked entries (as torch)."""
    x = torch.full((3, 40), -math.inf, dtype=dtype)
    x[1, 17] = 3.0
    x[2, 39] = -2.5
    ls, sm = rl_kernels.log_softmax(x), rl_kernels.softmax(x)
    assert torch.isnan(ls[0]).all() and torch.isnan(sm[0]).all()
    for r, j in ((1, 17), (2, 39)):
        want = torch.full((40,), -math.inf, dtype=dtype)
        want[j] = 0.0
        assert torch.equal(ls[r], want)
        assert torch.equal(sm[r], want.exp())
    xl = leaves(x[1:])[0]
    cot = randn(2, 40, dtype=dtype, seed=67)
    (dx,) = torch.autograd.grad(rl_kernels.softmax(xl), xl, cot)
    assert torch.equal(dx, torch.zeros_like(dx))  # y is one-hot: y * (dy - dy_j) = 0 everywhere
    (dx,) = torch.autograd.grad(rl_kernels.log_softmax(xl), xl, cot)  # dy - exp(y) * sum(dy)
    xt = leaves(x[1:])[0]
    (tdx,) = torch.autograd.grad(torch.log_softmax(xt, -1), xt, cot)
    assert torch.equal(torch.isfinite(dx), torch.isfinite(tdx))
    # dy - exp(y) * sum(dy): the cancellation leaves errors relative to |dy| + |sum(dy)|
    scale = cot.double().abs() + cot.double().sum(-1, keepdim=True).abs()
    tol = 8 * unit_roundoff(compute_dtype(dtype)) * scale + out_rounding(tdx.double(), 0, dtype) * 2
    assert_within(dx, tdx.double(), tol, "log_softmax dx vs torch")


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS.get)
def test_rms_norm_and_row_sum_special_values_as_torch(dtype):
    """inf, NaN, zero rows, -0, squares that overflow or underflow in fp32, eps 0 with a zero row:
    rms_norm as F.rms_norm on the CPU (inf -> NaN at that element, 0 elsewhere; NaN row -> NaN;
    zero row -> 0, or NaN with eps 0), row_sum / row_mean as x.sum(-1) / x.mean(-1)."""
    big = 6e4 if dtype == torch.float16 else 1e30
    tiny = 1e-7 if dtype == torch.float16 else 1e-30
    rows = [[big, 1.0, -2.0, 0.5], [tiny, 0.0, tiny, -tiny], [0.0] * 4, [math.inf, 1.0, 2.0, 3.0],
            [-math.inf, math.inf, 1.0, 1.0], [math.nan, 1.0, 2.0, 3.0], [-0.0] * 4, [1.0, -1.0, 2.0, -2.0]]
    x = torch.tensor(rows, dtype=torch.float64).to(dtype)
    w = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64).to(dtype)
    for eps in (2.0 ** -20, 0.0):  # exact in fp32 (fp64 eps rounding: test_fp64_rms_norm_adds_eps_in_fp64)
        assert_same_specials(rl_kernels.rms_norm(x, w, eps), F.rms_norm(x, (4,), w, eps),
                             what=f"rms_norm eps {eps}")
        assert_same_specials(rl_kernels.rms_norm(x, None, eps), F.rms_norm(x, (4,), None, eps),
                             what=f"rms_norm no weight eps {eps}")
    assert_same_specials(rl_kernels.row_sum(x), x.sum(-1), what="row_sum")
    assert_same_specials(rl_kernels.row_mean(x), x.mean(-1), what="row_mean")
    # a sum of -0s is +0 (sums start from +0), as torch's
    assert not torch.signbit(rl_kernels.row_sum(x[6:7])).any()
    assert torch.equal(torch.signbit(rl_kernels.row_sum(x[6:7])), torch.signbit(x[6:7].sum(-1)))


def test_fp16_sum_overflows_like_torch():
    """fp16 sum of 151936 ones: inf in fp16 (as torch), 151936 with dtype=torch.float32; the mean
    is 1 either way (the fp32 sum is divided before the rounding)."""
    x = torch.ones(2, VOCAB, dtype=torch.float16)
    assert torch.equal(rl_kernels.row_sum(x), x.sum(-1))
    assert torch.isinf(rl_kernels.row_sum(x)).all()
    assert torch.equal(rl_kernels.row_sum(x, dtype=torch.float32), torch.full((2,), float(VOCAB)))
    assert torch.equal(rl_kernels.row_mean(x), x.mean(-1))
    assert torch.equal(rl_kernels.row_mean(x), torch.ones(2, dtype=torch.float16))


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS.get)
def test_zero_rows(dtype):
    """0 rows ([0, D] and [2, 0, D]): empty outputs of torch's shapes and dtypes; the backward
    gives an empty dx and a zero weight gradient (a sum over no rows)."""
    for shape in ((0, 300), (2, 0, 300)):
        x = torch.empty(shape, dtype=dtype)
        w = randn(300, dtype=dtype, seed=68)
        assert rl_kernels.rms_norm(x, w).shape == shape
        assert rl_kernels.softmax(x).shape == shape and rl_kernels.log_softmax(x).shape == shape
        assert rl_kernels.row_sum(x).shape == shape[:-1]
        assert rl_kernels.row_mean(x, keepdim=True).shape == (*shape[:-1], 1)
        if dtype in HALF:
            assert rl_kernels.softmax(x, dtype=torch.float32).dtype == torch.float32
        for rbw in (False, True):
            y, dx, dw = grads_of(lambda x, w: rl_kernels.rms_norm(x, w, round_before_weight=rbw), x, w,
                                 torch.empty(shape, dtype=dtype))
            assert dx.shape == shape and torch.equal(dw, torch.zeros(300, dtype=dtype))
        for fn in (rl_kernels.softmax, rl_kernels.log_softmax):
            assert grads_of(lambda x, _: fn(x), x, None, torch.empty(shape))[1].shape == shape
    # a softmax over dim 0 of [3, 0]: rows of 3, none of them
    assert rl_kernels.softmax(torch.empty(3, 0, dtype=dtype), dim=0).shape == (3, 0)


@pytest.mark.parametrize("case", ["softmax", "log_softmax", "softmax_dim0", "rms_norm", "row_sum",
                                  "row_mean"])
def test_width_zero_rows_as_torch(case):
    x = torch.empty(3, 0)
    mine, want = {
        "softmax": (lambda: rl_kernels.softmax(x), lambda: torch.softmax(x, -1)),
        "log_softmax": (lambda: rl_kernels.log_softmax(x), lambda: torch.log_softmax(x, -1)),
        "softmax_dim0": (lambda: rl_kernels.softmax(x.t(), 0), lambda: torch.softmax(x.t(), 0)),
        "rms_norm": (lambda: rl_kernels.rms_norm(x), lambda: F.rms_norm(x, (0,))),
        "row_sum": (lambda: rl_kernels.row_sum(x), lambda: x.sum(-1)),
        "row_mean": (lambda: rl_kernels.row_mean(x), lambda: x.mean(-1)),
    }[case]
    got, ref = mine(), want()
    assert got.shape == ref.shape and torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(got.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS.get)
def test_width_one(dtype):
    """Width 1: softmax exactly 1, log_softmax exactly 0 (finite x) with zero gradients; row_sum
    and row_mean are x; rms_norm is x / sqrt(x^2 + eps) (within the fp64 bound) and its dx is
    eps-scaled (vs fp64 autograd); 0-d x is one row of one."""
    x = randn(50, 1, dtype=dtype, seed=69, scale=3.0)
    assert torch.equal(rl_kernels.softmax(x), torch.ones_like(x))
    assert torch.equal(rl_kernels.log_softmax(x), torch.zeros_like(x))
    assert torch.equal(rl_kernels.row_sum(x), x[:, 0]) and torch.equal(rl_kernels.row_mean(x), x[:, 0])
    cot = randn(50, 1, dtype=dtype, seed=70)
    for fn in (rl_kernels.softmax, rl_kernels.log_softmax):
        dx = grads_of(lambda t, _: fn(t), x, None, cot)[1]
        assert torch.equal(dx, torch.zeros_like(dx))
    eps = 0.25  # exact in fp32: x / sqrt(x^2 + 1/4)
    ref = x.double() / torch.sqrt(x.double() ** 2 + eps)
    tol = 8 * unit_roundoff(compute_dtype(dtype)) * ref.abs()
    assert_within(rl_kernels.rms_norm(x, None, eps), ref, tol + out_rounding(ref, tol, dtype), "rms_norm width 1")
    dx = grads_of(lambda t, _: rl_kernels.rms_norm(t, None, eps), x, None, cot)[1]
    rdx = grads_of(lambda t, _: F.rms_norm(t, (1,), None, eps), x.double(), None, cot.double())[1]
    assert rel_err(dx, rdx) <= (1e-13 if dtype == torch.float64 else GRAD_TOL[dtype])
    s = torch.tensor(2.5, dtype=dtype)
    assert torch.equal(rl_kernels.softmax(s), torch.softmax(s, 0))
    assert torch.equal(rl_kernels.log_softmax(s), torch.log_softmax(s, 0))
    assert torch.equal(rl_kernels.row_sum(s), s) and torch.equal(rl_kernels.row_mean(s), s)


# --------------------------------------------------------------------------------------------
# torch.library and torch.compile
# --------------------------------------------------------------------------------------------

def _opcheck_cases():
    x32 = leaves(randn(5, 33, seed=71))[0]
    w32 = leaves(randn(33, seed=72))[0]
    xb = leaves(randn(2, 3, 17, dtype=torch.bfloat16, seed=73).view(6, 17))[0]
    wb = leaves(randn(17, dtype=torch.bfloat16, seed=74))[0]
    x64 = leaves(randn(4, 9, dtype=torch.float64, seed=75))[0]
    ops = torch.ops.rl_kernels
    cases = [
        (ops.rms_norm.default, (x32, w32, 1e-6, False, "auto")),
        (ops.rms_norm.default, (xb, wb, 1e-5, True, "auto")),
        (ops.rms_norm.default, (x32, None, 1e-6, False, "cpu")),
        (ops.rms_norm.default, (x64, None, 0.1, True, "auto")),
        (ops.softmax.default, (x32, torch.float32, False, "auto")),
        (ops.softmax.default, (xb, torch.float32, True, "auto")),
        (ops.softmax.default, (xb, torch.bfloat16, False, "auto")),
        (ops.softmax.default, (x64, torch.float64, True, "auto")),
        (ops.row_sum.default, (x32, torch.float32, False, "auto")),
        (ops.row_sum.default, (xb, torch.float32, True, "auto")),
        (ops.row_sum.default, (xb, torch.bfloat16, False, "auto")),
    ]
    with torch.no_grad():
        _, rstd = ops.rms_norm(xb, wb, 1e-5, True, "auto")
        y = ops.softmax(xb, torch.float32, True, "auto")
        yb = ops.softmax(xb, torch.bfloat16, False, "auto")
    dyb = randn(6, 17, dtype=torch.bfloat16, seed=76)
    cases += [
        (ops.rms_norm_backward.default, (xb.detach(), wb.detach(), rstd, dyb, 1e-5, True, True, "auto")),
        (ops.rms_norm_backward.default, (xb.detach(), None, rstd, dyb, 1e-5, False, False, "auto")),
        (ops.softmax_backward.default, (y, randn(6, 17, seed=77), torch.bfloat16, True, "auto")),
        (ops.softmax_backward.default, (yb, dyb, torch.bfloat16, False, "auto")),
    ]
    return cases


OPCHECK_IDS = ["rms_norm-fp32", "rms_norm-bf16-rbw", "rms_norm-no_weight-cpu", "rms_norm-fp64",
               "softmax-fp32", "log_softmax-bf16-out_fp32", "softmax-bf16", "log_softmax-fp64",
               "row_sum-fp32", "row_mean-bf16-out_fp32", "row_sum-bf16", "rms_norm_backward-bf16",
               "rms_norm_backward-no_dweight", "log_softmax_backward-bf16", "softmax_backward-bf16"]


@pytest.mark.parametrize("case", range(len(OPCHECK_IDS)), ids=OPCHECK_IDS)
def test_opcheck(case):
    """torch.library.opcheck (schema, fake tensors, autograd registration, aot dispatch) of every
    row op in the rl_kernels namespace, forward and backward."""
    cases = _opcheck_cases()
    assert len(cases) == len(OPCHECK_IDS)
    op, args = cases[case]
    torch.library.opcheck(op, args)


def _model(x, w):
    """What a trainer compiles: norm, a projection-free softmax over heads (dim 1), log-probs and
    row statistics, returning the ops' own outputs (no torch reductions that inductor could
    reorder)."""
    h = rl_kernels.rms_norm(x, w, 1e-6)
    hq = rl_kernels.rms_norm(x, w, 1e-6, round_before_weight=True)
    p = rl_kernels.softmax(h.view(h.shape[0], 4, -1), dim=1)
    lp = rl_kernels.log_softmax(hq, dtype=torch.float32)
    return h, hq, p, lp, rl_kernels.row_sum(h, dtype=torch.float32), rl_kernels.row_mean(x, keepdim=True)


def _outputs_and_grads(fn, x, w, seed):
    x, w = leaves(x, w)
    outs = fn(x, w)
    cots = [randn(*o.shape, seed=seed + i).to(o.dtype) for i, o in enumerate(outs)]
    grads = torch.autograd.grad(outs, (x, w), cots)
    return [o.detach() for o in outs] + list(grads)


def test_compile_fullgraph_aot_eager_equals_eager():
    """torch.compile(fullgraph=True, dynamic=True) of _model over two row counts: every output,
    dx and dweight bitwise the eager ones."""
    compiled = torch.compile(_model, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (7, 20):
        x = randn(rows, 64, dtype=torch.bfloat16, seed=80 + rows, scale=2.0)
        w = randn(64, dtype=torch.bfloat16, seed=81)
        got = _outputs_and_grads(compiled, x, w, 90)
        want = _outputs_and_grads(_model, x, w, 90)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), rows


def _chain(x, w):
    """Each tensor used once: inductor sums the gradient contributions of a tensor used several
    times in one fused fp32 kernel (eager adds bf16 gradients), which is torch's business, not the
    row ops'."""
    h = rl_kernels.rms_norm(x, w, 1e-6, round_before_weight=True)
    p = rl_kernels.softmax(h.view(h.shape[0], 4, -1), dim=1)
    lp = rl_kernels.log_softmax(p.reshape(h.shape), dtype=torch.float32)
    return (rl_kernels.row_mean(lp, keepdim=True),)


def test_compile_fullgraph_inductor_equals_eager():
    """The default backend (inductor) around the ops: the output, dx and dweight bitwise eager's."""
    compiled = torch.compile(_chain, fullgraph=True)
    x = randn(9, 64, dtype=torch.bfloat16, seed=82, scale=2.0)
    w = randn(64, dtype=torch.bfloat16, seed=83)
    got = _outputs_and_grads(compiled, x, w, 95)
    want = _outputs_and_grads(_chain, x, w, 95)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# --------------------------------------------------------------------------------------------
# GPU (CUDA backends; skipped without CUDA)
# --------------------------------------------------------------------------------------------

def _gpu_usable(backend):
    return HAS_CUDA and kernel_registry.backend_status("softmax", backend)[0]


GPU_BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not _gpu_usable(b), reason=f"{b} not usable"))
                for b in ("sm90", "sm80")]
GPU_ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256,
                  257, 511, 512, 513, 1000, 1023, 1024, 1025, 2047, 2048, 2049, 3000, 4095, 4096]


def cuda_randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)


def _gpu_ops(backend):
    return {
        "rms_norm": lambda x, w: rl_kernels.rms_norm(x, w, 1e-6, backend=backend),
        "rms_norm_rbw": lambda x, w: rl_kernels.rms_norm(x, w, 1e-6, round_before_weight=True, backend=backend),
        "softmax": lambda x, w: rl_kernels.softmax(x, backend=backend),
        "softmax_out_fp32": lambda x, w: rl_kernels.softmax(x, dtype=torch.float32, backend=backend),
        "log_softmax": lambda x, w: rl_kernels.log_softmax(x, backend=backend),
        "log_softmax_out_fp32": lambda x, w: rl_kernels.log_softmax(x, dtype=torch.float32, backend=backend),
        "row_sum": lambda x, w: rl_kernels.row_sum(x, backend=backend),
        "row_sum_out_fp32": lambda x, w: rl_kernels.row_sum(x, dtype=torch.float32, backend=backend),
        "row_mean": lambda x, w: rl_kernels.row_mean(x, keepdim=True, backend=backend),
    }


GPU_OP_NAMES = list(_gpu_ops("sm80"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("width", [HIDDEN, VOCAB])
@pytest.mark.parametrize("op", GPU_OP_NAMES)
def test_gpu_rows_bitwise_over_row_counts(backend, width, op):
    """bf16 rows at width 4096 (register plan) and 151936 (loop plan) on CUDA: a batch of 4096
    rows equals batches of 1..4096 rows taken at the start, the end and an odd offset, a permuted
    batch, and a misaligned strided copy (element loads instead of 16-byte loads)."""
    fn = _gpu_ops(backend)[op]
    x = cuda_randn(4096, width, seed=100 + width, scale=2.0)
    w = cuda_randn(width, seed=101)
    full = fn(x, w)
    for n in GPU_ROW_COUNTS:
        for s in _starts(n, 4096):
            assert torch.equal(fn(x[s:s + n], w), full[s:s + n]), f"{n} rows at {s}"
    perm = torch.randperm(4096, generator=torch.Generator().manual_seed(102))[:513].cuda()
    assert torch.equal(fn(x[perm], w), full[perm])
    rows = 64  # a copy of 64 rows at a 2-byte offset with an odd row stride: element loads
    buf = torch.zeros(rows, width + 1, dtype=x.dtype, device="cuda")
    buf[:, 1:] = x[:rows]
    assert torch.equal(fn(buf[:, 1:], w), full[:rows])
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("width", [HIDDEN, VOCAB])
@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_rbw", "softmax", "log_softmax_out_fp32"])
def test_gpu_backward_rows_bitwise_and_dweight_deterministic(backend, width, op):
    """dx rows of a batch equal those of sub-batches (random cotangent); the RMSNorm weight
    gradient is bitwise equal over repeats and on a side stream."""
    fn = _gpu_ops(backend)[op]
    total = 1024 if width == HIDDEN else 64
    x = cuda_randn(total, width, seed=110, scale=2.0)
    w = cuda_randn(width, seed=111)
    y0 = fn(x, w)
    cot = cuda_randn(*y0.shape, dtype=y0.dtype, seed=112)
    y, dx, dw = grads_of(fn, x, w, cot)
    assert torch.equal(y, y0)
    for n in (1, 2, 3, 17, 63, total - 1, total):
        for s in _starts(n, total):
            assert torch.equal(grads_of(fn, x[s:s + n], w, cot[s:s + n])[1], dx[s:s + n]), f"{n} at {s}"
    if dw is not None:
        for _ in range(3):
            assert torch.equal(grads_of(fn, x, w, cot)[2], dw)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = grads_of(fn, x, w, cot)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        assert torch.equal(on_side[1], dx) and torch.equal(on_side[2], dw)


def _any_order_bound(op, x, ref):
    """The CPU tests' fp32 error bounds with the sum's steps for any order (n - 1 roundings on a
    path): the CUDA plans order the sums differently, never worse than that."""
    u, n = unit_roundoff(torch.float32), x.shape[-1]
    if op == "rms_norm":
        return ((n + 3) / 2 + 4) * u * ref.abs() * 1.01
    d = x.double() - x.double().amax(-1, keepdim=True)
    return softmax_bound(d, ref, op.startswith("log"), n, torch.float32)


def _max_ulps(got, ref, dtype):
    finite = torch.isfinite(ref)
    return ((got.double() - ref).abs()[finite] / ulp(ref[finite], dtype)).max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype,op", [pytest.param(d, o, id=f"{IDS[d]}-{o}")
                                      for d in (torch.bfloat16, torch.float16, torch.float32)
                                      for o in ("rms_norm", "softmax", "softmax_out_fp32", "log_softmax",
                                                "row_sum")
                                      if d in HALF or o != "softmax_out_fp32"])
@pytest.mark.parametrize("width", [1, 7, 33, 1000, HIDDEN, 4097, VOCAB])
def test_gpu_accuracy_vs_fp64_and_torch(backend, dtype, op, width):
    """Against fp64 of the same inputs on the GPU: 16-bit outputs within one ulp elementwise (half
    an ulp of rounding, fp32 error far below the other half); every output no worse than torch's
    CUDA op on the same inputs (x2, above a floor of 4 fp32 roundoffs), normwise and elementwise;
    the dx of a random cotangent likewise against fp64 autograd."""
    rows = 8 if width == VOCAB else 64
    x = cuda_randn(rows, width, dtype=dtype, seed=120 + width, scale=2.0)
    w = cuda_randn(width, dtype=dtype, seed=121)
    fn = _gpu_ops(backend)[op]
    torch_fn, ref_fn = {
        "rms_norm": (lambda x, w: F.rms_norm(x, (width,), w, 1e-6), lambda x, w: F.rms_norm(x, (width,), w, 1e-6)),
        "softmax": (lambda x, w: torch.softmax(x, -1), lambda x, w: torch.softmax(x, -1)),
        "softmax_out_fp32": (lambda x, w: torch.softmax(x, -1, dtype=torch.float32),
                             lambda x, w: torch.softmax(x, -1)),
        "log_softmax": (lambda x, w: torch.log_softmax(x, -1), lambda x, w: torch.log_softmax(x, -1)),
        "row_sum": (lambda x, w: x.sum(-1), lambda x, w: x.sum(-1)),
    }[op]
    wa = w if op == "rms_norm" else None
    y = fn(x, w)
    ref = ref_fn(x.double(), None if wa is None else wa.double())
    theirs = torch_fn(x, wa)
    assert y.dtype == theirs.dtype and y.shape == theirs.shape
    if op == "row_sum":  # cancellation: bounded by (n - 1) u sum|x| in any order, + the rounding
        err = width * unit_roundoff(torch.float32) * x.double().abs().sum(-1)
        assert_within(y, ref, err + out_rounding(ref, err, y.dtype), "row_sum")
    else:
        floor = 4 * unit_roundoff(torch.float32)
        assert rel_err(y, ref) <= max(2 * rel_err(theirs, ref), floor), "normwise"
        if y.dtype in HALF:
            assert _max_ulps(y, ref, y.dtype) <= 1.0, "16-bit output within one ulp of fp64"
        else:
            assert_within(y, ref, _any_order_bound(op, x, ref), "fp32 output")
    if op != "row_sum":
        cot = cuda_randn(*y.shape, dtype=y.dtype, seed=122)
        dx = grads_of(fn, x, wa, cot)[1]
        tdx = grads_of(lambda t, v: torch_fn(t, v), x, wa, cot)[1]
        rdx = grads_of(lambda t, v: ref_fn(t, v), x.double(), None if wa is None else wa.double(),
                       cot.double())[1]
        assert rel_err(dx, rdx) <= max(2 * rel_err(tdx, rdx), GRAD_TOL[dtype]), "dx"


@pytest.mark.gpu
def test_gpu_sm90_and_sm80_give_the_same_bits():
    """The sm90 backend runs the sm80 row kernels: the same bits for every op (when both run)."""
    if not (_gpu_usable("sm90") and _gpu_usable("sm80")):
        pytest.skip("needs an sm90 device")
    x = cuda_randn(300, HIDDEN, seed=130, scale=2.0)
    w = cuda_randn(HIDDEN, seed=131)
    a, b = _gpu_ops("sm90"), _gpu_ops("sm80")
    for op in GPU_OP_NAMES:
        assert torch.equal(a[op](x, w), b[op](x, w)), op
