// The vocabulary-parallel head's per-token kernels (a ring rank's shard of the lm_head rows,
// [row0, row0 + Vs) of the vocabulary): truth kernels/reference/head_vocab.py (shard_stats,
// merge_stats, stats_loss, shard_bwd's dlogits). The GEMMs around them are cuBLAS
// (kernels/cuda/head_vocab.py); the row loops follow head_loss.cu's xent_kernel.
//
// vocab_stats_kernel<VEC>: one block (1024 threads) per row r of logits (rows, Vs) fp32: online
//   max and sum of exp (fp32) over the row, as xent_kernel's pass 1; stats[r] = (max,
//   sum of exp(logit - max), the target's logit if the target is one of the shard's rows, else
//   0). Every row gets its statistics, ignored targets (IGNORE = -100) too (stats_loss skips
//   them). VEC = 4 (float4 loads: Vs % 4 == 0 and a 16-byte aligned scratch) or 1.
// vocab_merge_kernel: one thread per token: acc = merge(acc, other): the larger max, both sums
//   rescaled to it and added (acc's first), target logits added (merge_stats's order).
// vocab_loss_kernel: one block (1024 threads) adds, over the T tokens whose target is not
//   IGNORE, max + log(sum) - target logit and 1, in a fixed tree order (no atomics), into
//   loss_acc[0], loss_acc[1].
// vocab_dlogits_kernel<VEC>: one block per row: with lse = max + log(sum) of the merged
//   statistics, d = (exp(logit - lse) - [j == target - row0]) * grad_scale (0 for an ignored
//   row), written as bf16 into the FIRST HALF of the same fp32 row (row stride 2 Vs elements),
//   tile by tile behind a barrier exactly as xent_kernel's pass 2 (race-free: a tile's writes
//   land on fp32 elements the tiles up to it have read).

template <int VEC> struct vload_f;
template <> struct vload_f<4> {
    __device__ static void ld(const float* p, float (&f)[4]) {
        float4 a = *reinterpret_cast<const float4*>(p);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    }
};
template <> struct vload_f<1> {
    __device__ static void ld(const float* p, float (&f)[1]) { f[0] = *p; }
};

template <int VEC>
__global__ void __launch_bounds__(1024) vocab_stats_kernel(const float* __restrict__ logits,
                                                          int vocab,
                                                          const int* __restrict__ targets,
                                                          int row0, float* __restrict__ stats) {
    __shared__ float red[32];
    const i64 r = blockIdx.x;
    const float* row = logits + r * (i64)vocab;
    const int tile = blockDim.x * VEC;
    float m = NEG_INF, s = 0.0f;
    for (int j = threadIdx.x * VEC; j < vocab; j += tile) {
        float x[VEC];
        vload_f<VEC>::ld(row + j, x);
        float mx = x[0];
#pragma unroll
        for (int k = 1; k < VEC; k++) mx = fmaxf(mx, x[k]);
        const float mn = fmaxf(m, mx);
        float add = 0.0f;
#pragma unroll
        for (int k = 0; k < VEC; k++) add += expf(x[k] - mn);
        s = s * expf(m - mn) + add;
        m = mn;
    }
    const float bm = block_max(m, red);
    s = m == NEG_INF ? 0.0f : s * expf(m - bm);
    s = block_sum(s, red);
    if (threadIdx.x == 0) {
        const int col = targets[r] - row0;  // IGNORE (-100) is never a row: row0 >= 0
        const bool mine = targets[r] != -100 && col >= 0 && col < vocab;
        stats[r * 3 + 0] = bm;
        stats[r * 3 + 1] = s;
        stats[r * 3 + 2] = mine ? row[col] : 0.0f;
    }
}

__global__ void __launch_bounds__(256) vocab_merge_kernel(float* __restrict__ acc,
                                                         const float* __restrict__ other,
                                                         i64 tokens) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float a0 = acc[t * 3], b0 = other[t * 3];
    const float m = fmaxf(a0, b0);
    acc[t * 3 + 1] = acc[t * 3 + 1] * expf(a0 - m) + other[t * 3 + 1] * expf(b0 - m);
    acc[t * 3 + 2] = acc[t * 3 + 2] + other[t * 3 + 2];
    acc[t * 3] = m;
}

__global__ void __launch_bounds__(1024) vocab_loss_kernel(const float* __restrict__ stats,
                                                         const int* __restrict__ targets,
                                                         int tokens, float* loss_acc) {
    __shared__ float red[32];
    float l = 0.0f, c = 0.0f;
    for (int t = threadIdx.x; t < tokens; t += blockDim.x) {
        if (targets[t] != -100) {
            l += stats[t * 3] + logf(stats[t * 3 + 1]) - stats[t * 3 + 2];
            c += 1.0f;
        }
    }
    l = block_sum(l, red);
    c = block_sum(c, red);
    if (threadIdx.x == 0) {
        loss_acc[0] += l;
        loss_acc[1] += c;
    }
}

template <int VEC>
__global__ void __launch_bounds__(1024) vocab_dlogits_kernel(float* logits, int vocab,
                                                            const int* __restrict__ targets,
                                                            int row0,
                                                            const float* __restrict__ stats,
                                                            float grad_scale) {
    const i64 r = blockIdx.x;
    float* row = logits + r * (i64)vocab;
    bf16* drow = reinterpret_cast<bf16*>(row);
    const bool ignore = targets[r] == -100;
    const int col = targets[r] - row0;  // outside [0, vocab): not one of this shard's rows
    const float lse = stats[r * 3] + logf(stats[r * 3 + 1]);
    const int tile = blockDim.x * VEC;
    for (int j0 = 0; j0 < vocab; j0 += tile) {
        const int j = j0 + threadIdx.x * VEC;
        float x[VEC];
        if (j < vocab && !ignore) vload_f<VEC>::ld(row + j, x);
        __syncthreads();                                 // the whole tile is read: now rewrite
        if (j < vocab) {
            float d[VEC];
#pragma unroll
            for (int k = 0; k < VEC; k++)
                d[k] = ignore ? 0.0f
                              : (expf(x[k] - lse) - (j + k == col ? 1.0f : 0.0f)) * grad_scale;
            if constexpr (VEC == 4) {
                uint2 u;
                u.x = pack_bf16x2(d[0], d[1]);
                u.y = pack_bf16x2(d[2], d[3]);
                *reinterpret_cast<uint2*>(drow + j) = u;
            } else {
                drow[j] = from_f<bf16>(d[0]);
            }
        }
    }
}
