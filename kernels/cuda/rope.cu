// Rotary position embedding, half-split convention of transformers' Llama (rotate_half):
// dimension j pairs with j + E/2 and turns by the angle pos * inv_freq[j]. The inverse
// frequencies come in as a table built on the host by kernels/reference/rope.py rope_inv_freq
// (plain theta ** (-2j / E), or Llama 3.1-style scaled), the same float64 values the reference
// uses. Must match kernels/reference/rope.py (rope_fwd with sign = +1, rope_bwd with sign = -1):
//   y1 = x1 cos - sign x2 sin,   y2 = x2 cos + sign x1 sin.
//
// rope_kernel<T, V>: x, out (T, n, E), T = bf16 or float storage; positions (T,) int32;
//   inv_freq: RopeInvFreq passed by value (kernel parameter space, no device allocation), its
//   first E/2 entries used; __grid_constant__ so indexing it reads the parameter bank directly
//   instead of copying 1 KiB to every thread's local memory.
//   Block of 256 threads takes `tpb` consecutive tokens. First the block forms each
//   (token, j) angle pos * inv_freq[j] in fp64 (exact for positions up to 2^53, as the
//   reference does) and keeps cos/sin rounded to fp32 in shared memory; then every thread
//   rotates packs of V pairs (V = 8: 16-byte loads of x1 and x2; V = 1 otherwise) of any head.
//   In place is allowed (out == x): each pair is read and written by the same thread.

#define ROPE_MAX_HALF 128  // head_dim <= 256; kernels/cuda/rope.py MAX_HALF must agree

struct RopeInvFreq {
    double v[ROPE_MAX_HALF];
};

template <typename T, int V>
__global__ void __launch_bounds__(256) rope_kernel(
    const T* x, const int* __restrict__ positions, T* out,
    int n_tokens, int n_heads, int E, int tpb, const __grid_constant__ RopeInvFreq inv_freq,
    float sign) {
    extern __shared__ float cs[];               // [tpb][half] cos, then [tpb][half] sin
    const int half = E / 2;
    float* sn = cs + tpb * half;
    const i64 tok0 = (i64)blockIdx.x * tpb;
    for (int i = threadIdx.x; i < tpb * half; i += blockDim.x) {
        const i64 tok = tok0 + i / half;
        const int j = i % half;
        if (tok < n_tokens) {
            const double ang = (double)positions[tok] * inv_freq.v[j];
            double s, c;
            sincos(ang, &s, &c);
            cs[i] = (float)c;
            sn[i] = (float)s;
        }
    }
    __syncthreads();
    const int packs_per_head = half / V;
    const int packs_per_tok = n_heads * packs_per_head;
    for (int i = threadIdx.x; i < tpb * packs_per_tok; i += blockDim.x) {
        const int lt = i / packs_per_tok;
        const i64 tok = tok0 + lt;
        if (tok >= n_tokens) break;
        const int r = i % packs_per_tok;
        const int h = r / packs_per_head;
        const int j0 = (r % packs_per_head) * V;
        const i64 base = (tok * n_heads + h) * (i64)E + j0;
        float x1[V], x2[V], y1[V], y2[V];
        vload(x + base, x1);
        vload(x + base + half, x2);
#pragma unroll
        for (int k = 0; k < V; k++) {
            const float c = cs[lt * half + j0 + k];
            const float s = sign * sn[lt * half + j0 + k];
            y1[k] = x1[k] * c - x2[k] * s;
            y2[k] = x2[k] * c + x1[k] * s;
        }
        vstore(out + base, y1);
        vstore(out + base + half, y2);
    }
}
