"""Small GPU problems that touch every kernel once (all GEMM backends and layouts, tails, the fp32
path, linear_logp forward, dz and backward, attention prefill / split-KV decode / backward, the row
ops forward and backward): run under compute-sanitizer by gpu_check.sh."""

import torch

import rl_kernels
from rl_kernels import kernel_registry


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=gen, device="cuda").to(dtype)

    backends = [b for b in ("sm90", "sm80") if kernel_registry.backend_status("det_gemm", b)[0]]
    for backend in backends:
        # (5, 1160, 40), (100, 1160, 300): sm90 decode stages of 16 (8-row A slots) and 4 k-slices, then
        # the 19 k-slices' one-slice remainder; M = 100 as two one-consumer row tiles
        for m, k, n in ((1, 64, 72), (70, 136, 200), (130, 33, 17), (64, 0, 8), (5, 1160, 40), (100, 1160, 300)):
            a, w = randn(m, k), randn(n, k)
            rl_kernels.det_gemm(a, w.t(), backend=backend)
            rl_kernels.det_gemm(a, w.t().contiguous(), out_dtype=torch.float32, backend=backend)
            rl_kernels.matmul(a.t().contiguous().t(), w.t(), backend=backend)
            rl_kernels.addmm(randn(n), a, w.t(), beta=0.5, backend=backend)
        # sm90's 192-wide tiles (M = 2100, N = 1024: one wave), bf16 out (3 store rounds a tile) and fp32
        # out (6), A K-major and MN-major
        a, w = randn(2100, 128), randn(1024, 128)
        rl_kernels.det_gemm(a, w.t(), backend=backend)
        rl_kernels.det_gemm(a.t().contiguous().t(), w.t(), out_dtype=torch.float32, backend=backend)
        # sm90's swapped operands at a layer shape: M = 395 as 4 tiles of 112 columns, the last holding 59 rows
        rl_kernels.det_gemm(randn(395, 256), randn(4096, 256).t(), backend=backend)
        # K >= 65536 (sm90 K chains): a tile's chains spread over CTAs (M = 200), and run in turn (M = 1)
        w = randn(300, 65600)
        for m in (200, 1):
            rl_kernels.det_gemm(randn(m, 65600), w.t(), backend=backend)
        # the same chains on swapped operands (sm90: G W with W MN-major, as the LM head's dX): 2 tiles of 160
        rl_kernels.det_gemm(randn(304, 65600), randn(65600, 2048), backend=backend)
    rl_kernels.matmul(randn(33, 45, dtype=torch.float32), randn(45, 19, dtype=torch.float32))  # 64 x 64 tiles
    big_a, big_b = randn(1100, 37, dtype=torch.float32), randn(2100, 37, dtype=torch.float32)  # 128 x 128
    rl_kernels.matmul(big_a, big_b.t())
    rl_kernels.matmul(big_a.t().contiguous().t(), big_b.t().contiguous())
    if kernel_registry.backend_status("linear_logp", "sm80")[0]:
        h = randn(37, 72).requires_grad_()
        w = randn(5003, 72).requires_grad_()
        t = torch.randint(0, 5003, (37,), device="cuda", generator=gen)
        t[3] = -100
        logp, ent = rl_kernels.linear_logp(h, w, t, temperature=0.7, return_entropy=True)
        (logp.sum() + ent.sum()).backward()
        # the backward's dH at 1024 rows x D = 5120 over a 16384-column chunk: 160 tiles of 128 x 256,
        # which sm90 runs stream-K in the backward's GEMM scratch memory; its forward's 88 units (22
        # splits x 4 row-tile pairs) share their last ones' tiles between clusters (row states handed over)
        h, w = randn(1024, 5120).requires_grad_(), randn(16484, 5120).requires_grad_()
        t = torch.randint(0, 16484, (1024,), device="cuda", generator=gen)
        torch.autograd.grad(rl_kernels.linear_logp(h, w, t), (h, w), randn(1024, dtype=torch.float32))
        # fp32 with a bias: sm90 folds the PARTS product of bf16 planes of K = D + 1 = 37 columns (rows
        # of 40; K not a multiple of 64), the bias's parts in the planes' last column
        h, w, b = randn(300, 36, dtype=torch.float32), randn(9000, 36, dtype=torch.float32), randn(9000, dtype=torch.float32)
        t = torch.randint(0, 9000, (300,), device="cuda", generator=gen)
        rl_kernels.linear_logp(h, w, t, b, return_entropy=True)
        # and its backward on bf16 planes (sm90): D = 36 (rows of 40 in the planes), 300 rows, one
        # vocabulary chunk of 9000 columns (a partial last tile of 192 and of 128), stream-K by chains
        h, w, b = (x.requires_grad_() for x in (h, w, b))
        logp, ent = rl_kernels.linear_logp(h, w, t, b, return_entropy=True)
        torch.autograd.grad((logp, ent), (h, w, b), (randn(300, dtype=torch.float32), randn(300, dtype=torch.float32)))
    if kernel_registry.backend_status("attention", "sm80")[0]:
        q = randn(2, 70, 4, 64).requires_grad_()
        k, v = randn(2, 70, 2, 64).requires_grad_(), randn(2, 70, 2, 64).requires_grad_()
        rl_kernels.attention(q, k, v).sum().backward()  # prefill schedule + backward
        # more tiles than SMs (the sm90 prefill CTAs take several each), ragged: some tiles empty
        cu = torch.tensor([0, 300, 310, 900], dtype=torch.int32, device="cuda")
        rl_kernels.attention(randn(900, 48, 64), randn(900, 8, 64), randn(900, 8, 64), cu_seqlens_q=cu,
                             cu_seqlens_k=cu, max_seqlen_q=590, max_seqlen_k=590)
        cache_k, cache_v = randn(2, 600, 2, 64), randn(2, 600, 2, 64)
        lengths = torch.tensor([530, 17], dtype=torch.int32, device="cuda")
        rl_kernels.attention_with_kvcache(randn(2, 1, 4, 64), cache_k, cache_v, lengths,
                                          k_new=randn(2, 1, 2, 64), v_new=randn(2, 1, 2, 64))
        # a chunk of 5 queries x 2 heads: split tiles of 10 rows (sm90: two rows per thread; decode's
        # 2 rows above: one)
        rl_kernels.attention_with_kvcache(randn(2, 5, 4, 64), cache_k, cache_v, lengths)
        # 9 segments: more than the sm90 split kernel merges in its clusters, so the combine kernel runs
        rl_kernels.attention_with_kvcache(randn(1, 1, 4, 64), randn(1, 4200, 2, 64), randn(1, 4200, 2, 64), 4150)
        # 18 segments and 1 in one call: the combine kernel's rows in two chunks of links, and rows of
        # different lengths in one warp (D = 64: two rows a warp)
        lengths = torch.tensor([8999, 300], dtype=torch.int32, device="cuda")
        for d in (128, 64):
            rl_kernels.attention_with_kvcache(randn(2, 3, 4, d), randn(2, 9000, 2, d), randn(2, 9000, 2, d), lengths)
    if kernel_registry.backend_status("rms_norm", "sm80")[0]:
        x, w = randn(37, 300).requires_grad_(), randn(300).requires_grad_()
        rl_kernels.rms_norm(x, w).sum().backward()
        for op in (rl_kernels.softmax, rl_kernels.log_softmax):
            y = op(randn(5, 5000).requires_grad_())
            y.backward(torch.ones_like(y))
        rl_kernels.row_mean(randn(9, 4097))
    torch.cuda.synchronize()
    print("sanitizer cases done")


if __name__ == "__main__":
    main()
