// Router of the mixture-of-experts block: softmax + top-k over fp32 logits, the load-balancing
// statistics and loss, the z-loss, and the gradients that reach the logits. Must match
// kernels/reference/moe_router.py (router_fwd after its GEMM, router_topk, router_logits_bwd,
// load_balancing_stats, load_balancing_loss, load_balancing_loss_bwd, router_z_loss,
// router_z_loss_bwd). fp32 throughout (logits, probabilities and gradients are never bf16);
// expert indices and counts are int64 as the reference's. The launcher is
// kernels/cuda/moe_router.py.
//
// Row kernels (router_softmax_topk_kernel, router_lse_kernel, router_topk_bwd_kernel,
//   router_aux_bwd_kernel, router_z_bwd_kernel): one warp per token, 8 tokens per 256-thread
//   block. Lane l holds experts l, l + 32, ... in registers, so N <= 32 * MOE_PER_LANE = 256
//   (OLMoE 64, Qwen3-30B-A3B 128; the launcher refuses more).
// router_softmax_topk_kernel: probs = softmax(logits) (max subtracted, exp, divided by the
//   row's sum), then top_k rounds of a warp arg-max on the key (p, -expert): largest first,
//   equal probabilities lower expert index first (reference router_topk's stable sort on -p).
//   A NaN probability ranks below every number (numpy's argsort puts NaN last), so the chosen
//   indices are always distinct and inside [0, N). topk_weight = the chosen probs, divided by
//   their sum (summed in slot order) when norm.
// load_balancing_stats_kernel: one 256-thread block per expert e. counts[e] = #(idx == e) over
//   the T * k entries (integer sum, exact); prob_sum[e] = sum over tokens of probs[t, e], added
//   by one thread in token order from 256-token stages in shared memory: the order np.sum(axis=0)
//   uses, so the bits equal the reference's on the same probs.
// load_balancing_loss_kernel, router_z_sum_kernel: one block, fp64 sums (the reference sums in
//   fp64), a fixed order, no atomics; the scalar is stored as fp32 (or added to it).
// Backward row kernels: d_probs per row (the selected weights' gradient scattered to their
//   experts, or coef * N / rows^2 * counts), then d_logits = p * (d_probs - sum(d_probs * p));
//   the z-loss term is c * lse * exp(logit - lse). `acc`: add into d_logits instead of writing.

#define MOE_PER_LANE 8
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ i64 row_of_warp() {
    return (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
}

// Lane's share of one row of N values (NEG_INF / `pad` beyond N).
__device__ __forceinline__ void load_row(const float* row, int n, int lane, float pad,
                                         float (&v)[MOE_PER_LANE]) {
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; i++) {
        const int e = lane + 32 * i;
        v[i] = e < n ? row[e] : pad;
    }
}

__global__ void __launch_bounds__(256) router_softmax_topk_kernel(
    const float* __restrict__ logits, float* __restrict__ probs, i64* __restrict__ topk_idx,
    float* __restrict__ topk_weight, int n_tokens, int n_experts, int top_k, int norm) {
    const int lane = threadIdx.x & 31;
    const i64 t = row_of_warp();
    if (t >= n_tokens) return;  // the whole warp leaves together
    float p[MOE_PER_LANE];
    load_row(logits + t * n_experts, n_experts, lane, NEG_INF, p);
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; i++) mx = fmaxf(mx, p[i]);
    mx = warp_max(mx);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; i++) {
        p[i] = lane + 32 * i < n_experts ? expf(p[i] - mx) : 0.0f;
        s += p[i];
    }
    s = warp_sum(s);
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; i++) {
        const int e = lane + 32 * i;
        if (e < n_experts) {
            p[i] = p[i] / s;
            probs[t * n_experts + e] = p[i];
        }
    }
    unsigned taken = 0u;  // bit i: expert lane + 32 i already chosen
    float wsum = 0.0f;
    i64* idx_row = topk_idx + t * top_k;
    float* w_row = topk_weight + t * top_k;
    for (int j = 0; j < top_k; j++) {
        float bk = -2.0f, bv = 0.0f;  // key (NaN -> -1), value, expert of the lane's best
        int be = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < MOE_PER_LANE; i++) {
            const int e = lane + 32 * i;
            if (e < n_experts && !((taken >> i) & 1u)) {
                const float key = p[i] != p[i] ? -1.0f : p[i];
                if (key > bk) {  // e ascends with i: on equal keys the lower expert stays
                    bk = key;
                    bv = p[i];
                    be = e;
                }
            }
        }
        // (key, -expert) is a total order, so every lane ends with the same winner.
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ok = __shfl_xor_sync(FULL_MASK, bk, o);
            const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            const int oe = __shfl_xor_sync(FULL_MASK, be, o);
            if (ok > bk || (ok == bk && oe < be)) {
                bk = ok;
                bv = ov;
                be = oe;
            }
        }
        if ((be & 31) == lane) taken |= 1u << (be >> 5);
        if (lane == 0) {
            idx_row[j] = be;
            w_row[j] = bv;
            wsum += bv;
        }
    }
    if (norm && lane == 0)
        for (int j = 0; j < top_k; j++) w_row[j] = w_row[j] / wsum;  // lane 0 wrote them
}

// Sum of an i64 over a 256-thread block, returned to thread 0 only.
__device__ __forceinline__ i64 block_sum_i64_to0(i64 v, i64* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    i64 s = 0;
    if (threadIdx.x == 0)
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w];
    return s;
}

__global__ void __launch_bounds__(256) load_balancing_stats_kernel(
    const float* __restrict__ probs, const i64* __restrict__ topk_idx, i64* __restrict__ counts,
    float* __restrict__ prob_sum, int n_tokens, int n_experts, i64 n_pairs, int acc) {
    __shared__ float stage[256];
    __shared__ i64 red[8];
    const int e = blockIdx.x, tid = threadIdx.x;
    i64 c = 0;
    for (i64 q = tid; q < n_pairs; q += blockDim.x) c += topk_idx[q] == e;
    c = block_sum_i64_to0(c, red);
    float s = 0.0f;  // thread 0's running sum, in token order
    for (int t0 = 0; t0 < n_tokens; t0 += 256) {
        __syncthreads();  // the previous stage has been read
        if (t0 + tid < n_tokens) stage[tid] = probs[(i64)(t0 + tid) * n_experts + e];
        __syncthreads();
        if (tid == 0) {
            const int m = min(256, n_tokens - t0);
            for (int i = 0; i < m; i++) s += stage[i];
        }
    }
    if (tid == 0) {
        counts[e] = acc ? counts[e] + c : c;
        prob_sum[e] = acc ? prob_sum[e] + s : s;
    }
}

__global__ void load_balancing_loss_kernel(const i64* __restrict__ counts,
                                           const float* __restrict__ prob_sum, int n_experts,
                                           double n_rows, float* loss, int acc) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double s = 0.0;
    for (int e = 0; e < n_experts; e++)
        s += ((double)counts[e] / n_rows) * ((double)prob_sum[e] / n_rows);
    const float v = (float)(n_experts * s);
    loss[0] = acc ? loss[0] + v : v;
}

__global__ void __launch_bounds__(256) router_lse_kernel(const float* __restrict__ logits,
                                                         float* __restrict__ lse, int n_tokens,
                                                         int n_experts) {
    const int lane = threadIdx.x & 31;
    const i64 t = row_of_warp();
    if (t >= n_tokens) return;
    float l[MOE_PER_LANE];
    load_row(logits + t * n_experts, n_experts, lane, NEG_INF, l);
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; i++) mx = fmaxf(mx, l[i]);
    mx = warp_max(mx);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; i++)
        if (lane + 32 * i < n_experts) s += expf(l[i] - mx);
    s = warp_sum(s);
    if (lane == 0) lse[t] = mx + logf(s);
}

__global__ void __launch_bounds__(256) router_z_sum_kernel(const float* __restrict__ lse,
                                                           int n_tokens, double n_rows,
                                                           float* loss, int acc) {
    __shared__ double red[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double s = 0.0;
    for (int t = threadIdx.x; t < n_tokens; t += blockDim.x) {
        const double v = lse[t];
        s += v * v;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double tot = 0.0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) tot += red[w];
        const float v = (float)(tot / n_rows);
        loss[0] = acc ? loss[0] + v : v;
    }
}

// d_logits row = p * (dp - sum(dp * p)), written or added (acc).
__device__ __forceinline__ void softmax_bwd_store(const float (&p)[MOE_PER_LANE],
                                                  const float (&dp)[MOE_PER_LANE], float* out,
                                                  int n, int lane, int acc) {
    float g = 0.0f;
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; i++) g += dp[i] * p[i];
    g = warp_sum(g);
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; i++) {
        const int e = lane + 32 * i;
        if (e < n) {
            const float v = p[i] * (dp[i] - g);
            out[e] = acc ? out[e] + v : v;
        }
    }
}

__global__ void __launch_bounds__(256) router_topk_bwd_kernel(
    const float* __restrict__ probs, const i64* __restrict__ topk_idx,
    const float* __restrict__ d_topk_weight, float* __restrict__ d_logits, int n_tokens,
    int n_experts, int top_k, int norm, int acc) {
    const int lane = threadIdx.x & 31;
    const i64 t = row_of_warp();
    if (t >= n_tokens) return;
    const float* prow = probs + t * n_experts;
    const i64* ix = topk_idx + t * top_k;
    const float* dw = d_topk_weight + t * top_k;
    float p[MOE_PER_LANE], dp[MOE_PER_LANE];
    load_row(prow, n_experts, lane, 0.0f, p);
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; i++) dp[i] = 0.0f;
    // With renormalisation w = v / s: dv = (dw - sum(dw * w)) / s (every lane computes it).
    float s = 1.0f, dot = 0.0f;
    if (norm) {
        s = 0.0f;
        for (int j = 0; j < top_k; j++) s += prow[ix[j]];
        for (int j = 0; j < top_k; j++) dot += dw[j] * (prow[ix[j]] / s);
    }
    for (int j = 0; j < top_k; j++) {
        const i64 e = ix[j];
        const float dv = norm ? (dw[j] - dot) / s : dw[j];
#pragma unroll
        for (int i = 0; i < MOE_PER_LANE; i++)
            if (e == lane + 32 * i) dp[i] = dv;
    }
    softmax_bwd_store(p, dp, d_logits + t * n_experts, n_experts, lane, acc);
}

__global__ void __launch_bounds__(256) router_aux_bwd_kernel(
    const float* __restrict__ probs, const i64* __restrict__ counts, float c,
    float* __restrict__ d_logits, int n_tokens, int n_experts, int acc) {
    const int lane = threadIdx.x & 31;
    const i64 t = row_of_warp();
    if (t >= n_tokens) return;
    float p[MOE_PER_LANE], dp[MOE_PER_LANE];
    load_row(probs + t * n_experts, n_experts, lane, 0.0f, p);
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; i++) {
        const int e = lane + 32 * i;
        dp[i] = e < n_experts ? c * (float)counts[e] : 0.0f;
    }
    softmax_bwd_store(p, dp, d_logits + t * n_experts, n_experts, lane, acc);
}

__global__ void __launch_bounds__(256) router_z_bwd_kernel(
    const float* __restrict__ logits, const float* __restrict__ lse, float c,
    float* __restrict__ d_logits, int n_tokens, int n_experts, int acc) {
    const int lane = threadIdx.x & 31;
    const i64 t = row_of_warp();
    if (t >= n_tokens) return;
    const float ls = lse[t], cl = c * ls;  // the reference's (c * lse) * exp(l - lse)
    const float* lrow = logits + t * n_experts;
    float* out = d_logits + t * n_experts;
    for (int e = lane; e < n_experts; e += 32) {
        const float v = cl * expf(lrow[e] - ls);
        out[e] = acc ? out[e] + v : v;
    }
}
