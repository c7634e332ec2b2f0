// RMSNorm forward and backward, as transformers' Llama computes it: normalise in fp32, then
// multiply by the weight. Must match kernels/reference/rms_norm.py (rms_norm_fwd, rms_norm_bwd).
//
// rms_norm_fwd_kernel<T, MAXP, COPY>: one block per row of x (T, D); each thread holds up to
//   MAXP packs of 8 elements in registers, so x is read once. y = (x * rstd) * w, rstd =
//   1 / sqrt(mean(x^2) + eps). T = bf16 or float storage; D % 8 == 0, rows 16-byte aligned.
//   COPY: x is also written to `copy` from those registers (the residual stream's copy a
//   layer starts from, without a second read of x).
// rms_norm_bwd_kernel<T, MAXP, RES>: grid of P blocks, block b takes rows b, b + P, ...; per
//   row dx = rstd * (g - n * mean(g * n)) with g = dy * w, n = x * rstd, and the block keeps its
//   own partial dw = sum over its rows of dy * n in registers, written to part[b, :] (fp32).
//   RES: dx = T(float(T(dx)) + float(res)) instead, the residual branch's gradient added in
//   (the bits of add_ after it, without a second pass over dx).
// rms_norm_dw_reduce<W>: dw_acc[c] += sum_b part[b, c], summed in a fixed order (deterministic),
//   launch (32, 8) threads per 32 columns; W = bf16 or float accumulator.

template <typename T, int MAXP, bool COPY>
__global__ void __launch_bounds__(512) rms_norm_fwd_kernel(
    const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
    float* __restrict__ rstd, int D, float eps, T* copy) {
    __shared__ float red[32];
    const i64 row = blockIdx.x;
    const T* xr = x + row * D;
    T* yr = y + row * D;
    const int npacks = D / 8;
    float v[MAXP][8];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < MAXP; i++) {
        const int p = threadIdx.x + i * blockDim.x;
        if (p < npacks) {
            vload(xr + 8 * p, v[i]);
#pragma unroll
            for (int k = 0; k < 8; k++) ss += v[i][k] * v[i][k];
        }
    }
    ss = block_sum(ss, red);
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
    for (int i = 0; i < MAXP; i++) {
        const int p = threadIdx.x + i * blockDim.x;
        if (p < npacks) {
            float wv[8], o[8];
            vload(w + 8 * p, wv);
#pragma unroll
            for (int k = 0; k < 8; k++) o[k] = (v[i][k] * r) * wv[k];
            vstore(yr + 8 * p, o);
            if (COPY) vstore(copy + row * D + 8 * p, v[i]);  // T -> float -> T: the same bits
        }
    }
}

template <typename T, int MAXP, bool RES>
__global__ void __launch_bounds__(512) rms_norm_bwd_kernel(
    const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ rstd,
    const T* __restrict__ dy, T* __restrict__ dx, float* __restrict__ part, int n_rows, int D,
    const T* res) {
    __shared__ float red[32];
    const int npacks = D / 8;
    float wv[MAXP][8], acc[MAXP][8];
#pragma unroll
    for (int i = 0; i < MAXP; i++) {
        const int p = threadIdx.x + i * blockDim.x;
#pragma unroll
        for (int k = 0; k < 8; k++) acc[i][k] = 0.0f;
        if (p < npacks) vload(w + 8 * p, wv[i]);
    }
    for (i64 row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const float r = rstd[row];
        float g[MAXP][8], n[MAXP][8], rv[RES ? MAXP : 1][8];
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < MAXP; i++) {
            const int p = threadIdx.x + i * blockDim.x;
            if (p < npacks) {
                float xv[8], dv[8];
                vload(x + row * D + 8 * p, xv);
                vload(dy + row * D + 8 * p, dv);
                // The residual is loaded with x and dy, so its latency overlaps theirs instead of
                // following the block reduction (a row's work was two memory round trips).
                if (RES) vload(res + row * D + 8 * p, rv[RES ? i : 0]);
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    n[i][k] = xv[k] * r;
                    g[i][k] = dv[k] * wv[i][k];
                    acc[i][k] += dv[k] * n[i][k];
                    dot += g[i][k] * n[i][k];
                }
            }
        }
        const float mean = block_sum(dot, red) / (float)D;
#pragma unroll
        for (int i = 0; i < MAXP; i++) {
            const int p = threadIdx.x + i * blockDim.x;
            if (p < npacks) {
                float o[8];
#pragma unroll
                for (int k = 0; k < 8; k++) o[k] = r * (g[i][k] - n[i][k] * mean);
                if (RES) {  // dx rounded to T first: the bits of a separate add_ after it
                    // (__fadd_rn: never contracted into an fma with the line above)
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        o[k] = __fadd_rn(to_f(from_f<T>(o[k])), rv[RES ? i : 0][k]);
                }
                vstore(dx + row * D + 8 * p, o);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MAXP; i++) {
        const int p = threadIdx.x + i * blockDim.x;
        if (p < npacks) vstore(part + (i64)blockIdx.x * D + 8 * p, acc[i]);
    }
}

template <typename W>
__global__ void __launch_bounds__(256) rms_norm_dw_reduce(
    const float* __restrict__ part, int n_parts, int D, W* __restrict__ dw_acc) {
    __shared__ float sums[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (c < D)
        for (int b = threadIdx.y; b < n_parts; b += 8) s += part[(i64)b * D + c];
    sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < D) {
        float t = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) t += sums[j][threadIdx.x];
        dw_acc[c] = from_f<W>(to_f(dw_acc[c]) + t);
    }
}
