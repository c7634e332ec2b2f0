// Small elementwise and reduction utilities the engine uses between the ops: gradient
// accumulation (add_), dtype conversion (cast), buffer initialisation (fill), the global
// gradient norm (sumsq, then clip_scale). No NumPy reference file: their truths are
// dst + src, astype, full and sum(x^2), rounded to nearest even like ml_dtypes.
//
// add_kernel<D, S, V>:   dst = D(float(dst) + float(src))        flat, packs of V (8 or 1)
// cast_kernel<S, D, V>:  dst = D(float(src))
// fill_kernel<D, V>:     x = D(value)
// scale_kernel<D, V>:    x = D(float(x) * s)   (LoRA's (T, r) intermediates times alpha / r;
//   truth dataflow.kernels.reference.lora.scale)
//   grid-stride loops over packs, then the n % V tail; 64-bit indices; D, S = bf16 or float.
// sumsq_partial<S, V>:   block b of a fixed grid of P blocks (P depends on n only) sums x^2 of
//   its grid-stride share in fp32 into part[b];
// sumsq_finish:          one block adds part[0..P) in a fixed tree order into out[0]
//   (out = s, or out += s when accumulate): deterministic, no atomics.
// sumsq_blocks<S>:       out[b] (double) = sum of x^2 over sub-block b, elements
//   [b * sub, min(n, (b + 1) * sub)): one block of 256 threads per sub-block, thread t sums
//   elements t, t + 256, ... in double (each square is exact: at most 24 significant bits), then
//   a fixed shared-memory tree. The value depends on the sub-block's elements only, never on
//   where it lies or how many there are, so a split replica's part gives the whole block's
//   sums (dataflow.norm_parts adds them exactly on the host; truth norm_parts.sub_block_sums,
//   equal up to float64 rounding of the order).
// clip_scale_kernel:     out[0] = scale * min(1, max_norm / (sqrt(sumsq[0]) + 1e-6)), the
//   clip-by-global-norm factor (torch.nn.utils.clip_grad_norm_), computed on the device so
//   AdamW can read it without a host sync.
// bias_fill_kernel<T>:   y[r, c] = b[c] for a (R, C) y: a biased projection's output starts as
//   its bias and the GEMM accumulates onto it (beta = 1), so b + x @ w.T is rounded once, as
//   dataflow.kernels.reference.linear.linear_fwd(x, w, b). Grid-stride over R*C elements.
// bias_bwd_kernel<S, W>: db[c] += sum_r dy[r, c] (Qwen2's q/k/v bias gradients), truth
//   dataflow.kernels.reference.linear.bias_bwd. Launch (32, 8) threads per 32 columns, as
//   rms_norm_dw_reduce: thread (x, y) sums rows y, y + 8, ... of column 32 * block + x in
//   fp32, then row 0 of the block adds the 8 partial sums in a fixed order (deterministic).

template <typename D, typename S, int W>
__device__ __forceinline__ void add_at(D* dst, const S* src, i64 off) {
    float a[W], b[W];
    vload(dst + off, a);
    vload(src + off, b);
#pragma unroll
    for (int k = 0; k < W; k++) a[k] += b[k];
    vstore(dst + off, a);
}

template <typename D, typename S, int V>
__global__ void __launch_bounds__(256) add_kernel(D* dst, const S* src, i64 n) {
    const i64 npacks = n / V, tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (i64 p = tid; p < npacks; p += (i64)gridDim.x * blockDim.x) add_at<D, S, V>(dst, src, p * V);
    if (V > 1 && npacks * V + tid < n) add_at<D, S, 1>(dst, src, npacks * V + tid);
}

template <typename S, typename D, int W>
__device__ __forceinline__ void cast_at(const S* src, D* dst, i64 off) {
    float a[W];
    vload(src + off, a);
    vstore(dst + off, a);
}

template <typename S, typename D, int V>
__global__ void __launch_bounds__(256) cast_kernel(const S* src, D* dst, i64 n) {
    const i64 npacks = n / V, tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (i64 p = tid; p < npacks; p += (i64)gridDim.x * blockDim.x) cast_at<S, D, V>(src, dst, p * V);
    if (V > 1 && npacks * V + tid < n) cast_at<S, D, 1>(src, dst, npacks * V + tid);
}

template <typename D, int V>
__global__ void __launch_bounds__(256) fill_kernel(D* x, float value, i64 n) {
    const i64 npacks = n / V, tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    float v[V];
#pragma unroll
    for (int k = 0; k < V; k++) v[k] = value;
    for (i64 p = tid; p < npacks; p += (i64)gridDim.x * blockDim.x) vstore(x + p * V, v);
    if (V > 1 && npacks * V + tid < n) {
        float one[1] = {value};
        vstore(x + npacks * V + tid, one);
    }
}

template <typename D, int W>
__device__ __forceinline__ void scale_at(D* x, float s, i64 off) {
    float a[W];
    vload(x + off, a);
#pragma unroll
    for (int k = 0; k < W; k++) a[k] *= s;
    vstore(x + off, a);
}

template <typename D, int V>
__global__ void __launch_bounds__(256) scale_kernel(D* x, float s, i64 n) {
    const i64 npacks = n / V, tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (i64 p = tid; p < npacks; p += (i64)gridDim.x * blockDim.x) scale_at<D, V>(x, s, p * V);
    if (V > 1 && npacks * V + tid < n) scale_at<D, 1>(x, s, npacks * V + tid);
}

template <typename S, int V>
__global__ void __launch_bounds__(256) sumsq_partial(const S* __restrict__ x, i64 n,
                                                    float* __restrict__ part) {
    __shared__ float red[32];
    const i64 npacks = n / V, tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    float s = 0.0f;
    for (i64 p = tid; p < npacks; p += (i64)gridDim.x * blockDim.x) {
        float v[V];
        vload(x + p * V, v);
#pragma unroll
        for (int k = 0; k < V; k++) s += v[k] * v[k];
    }
    if (V > 1 && npacks * V + tid < n) {
        float v[1];
        vload(x + npacks * V + tid, v);
        s += v[0] * v[0];
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

__global__ void __launch_bounds__(1024) sumsq_finish(const float* __restrict__ part, int n_parts,
                                                    float* out, int accumulate) {
    __shared__ float red[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n_parts; i += blockDim.x) s += part[i];
    s = block_sum(s, red);
    if (threadIdx.x == 0) out[0] = accumulate ? out[0] + s : s;
}

template <typename S>
__global__ void __launch_bounds__(256) sumsq_blocks(const S* __restrict__ x, i64 n, int sub,
                                                   double* __restrict__ out) {
    __shared__ double red[256];
    const i64 start = (i64)blockIdx.x * sub;
    double s = 0.0;
    for (int k = threadIdx.x; k < sub; k += 256) {
        const i64 i = start + k;
        if (i < n) {
            const double v = (double)to_f(x[i]);
            s += v * v;
        }
    }
    red[threadIdx.x] = s;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = red[0];
}

__global__ void clip_scale_kernel(const float* __restrict__ sumsq, float max_norm, float scale,
                                  float* out) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
        out[0] = scale * fminf(1.0f, max_norm / (sqrtf(sumsq[0]) + 1e-6f));
}

template <typename T>
__global__ void __launch_bounds__(256) bias_fill_kernel(const T* __restrict__ b, T* __restrict__ y,
                                                       i64 n_rows, int n_cols) {
    const i64 n = n_rows * n_cols;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = b[i % n_cols];  // a copy of the bias's bits
}

template <typename S, typename W>
__global__ void __launch_bounds__(256) bias_bwd_kernel(const S* __restrict__ dy, i64 n_rows,
                                                      int n_cols, W* __restrict__ db) {
    __shared__ float sums[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (c < n_cols)
        for (i64 r = threadIdx.y; r < n_rows; r += 8) s += to_f(dy[r * n_cols + c]);
    sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < n_cols) {
        float t = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) t += sums[j][threadIdx.x];
        db[c] = from_f<W>(to_f(db[c]) + t);
    }
}
