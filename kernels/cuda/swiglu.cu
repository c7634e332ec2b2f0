// SwiGLU gate of transformers' LlamaMLP: h = silu(gate) * up, and its backward
// (silu'(g) = s + g s (1 - s), s = sigmoid(g)). Must match kernels/reference/swiglu.py
// (swiglu_fwd, swiglu_bwd). Elementwise over the flat (T * F) arrays.
//
// swiglu_fwd_kernel<T, V>, swiglu_bwd_kernel<T, V, H>: grid-stride loop over packs of V elements
//   (V = 8: 16-byte loads; V = 1 when a pointer is not 16-byte aligned), then the n % V tail
//   element by element. T = bf16 or float storage, fp32 math, 64-bit indices. H: the backward
//   also writes the forward's h to `out` (a backward that needs h and would otherwise run the
//   forward kernel first, reading gate and up twice).

__device__ __forceinline__ float sigmoidf_(float z) { return 1.0f / (1.0f + expf(-z)); }

template <typename T, int W>
__device__ __forceinline__ void swiglu_fwd_at(const T* gate, const T* up, T* out, i64 off) {
    float g[W], u[W], h[W];
    vload(gate + off, g);
    vload(up + off, u);
#pragma unroll
    for (int k = 0; k < W; k++) h[k] = g[k] * sigmoidf_(g[k]) * u[k];
    vstore(out + off, h);
}

template <typename T, int W, bool H>
__device__ __forceinline__ void swiglu_bwd_at(const T* gate, const T* up, const T* dh,
                                              T* dgate, T* dup, T* out, i64 off) {
    float g[W], u[W], d[W], dg[W], du[W], h[W];
    vload(gate + off, g);
    vload(up + off, u);
    vload(dh + off, d);
#pragma unroll
    for (int k = 0; k < W; k++) {
        const float s = sigmoidf_(g[k]);
        dg[k] = d[k] * u[k] * (s + g[k] * s * (1.0f - s));
        du[k] = d[k] * g[k] * s;
        h[k] = g[k] * s * u[k];  // swiglu_fwd_at's products in its order: the same bits
    }
    vstore(dgate + off, dg);
    vstore(dup + off, du);
    if (H) vstore(out + off, h);
}

template <typename T, int V>
__global__ void __launch_bounds__(256) swiglu_fwd_kernel(
    const T* gate, const T* up, T* out, i64 n) {
    const i64 npacks = n / V, tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (i64 p = tid; p < npacks; p += (i64)gridDim.x * blockDim.x)
        swiglu_fwd_at<T, V>(gate, up, out, p * V);
    if (V > 1 && npacks * V + tid < n) swiglu_fwd_at<T, 1>(gate, up, out, npacks * V + tid);
}

template <typename T, int V, bool H>
__global__ void __launch_bounds__(256) swiglu_bwd_kernel(
    const T* gate, const T* up, const T* dh, T* dgate, T* dup, T* out, i64 n) {
    const i64 npacks = n / V, tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (i64 p = tid; p < npacks; p += (i64)gridDim.x * blockDim.x)
        swiglu_bwd_at<T, V, H>(gate, up, dh, dgate, dup, out, p * V);
    if (V > 1 && npacks * V + tid < n)
        swiglu_bwd_at<T, 1, H>(gate, up, dh, dgate, dup, out, npacks * V + tid);
}
