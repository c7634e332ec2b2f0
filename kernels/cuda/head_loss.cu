// Fused softmax cross-entropy for one sub-chunk of the output head, in place on the fp32 logits.
// Must match kernels/reference/head_loss.py (head_loss_fwd_bwd) for the loss and for
// d loss / d logits = (softmax(logits) - onehot(target)) * grad_scale (0 for ignored rows).
//
// xent_kernel<VEC>: one block (1024 threads) per row r of logits (rows, V) fp32.
//   Pass 1 reads the row once: online max and sum of exp (fp32), lse = max + log(sum), and
//   the target's logit. Pass 2 walks the row in tiles of blockDim * VEC: reads a tile into
//   registers, barrier, writes its dlogits as bf16 into the FIRST HALF of the same fp32 row
//   (bf16 element j at byte 2j of the row, so dlogits is a (rows, V) bf16 matrix with row
//   stride 2V elements). A write of tile k lands on fp32 elements < (k+1) * tile / 2, all
//   read by tiles <= k before the barrier, and never on a later tile: the in-place rewrite is
//   race-free. The row's loss (lse - logit[target]) and valid flag (1 or 0) go, as fp32, to
//   row elements ceil(V/2) and ceil(V/2) + 1, past the bf16 half.
//   Targets: IGNORE (-100, transformers' ignore index) -> no loss, zero gradient; outside
//   [0, V) otherwise -> NaN loss, so a bad label shows instead of being skipped. VEC = 4 (float4 loads, V % 4 == 0) or 1.
// xent_finish: one block adds the rows' loss and valid flags in a fixed tree order into
//   loss_acc[0], loss_acc[1] (deterministic, no atomics).

template <int VEC> struct vecf;
template <> struct vecf<4> {
    __device__ static void ld(const float* p, float (&f)[4]) {
        float4 a = *reinterpret_cast<const float4*>(p);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    }
};
template <> struct vecf<1> {
    __device__ static void ld(const float* p, float (&f)[1]) { f[0] = *p; }
};

template <int VEC>
__global__ void __launch_bounds__(1024) xent_kernel(float* logits, int vocab,
                                                   const int* __restrict__ targets,
                                                   float grad_scale) {
    __shared__ float red[32];
    const i64 r = blockIdx.x;
    float* row = logits + r * (i64)vocab;
    bf16* drow = reinterpret_cast<bf16*>(row);
    const int tgt = targets[r];
    const bool ignore = tgt == -100;
    const bool in_range = tgt >= 0 && tgt < vocab;
    const int tile = blockDim.x * VEC;
    float lse = 0.0f, x_t = 0.0f;
    if (!ignore) {
        if (in_range && threadIdx.x == 0) x_t = row[tgt];
        float m = NEG_INF, s = 0.0f;
        for (int j = threadIdx.x * VEC; j < vocab; j += tile) {
            float x[VEC];
            vecf<VEC>::ld(row + j, x);
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
        lse = bm + logf(s);
    }
    const float scale = (ignore || !in_range) ? 0.0f : grad_scale;
    for (int j0 = 0; j0 < vocab; j0 += tile) {
        const int j = j0 + threadIdx.x * VEC;
        float x[VEC];
        if (j < vocab && !ignore) vecf<VEC>::ld(row + j, x);
        __syncthreads();                                 // the whole tile is read: now rewrite
        if (j < vocab) {
            float d[VEC];
#pragma unroll
            for (int k = 0; k < VEC; k++)
                d[k] = ignore ? 0.0f : (expf(x[k] - lse) - (j + k == tgt ? 1.0f : 0.0f)) * scale;
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
    if (threadIdx.x == 0) {
        const int tail = (vocab + 1) / 2;
        row[tail] = ignore ? 0.0f : (in_range ? lse - x_t : __int_as_float(0x7fc00000));
        row[tail + 1] = ignore ? 0.0f : 1.0f;
    }
}

__global__ void __launch_bounds__(1024) xent_finish(const float* __restrict__ logits, int rows,
                                                   int vocab, float* loss_acc) {
    __shared__ float red[32];
    const int tail = (vocab + 1) / 2;
    float l = 0.0f, c = 0.0f;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        l += logits[(i64)r * vocab + tail];
        c += logits[(i64)r * vocab + tail + 1];
    }
    l = block_sum(l, red);
    c = block_sum(c, red);
    if (threadIdx.x == 0) {
        loss_acc[0] += l;
        loss_acc[1] += c;
    }
}
