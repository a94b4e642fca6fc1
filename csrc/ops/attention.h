/* ops/attention.h: the contract of the prefill/decode-invariant attention
 * (docs/operators/attention.md explains the contract and the block / segment structure).
 *
 * Sequences b = 0 .. batch-1. Sequence b has q_len[b] query rows and k_len[b] keys/values. Query i
 * (0 <= i < q_len[b]) of sequence b sits at key position pos = k_len[b] - q_len[b] + i (causal
 * masking is aligned bottom-right, as in flash-attention and a KV-cache decode step) and sees keys
 * 0 .. L-1 with L = causal ? min(pos + 1, k_len[b]) : k_len[b]. Positions count from the sequence's
 * first real key, so padding or packing never moves a block boundary. GQA: query head h reads
 * key/value head h / (heads_q / heads_kv).
 *
 * Addressing (strides in elements; head_dim is contiguous):
 *   query i, head h of sequence b:  q + b * q.batch_stride + (q_start[b] + i) * q.row_stride + h * q.head_stride
 *   key j,   head g of sequence b:  k + b * k.batch_stride + (k_start[b] + j) * k.row_stride + g * k.head_stride
 * and so on for v (as k), out, dout, dq (as q), dk, dv (as k); lse (fp32) as q with its own strides.
 * Packed varlen batches use batch_stride 0 and q_start / k_start = cu_seqlens[b]; a padded batch
 * [B, T, H, d] uses the batch stride and the first real row as start; a KV cache [B, Tmax, Hkv, d]
 * uses k_start = 0 and k_len = the cached length (new keys already appended).
 * No range array: any of q_start, q_len, k_start, k_len may be null, meaning q_start[b] = 0,
 * q_len[b] = max_q_len, k_start[b] = 0, k_len[b] = max_k_len for every b. A [B, T, H, d] batch
 * without padding needs no range array, a KV-cache decode step only k_len: a caller builds no small
 * tensors (and launches no kernels to fill them) for ranges it does not have.
 * Rows and keys outside a sequence's ranges are neither read nor written. Every row inside one is
 * written by the forward, a row that sees no key included (out = 0, lse = -inf, below), so with
 * q_start and q_len null and max_q_len = q_rows every row of out and lse is written and the caller
 * need not initialize them (also when a key range is out of bounds: see Ranges below).
 *
 * Per query row and head, every backend computes (c = softmax_scale * log2(e), fp32 throughout):
 *   keys 0 .. L-1 are cut into SEGMENTs of RLK_ATTENTION_SEGMENT keys at absolute positions
 *   0, SEGMENT, 2 SEGMENT, ...; each segment into blocks of B keys, B fixed per backend:
 *   RLK_ATTENTION_BLOCK_N (64) on the CPU and sm80, 128 on sm90 (sm90/attention.cu, FWD_KEYS).
 *   A softmax state is (m, ms, l, acc[head_dim]): the reference max m, ms = its scaled value, the
 *   running sum l and the unnormalized output acc. scaled(m) = (m == -inf) ? 0 : round(m * c).
 *   Per segment, from the empty state (m = -inf, ms = 0, l = 0, acc = 0), per block in increasing
 *   order:
 *     s_j    = q . k_j                  (keys >= L: s_j = -inf)
 *     mb     = max(m, max_j s_j)
 *     m'     = (m == -inf || scaled(mb) > ms + T) ? mb : m;   ms' = scaled(m')
 *     alpha  = (m == -inf) ? 0 : exp2(ms - ms')        (exactly 1 when m did not move)
 *     p_j    = exp2(fma(s_j, c, -ms'))                  (0 for s_j = -inf; at most ~2^T)
 *     l'     = alpha * l + sum_j p_j                    (p_j in fp32)
 *     acc'   = alpha * acc + sum_j round_dtype(p_j) * v_j
 *   T = RLK_ATTENTION_RESCALE_THRESHOLD (ms + T rounded to fp32): m is a reference point, not
 *   necessarily the max; it moves only when a score beats it by more than 2^T in p units, so
 *   after a segment's first block alpha is almost always 1 and the rescale of acc is skipped.
 *   The segments' states are merged in increasing order into a row state (M, MS, Lsum, O) that
 *   starts empty: M' = max(M, m_g) (no threshold), a = (M == -inf) ? 0 : exp2(MS - MS'),
 *   b = (m_g == -inf) ? 0 : exp2(ms_g - MS'), Lsum' = a Lsum + b l_g, O' = a O + b acc_g. Finally
 *   out = round_dtype(O * (1 / Lsum)) and lse = (MS + log2(Lsum)) * ln(2) (natural log units).
 *   A row with L == 0 gets out = 0, lse = -inf.
 *   The order of every sum inside a block and of the q . k products is the backend's, fixed; the
 *   merge, the block update and the final normalization are each one shared function per backend
 *   with explicitly rounded operations, so the two ways of scheduling below give the same bits.
 * A kernel may compute the segments of a row one after the other (prefill) or in parallel with the
 * merge in a second kernel (split-KV decode): the arithmetic, including the order of every sum
 * inside a block, is the same, so a row's bits do not depend on how many rows, sequences or queries
 * the call has, nor on the schedule. Every order depends on head_dim, the key position and the
 * backend only. Different backends are each invariant but not bitwise equal to each other.
 *
 * Backward (entry attention_bwd): dq, dk, dv from q, k, v, out, lse, dout, with
 *   D_i = sum_d dout_i out_i, P = exp(s * scale - lse), dV = P^T dO, dP = dO V^T,
 *   dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q (GQA: summed over the group's query heads
 *   in increasing head order). Deterministic: fixed orders, no atomics; bitwise equal run to run.
 *
 * dtype: q, k, v, out, dout, dq, dk, dv share it: bf16 / fp16 on CUDA, also fp32 and fp64 on the CPU
 * (fp64 computed in double, lse then fp64 too: for gradcheck). lse is fp32 otherwise.
 * Ranges: the per-sequence starts and lengths live in device memory, so the binding cannot check them
 * without a sync. A launcher checks them (0 <= len <= max_len, 0 <= start, start + len <= rows): the
 * CPU one returns RLK_BAD_INDEX before writing anything; CUDA kernels set *bad_index (the caller
 * raises on its next call) and skip such a sequence, except that the forward runs one whose query
 * range holds but whose key range does not with no keys (k_len 0: its rows come out 0 with lse
 * -inf, its keys are neither read nor written), so that it leaves no row of a sequence unwritten.
 * Keys past a row's L are never read, so stale values (NaN, Inf) in a cache beyond its length
 * cannot reach a row.
 * The order of the alpha rescale relative to a block's sums, of the merge's products and of the
 * backward's products (P and dS rounded to the dtype for a tensor-core product, or not) are each the
 * backend's, fixed.
 * workspace: ctx->workspace_bytes of memory as planned (split-KV partials, backward row sums).
 */
#ifndef RLK_OPS_ATTENTION_H_
#define RLK_OPS_ATTENTION_H_

#include "../rlk.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLK_ATTENTION_BLOCK_N 64  /* keys per block on cpu and sm80 (sm90's forward: 128) */
#define RLK_ATTENTION_SEGMENT 512 /* keys per segment (a multiple of RLK_ATTENTION_BLOCK_N) */
#define RLK_ATTENTION_RESCALE_THRESHOLD 8.0f /* log2 units: m moves when a score beats it by 2^8 */

typedef struct rlk_attention_tensor {
    void *data;
    int64_t batch_stride, row_stride, head_stride; /* elements */
} rlk_attention_tensor;

typedef struct rlk_attention_args {
    int64_t batch, heads_q, heads_kv, head_dim;
    int64_t max_q_len, max_k_len; /* >= every q_len[b] / k_len[b]: grid sizing */
    int64_t q_rows, k_rows;       /* rows of one batch entry's storage: q_start + q_len <= q_rows, ... */
    rlk_dtype dtype;
    int causal;
    double softmax_scale; /* >= 0 (the bindings refuse a negative one); rounded to fp32 first for every
                             dtype but fp64, which takes it as given */
    const int32_t *q_start, *q_len, *k_start, *k_len; /* [batch] each, on the tensors' device, or null */
    rlk_attention_tensor q, k, v, out, lse;           /* forward: reads q, k, v; writes out, lse */
    rlk_attention_tensor dout, dq, dk, dv;            /* backward: reads q, k, v, out, lse, dout */
    int32_t *bad_index; /* CUDA: host-mapped flag set to 1 when a sequence's ranges are out of bounds */
    void *workspace;
} rlk_attention_args;

typedef int rlk_attention_fwd_fn(const rlk_attention_args *args, rlk_context *ctx);
typedef int rlk_attention_bwd_fn(const rlk_attention_args *args, rlk_context *ctx);

#ifdef __cplusplus
}
#endif
#endif /* RLK_OPS_ATTENTION_H_ */
