// Simple (slow, exact-in-fp32) causal grouped-query attention: the fallback for any case the
// cuDNN SDPA graph cannot express, and an independent cross-check of it in the tests. Must
// match kernels/reference/attention.py (attention_fwd, attention_bwd): query i of the chunk sits
// at absolute position q_offset + i and attends to keys j <= q_offset + i of the S context
// keys; scale 1/sqrt(E); query head h reads kv head h / (H / K); lse is the natural
// log-sum-exp of the scaled scores. Nothing is rounded to bf16 inside (unlike flash kernels).
//
// One warp per (row, head); lane l holds elements l, l + 32, ... of a head vector (EPL = E/32
// rounded up, a compile-time bound so the arrays stay in registers), dot products by warp
// shuffles. Block = 4 warps. T = q/k/v/o/dq storage, G = dk/dv storage (bf16 or float).
// attn_simple_fwd<T, EPL>:  warp per (i, h), online softmax over keys 0 .. q_offset + i.
// attn_simple_bwd_q<T, EPL>: warp per (i, h): delta = do.o, dq = scale sum_j p (dp - delta) k_j.
// attn_simple_bwd_kv<T, G, EPL>: warp per (j, kv head): sums over the group's heads and the
//   queries i with q_offset + i >= j: dv_j = sum p do_i, dk_j = scale sum p (dp - delta) q_i.
//   Every one of the S rows is written (rows no query sees get zeros): overwrite semantics.

template <typename T, int EPL>
__device__ __forceinline__ void load_head(const T* p, int E, float (&r)[EPL]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const int e = lane + 32 * k;
        r[k] = e < E ? to_f(p[e]) : 0.0f;
    }
}

template <int EPL>
__device__ __forceinline__ float dot_head(const float (&a)[EPL], const float (&b)[EPL]) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) s += a[k] * b[k];
    return warp_sum(s);
}

template <typename T, int EPL>
__global__ void __launch_bounds__(128) attn_simple_fwd(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
    float* __restrict__ lse, int n_q, int n_kv, int H, int K, int E, int q_offset, float scale) {
    const i64 item = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (item >= (i64)n_q * H) return;
    const int i = item / H, h = item % H, kvh = h / (H / K), lane = threadIdx.x & 31;
    float qv[EPL], acc[EPL];
    load_head(q + ((i64)i * H + h) * E, E, qv);
#pragma unroll
    for (int e = 0; e < EPL; e++) acc[e] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    const int last = q_offset + i;
    for (int j = 0; j <= last; j++) {
        float kv[EPL], vv[EPL];
        load_head(k + ((i64)j * K + kvh) * E, E, kv);
        const float s = dot_head(qv, kv) * scale;
        const float mn = fmaxf(m, s);
        const float c = expf(m - mn), p = expf(s - mn);
        load_head(v + ((i64)j * K + kvh) * E, E, vv);
#pragma unroll
        for (int e = 0; e < EPL; e++) acc[e] = acc[e] * c + p * vv[e];
        l = l * c + p;
        m = mn;
    }
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        const int idx = lane + 32 * e;
        if (idx < E) o[((i64)i * H + h) * E + idx] = from_f<T>(acc[e] / l);
    }
    if (lane == 0) lse[(i64)h * n_q + i] = m + logf(l);
}

template <typename T, int EPL>
__global__ void __launch_bounds__(128) attn_simple_bwd_q(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ o, const float* __restrict__ lse, const T* __restrict__ dout,
    T* __restrict__ dq, int n_q, int n_kv, int H, int K, int E, int q_offset, float scale) {
    const i64 item = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (item >= (i64)n_q * H) return;
    const int i = item / H, h = item % H, kvh = h / (H / K), lane = threadIdx.x & 31;
    const i64 row = ((i64)i * H + h) * E;
    float qv[EPL], ov[EPL], dov[EPL], acc[EPL];
    load_head(q + row, E, qv);
    load_head(o + row, E, ov);
    load_head(dout + row, E, dov);
    const float delta = dot_head(dov, ov), L = lse[(i64)h * n_q + i];
#pragma unroll
    for (int e = 0; e < EPL; e++) acc[e] = 0.0f;
    for (int j = 0; j <= q_offset + i; j++) {
        float kv[EPL], vv[EPL];
        load_head(k + ((i64)j * K + kvh) * E, E, kv);
        load_head(v + ((i64)j * K + kvh) * E, E, vv);
        const float p = expf(dot_head(qv, kv) * scale - L);
        const float ds = p * (dot_head(dov, vv) - delta) * scale;
#pragma unroll
        for (int e = 0; e < EPL; e++) acc[e] += ds * kv[e];
    }
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        const int idx = lane + 32 * e;
        if (idx < E) dq[row + idx] = from_f<T>(acc[e]);
    }
}

template <typename T, typename G, int EPL>
__global__ void __launch_bounds__(128) attn_simple_bwd_kv(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ o, const float* __restrict__ lse, const T* __restrict__ dout,
    G* __restrict__ dk, G* __restrict__ dv, int n_q, int n_kv, int H, int K, int E,
    int q_offset, float scale) {
    const i64 item = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (item >= (i64)n_kv * K) return;
    const int j = item / K, kvh = item % K, group = H / K, lane = threadIdx.x & 31;
    const i64 krow = ((i64)j * K + kvh) * E;
    float kv[EPL], vv[EPL], dka[EPL], dva[EPL];
    load_head(k + krow, E, kv);
    load_head(v + krow, E, vv);
#pragma unroll
    for (int e = 0; e < EPL; e++) dka[e] = dva[e] = 0.0f;
    for (int h = kvh * group; h < (kvh + 1) * group; h++) {
        for (int i = max(0, j - q_offset); i < n_q; i++) {
            const i64 row = ((i64)i * H + h) * E;
            float qv[EPL], ov[EPL], dov[EPL];
            load_head(q + row, E, qv);
            load_head(o + row, E, ov);
            load_head(dout + row, E, dov);
            const float p = expf(dot_head(qv, kv) * scale - lse[(i64)h * n_q + i]);
            const float ds = p * (dot_head(dov, vv) - dot_head(dov, ov)) * scale;
#pragma unroll
            for (int e = 0; e < EPL; e++) {
                dva[e] += p * dov[e];
                dka[e] += ds * qv[e];
            }
        }
    }
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        const int idx = lane + 32 * e;
        if (idx < E) {
            dk[krow + idx] = from_f<G>(dka[e]);
            dv[krow + idx] = from_f<G>(dva[e]);
        }
    }
}
