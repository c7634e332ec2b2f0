// Token permutation of the mixture-of-experts block: the stable counting sort of the routed
// (token, slot) pairs by expert, the gather of x rows into expert order, and the weighted
// combine back to tokens, with their backward. Must match kernels/reference/moe_experts.py
// (expert_order, _inverse, permute_fwd, permute_bwd, unpermute_fwd, unpermute_bwd); the
// launcher is kernels/cuda/moe_experts.py, which also runs the experts' GEMMs (cuBLAS).
// Indices (topk_idx, order, inv, offsets) are int64 like the reference's: R * D passes 2^31 at
// long chunks, so every row offset is computed in 64 bits. No atomics anywhere: every result
// is the same bits on every run.
//
// expert_count_kernel: one 256-thread block per expert e: offsets[e + 1] = #(topk_idx == e).
// expert_scan_kernel: one thread: offsets[0] = 0, offsets[e + 1] += offsets[e] (N is small).
// expert_place_kernel: one 256-thread block per expert e walks the R flat pairs in order,
//   MOE_ITEMS consecutive pairs a thread per pass; a block-wide exclusive scan of the threads'
//   hit counts gives each hit its rank, so order[offsets[e] + rank] = pair and, when asked,
//   inv[pair] = that row. Stable by construction (pairs keep their flat order within an
//   expert), which is what the reference's np.argsort(kind="stable") produces.
// inverse_order_kernel: inv[order[r]] = r (grid-stride).
// offsets_to_mapped_kernel: one block stores offsets (N + 1,) into pinned host memory through
//   its device mapping (SM stores over PCIe, no copy engine: a memcpy would queue behind the
//   large transfers the copy engines are running), then fences them system-wide.
// permute_fwd_kernel<U>: xp[r, :] = x[order[r] / k, :], copied as raw units U (uint4 when rows
//   are 16-byte aligned, else unsigned short): bit-exact.
// permute_bwd_kernel<TI, TO, V, RES>: dx[t, :] = (residual[t, :] +) sum_j dxp[inv[t k + j], :],
//   the k rows added in slot order in fp32 starting from row 0 (np.sum over the slot axis adds
//   in that order), the fp32 residual added last, rounded once to TO: the reference's bits.
// unpermute_fwd_kernel<T, TO, V>: y[t, :] = sum_j w[t, j] * yp[inv[t k + j], :], products and
//   sums rounded separately in fp32 (__fmul_rn / __fadd_rn forbid FMA contraction) in slot
//   order, rounded once to TO (T, or fp32 for a sum the caller adds to a residual before its one
//   rounding): the reference's bits.
// unpermute_bwd_kernel<T, V>: one 256-thread block per routed row r, pair p = order[r],
//   t = p / k: dyp[r, :] = w[p] * dy[t, :] (fp32 product, rounded once: the reference's bits),
//   d_w[p] = <dy[t, :], yp[r, :]> in fp32 (block tree sum; not the reference's order).
// Elementwise kernels: packs of V = 8 columns (16-byte loads; D % 8 == 0 and aligned rows) or
//   V = 1; grid-stride over T * D / V packs.

#define FULL_MASK 0xffffffffu
#define MOE_ITEMS 16

__global__ void __launch_bounds__(256) expert_count_kernel(const i64* __restrict__ topk_idx,
                                                           i64 n_pairs, i64* __restrict__ offsets) {
    __shared__ i64 red[8];
    const int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 c = 0;
    for (i64 q = threadIdx.x; q < n_pairs; q += blockDim.x) c += topk_idx[q] == e;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(FULL_MASK, c, o);
    if (lane == 0) red[warp] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        i64 s = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w];
        offsets[e + 1] = s;
    }
}

__global__ void expert_scan_kernel(i64* offsets, int n_experts) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    offsets[0] = 0;
    for (int e = 1; e <= n_experts; e++) offsets[e] += offsets[e - 1];
}

__global__ void __launch_bounds__(256) expert_place_kernel(
    const i64* __restrict__ topk_idx, i64 n_pairs, const i64* __restrict__ offsets,
    i64* __restrict__ order, i64* __restrict__ inv, int write_inv) {
    __shared__ int warp_total[8];
    const int e = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = blockDim.x >> 5;
    i64 base = offsets[e];
    for (i64 c0 = 0; c0 < n_pairs; c0 += (i64)blockDim.x * MOE_ITEMS) {
        const i64 first = c0 + (i64)tid * MOE_ITEMS;  // this thread's MOE_ITEMS consecutive pairs
        unsigned hits = 0u;
        int n = 0;
#pragma unroll
        for (int q = 0; q < MOE_ITEMS; q++) {
            const i64 p = first + q;
            if (p < n_pairs && topk_idx[p] == e) {
                hits |= 1u << q;
                n++;
            }
        }
        int incl = n;  // inclusive scan of n over the warp's lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) warp_total[warp] = incl;
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < nwarps; w++) {
            before += w < warp ? warp_total[w] : 0;
            total += warp_total[w];
        }
        i64 row = base + before + incl - n;
#pragma unroll
        for (int q = 0; q < MOE_ITEMS; q++) {
            if ((hits >> q) & 1u) {
                order[row] = first + q;
                if (write_inv) inv[first + q] = row;
                row++;
            }
        }
        base += total;
        __syncthreads();  // warp_total is rewritten by the next pass
    }
}

__global__ void __launch_bounds__(256) offsets_to_mapped_kernel(const i64* __restrict__ offsets,
                                                                volatile i64* mapped, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) mapped[i] = offsets[i];
    __threadfence_system();
}

__global__ void __launch_bounds__(256) inverse_order_kernel(const i64* __restrict__ order,
                                                            i64* __restrict__ inv, i64 n_rows) {
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < n_rows;
         r += (i64)gridDim.x * blockDim.x)
        inv[order[r]] = r;
}

template <typename U>
__global__ void __launch_bounds__(256) permute_fwd_kernel(
    const U* __restrict__ x, const i64* __restrict__ order, U* __restrict__ xp, i64 n_rows,
    i64 units_per_row, int top_k) {
    const i64 total = n_rows * units_per_row;
    for (i64 u = (i64)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (i64)gridDim.x * blockDim.x) {
        const i64 r = u / units_per_row, c = u % units_per_row;
        xp[u] = x[(order[r] / top_k) * units_per_row + c];
    }
}

template <typename TI, typename TO, int V, bool RES>
__global__ void __launch_bounds__(256) permute_bwd_kernel(
    const TI* __restrict__ dxp, const i64* __restrict__ inv, const float* __restrict__ residual,
    TO* __restrict__ dx, i64 n_tokens, int dim, int top_k) {
    const i64 packs_per_row = dim / V, npacks = n_tokens * packs_per_row;
    for (i64 pk = (i64)blockIdx.x * blockDim.x + threadIdx.x; pk < npacks;
         pk += (i64)gridDim.x * blockDim.x) {
        const i64 t = pk / packs_per_row, col = (pk % packs_per_row) * V;
        float acc[V], v[V];
        vload(dxp + inv[t * top_k] * dim + col, acc);
        for (int j = 1; j < top_k; j++) {
            vload(dxp + inv[t * top_k + j] * dim + col, v);
#pragma unroll
            for (int i = 0; i < V; i++) acc[i] = __fadd_rn(acc[i], v[i]);
        }
        if (RES) {
            vload(residual + t * dim + col, v);
#pragma unroll
            for (int i = 0; i < V; i++) acc[i] = __fadd_rn(v[i], acc[i]);
        }
        vstore(dx + t * dim + col, acc);
    }
}

template <typename T, typename TO, int V>
__global__ void __launch_bounds__(256) unpermute_fwd_kernel(
    const T* __restrict__ yp, const i64* __restrict__ inv, const float* __restrict__ topk_weight,
    TO* __restrict__ y, i64 n_tokens, int dim, int top_k) {
    const i64 packs_per_row = dim / V, npacks = n_tokens * packs_per_row;
    for (i64 pk = (i64)blockIdx.x * blockDim.x + threadIdx.x; pk < npacks;
         pk += (i64)gridDim.x * blockDim.x) {
        const i64 t = pk / packs_per_row, col = (pk % packs_per_row) * V;
        float acc[V], v[V];
        for (int j = 0; j < top_k; j++) {
            const float w = topk_weight[t * top_k + j];
            vload(yp + inv[t * top_k + j] * dim + col, v);
#pragma unroll
            for (int i = 0; i < V; i++) {
                const float prod = __fmul_rn(w, v[i]);
                acc[i] = j == 0 ? prod : __fadd_rn(acc[i], prod);
            }
        }
        vstore(y + t * dim + col, acc);
    }
}

template <typename T, int V>
__global__ void __launch_bounds__(256) unpermute_bwd_kernel(
    const T* __restrict__ dy, const T* __restrict__ yp, const i64* __restrict__ order,
    const float* __restrict__ topk_weight, T* __restrict__ dyp, float* __restrict__ d_weight,
    int dim, int top_k) {
    __shared__ float red[32];
    const i64 r = blockIdx.x, p = order[r], t = p / top_k;
    const float w = topk_weight[p];
    float dot = 0.0f;
    for (int col = threadIdx.x * V; col < dim; col += blockDim.x * V) {
        float g[V], yv[V], out[V];
        vload(dy + t * dim + col, g);
        vload(yp + r * dim + col, yv);
#pragma unroll
        for (int i = 0; i < V; i++) {
            out[i] = __fmul_rn(w, g[i]);
            dot += g[i] * yv[i];
        }
        vstore(dyp + r * dim + col, out);
    }
    dot = block_sum(dot, red);
    if (threadIdx.x == 0) d_weight[p] = dot;
}
