// AdamW over a whole flat block (a layer's params, grads, m, v share one layout), in place,
// fp32 math on bf16 (or fp32) storage, bias correction, decoupled weight decay. Must match
// kernels/reference/adamw.py (adamw_step):
//   g = grad * scale;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g g;
//   p = p - lr * (wd p + (m / bc1) / (sqrt(v / bc2) + eps)),  bc1 = 1 - b1^step, bc2 = 1 - b2^step
// with scale = grad_scale * (*scale_dev when scale_dev is not null: e.g. a clip factor that
// utils.clip_scale computed on the device, so clipping needs no host sync).
//
// adamw_kernel<P, G, M, V>: grid-stride loop over packs of V elements (V = 8: 16-byte bf16
//   loads, 32-byte fp32 loads; V = 1 when a pointer is not 16-byte aligned), then the n % V
//   tail. P = param, G = grad, M = m and v storage: bf16 or float. 64-bit indices.

template <typename P, typename G, typename M, int W>
__device__ __forceinline__ void adamw_at(P* param, const G* grad, M* m, M* v, i64 off,
                                         float scale, float lr, float b1, float omb1, float b2,
                                         float omb2, float eps, float wd, float bc1, float bc2) {
    float p[W], g[W], mf[W], vf[W];
    vload(param + off, p);
    vload(grad + off, g);
    vload(m + off, mf);
    vload(v + off, vf);
#pragma unroll
    for (int k = 0; k < W; k++) {
        const float gs = g[k] * scale;
        mf[k] = b1 * mf[k] + omb1 * gs;
        vf[k] = b2 * vf[k] + omb2 * gs * gs;
        const float m_hat = mf[k] / bc1, v_hat = vf[k] / bc2;
        p[k] = p[k] - lr * (wd * p[k] + m_hat / (sqrtf(v_hat) + eps));
    }
    vstore(param + off, p);
    vstore(m + off, mf);
    vstore(v + off, vf);
}

template <typename P, typename G, typename M, int V>
__global__ void __launch_bounds__(256) adamw_kernel(
    P* __restrict__ param, const G* __restrict__ grad, M* __restrict__ m, M* __restrict__ v,
    i64 n, float lr, float b1, float omb1, float b2, float omb2, float eps, float wd,
    float bc1, float bc2, float grad_scale, const float* __restrict__ scale_dev) {
    const float scale = scale_dev ? grad_scale * scale_dev[0] : grad_scale;
    const i64 npacks = n / V, tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (i64 p = tid; p < npacks; p += (i64)gridDim.x * blockDim.x)
        adamw_at<P, G, M, V>(param, grad, m, v, p * V, scale, lr, b1, omb1, b2, omb2, eps, wd,
                             bc1, bc2);
    if (V > 1 && npacks * V + tid < n)
        adamw_at<P, G, M, 1>(param, grad, m, v, npacks * V + tid, scale, lr, b1, omb1, b2, omb2,
                             eps, wd, bc1, bc2);
}
