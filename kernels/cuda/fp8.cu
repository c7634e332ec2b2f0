// FP8 quantisation under per-tensor current scaling (kernels/reference/fp8.py is the truth):
//
// fp8_amax_partial<S, V>: block b writes the largest |x| of its grid-stride share into part[b]
//   (a NaN anywhere wins, so a non-finite tensor cannot hide behind a finite maximum).
// fp8_scale_finish:        one block takes the max of part[0..P) and writes out[0] = 1 / scale
//   (what cuBLASLt's scale pointers take: they dequantise; first, so the pointer is as aligned
//   as the array), out[1] = scale, out[2] = amax.
//   scale = 2^floor(log2(fmt_max / amax)) computed exactly from amax's exponent and mantissa
//   (both formats' largest value is 0.875 * 2^max_exp); 1 for amax 0; NaN for a non-finite
//   amax, so every value cast with it is NaN and the step is seen as non-finite downstream.
// fp8_cast<S, E5>:         out[r, c] = fp8(x[r, c] * scale) (round to nearest even, saturated
//   to +-fmt_max: cvt ... satfinite; NaN stays NaN), and when out_t is given its transpose
//   out_t[c, r] too (out may then be null: the transpose alone), through a 64 x 64 byte tile
//   in shared memory: the backward's GEMMs need
//   both layouts (cuBLASLt's FP8 GEMMs take only K-contiguous operands). Rows and columns are
//   multiples of 16 (the launcher checks): every 4-byte group is whole.
// Guessed scaling (fp8_cast_amax, fp8_scale_check, fp8_recast): the cast runs with the scale a
//   tensor of the same site had last time (guess[0]) and takes the tensor's amax in the same
//   pass (an atomic max of its bits, order-independent); the check computes the true scale as
//   fp8_scale_finish does, and where it differs from the guess the recast casts again with it,
//   so the bytes are those of current scaling either way. state[0] holds the amax bits (reset
//   to 0 by the check), state[1] the flag "the guess missed", state[2] and state[3] count the
//   checks and the misses (uint32).
// Max is order-independent, so every result is deterministic.

__device__ __forceinline__ float nan_max(float m, float v) { return (v > m || v != v) ? v : m; }

__device__ __forceinline__ float warp_nan_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float block_nan_max(float v, float* red, int tid, int nthreads) {
    const int lane = tid & 31, warp = tid >> 5, nwarps = (nthreads + 31) >> 5;
    v = warp_nan_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nwarps ? red[lane] : 0.0f;
    return warp_nan_max(v);
}

template <typename S, int V>
__global__ void __launch_bounds__(256) fp8_amax_partial(const S* __restrict__ x, i64 n,
                                                       float* __restrict__ part) {
    __shared__ float red[32];
    const i64 npacks = n / V, tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    float m = 0.0f;
    for (i64 p = tid; p < npacks; p += (i64)gridDim.x * blockDim.x) {
        float v[V];
        vload(x + p * V, v);
#pragma unroll
        for (int k = 0; k < V; k++) m = nan_max(m, fabsf(v[k]));
    }
    if (V > 1) {
        for (i64 i = npacks * V + tid; i < n; i += (i64)gridDim.x * blockDim.x) {
            float v[1];
            vload(x + i, v);
            m = nan_max(m, fabsf(v[0]));
        }
    }
    m = block_nan_max(m, red, threadIdx.x, blockDim.x);
    if (threadIdx.x == 0) part[blockIdx.x] = m;
}

// (1 / scale, scale) of amax m for a format whose largest value is 0.875 * 2^max_exp.
__device__ __forceinline__ void scale_of(float m, int max_exp, float& inv, float& scale) {
    if (!(m <= 3.402823466e38f)) {  // inf or NaN
        scale = inv = __int_as_float(0x7fc00000);
    } else if (m == 0.0f) {
        scale = inv = 1.0f;
    } else {
        int e;
        const float mant = frexpf(m, &e);  // m = mant * 2^e, mant in [0.5, 1)
        const int s = max_exp - e - (mant > 0.875f ? 1 : 0);
        scale = ldexpf(1.0f, s);
        inv = ldexpf(1.0f, -s);
    }
}

__global__ void __launch_bounds__(1024) fp8_scale_finish(const float* __restrict__ part,
                                                        int n_parts, int max_exp,
                                                        float* __restrict__ out) {
    __shared__ float red[32];
    float m = 0.0f;
    for (int i = threadIdx.x; i < n_parts; i += blockDim.x) m = nan_max(m, part[i]);
    m = block_nan_max(m, red, threadIdx.x, blockDim.x);
    if (threadIdx.x != 0) return;
    float scale, inv;
    scale_of(m, max_exp, inv, scale);
    out[0] = inv;
    out[1] = scale;
    out[2] = m;
}

// One thread: the true scales of the amax the guessed cast took (state[0], then reset), the
// flag for fp8_recast, the counters, and the guess for next time (a finite scale only).
__global__ void fp8_scale_check(unsigned* __restrict__ state, int max_exp,
                                float* __restrict__ out, float* __restrict__ guess) {
    const float m = __uint_as_float(state[0]);
    state[0] = 0u;
    float scale, inv;
    scale_of(m, max_exp, inv, scale);
    out[0] = inv;
    out[1] = scale;
    out[2] = m;
    const unsigned miss = scale == guess[0] ? 0u : 1u;  // a NaN scale always misses
    state[1] = miss;
    state[2] += 1u;
    state[3] += miss;
    if (scale == scale) guess[0] = scale;
}

// Four fp32 values -> four FP8 bytes in memory order (cvt packs its first source in the high byte).
// Before sm_89 there is no FP8 cvt: the module still compiles (precompile builds every module on
// every GPU) and the cast traps; the launchers refuse such devices first (fp8.require_fp8).
template <int E5>
__device__ __forceinline__ unsigned pack_fp8x4(const float (&f)[4]) {
    unsigned short lo = 0, hi = 0;
#if __CUDA_ARCH__ < 890
    __trap();
#else
    if (E5) {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(f[1]), "f"(f[0]));
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(f[3]), "f"(f[2]));
    } else {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(f[1]), "f"(f[0]));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(f[3]), "f"(f[2]));
    }
#endif
    return (unsigned)lo | ((unsigned)hi << 16);
}

__device__ __forceinline__ void load4(const bf16* p, float (&f)[4]) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    unpack_bf16x2(u.x, f[0], f[1]);
    unpack_bf16x2(u.y, f[2], f[3]);
}
__device__ __forceinline__ void load4(const float* p, float (&f)[4]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
}

#define FP8_TILE 64

// One 64 x 64 tile at (r0, c0) by a 16 x 16 block: out (and, through `tile`, out_t) from
// x * scale; returns the block's largest |x| (NaN wins) when AMAX, else 0. Every thread of the
// block must call it (it synchronises when out_t or AMAX asks).
template <typename S, int E5, bool AMAX>
__device__ __forceinline__ float cast_tile(const S* __restrict__ x, float scale,
                                           unsigned char* __restrict__ out,
                                           unsigned char* __restrict__ out_t, int rows,
                                           int cols, int r0, int c0,
                                           unsigned char (*tile)[FP8_TILE + 4], float* red) {
    const int tx = threadIdx.x, ty = threadIdx.y;  // (16, 16)
    const int c = c0 + 4 * tx;
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = r0 + ty + 16 * i;
        if (r < rows && c < cols) {
            float f[4];
            load4(x + (i64)r * cols + c, f);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if (AMAX) m = nan_max(m, fabsf(f[k]));
                f[k] *= scale;
            }
            const unsigned packed = pack_fp8x4<E5>(f);
            if (out) *reinterpret_cast<unsigned*>(out + (i64)r * cols + c) = packed;
            if (out_t) *reinterpret_cast<unsigned*>(&tile[ty + 16 * i][4 * tx]) = packed;
        }
    }
    if (AMAX) m = block_nan_max(m, red, ty * 16 + tx, 256);  // synchronises the tile too
    if (!out_t) return m;  // uniform over the block
    if (!AMAX) __syncthreads();
    const int r = r0 + 4 * tx;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int cc = c0 + ty + 16 * i;
        if (cc < cols && r < rows) {
            const int j = ty + 16 * i;
            const unsigned packed = (unsigned)tile[4 * tx][j] | ((unsigned)tile[4 * tx + 1][j] << 8)
                                    | ((unsigned)tile[4 * tx + 2][j] << 16)
                                    | ((unsigned)tile[4 * tx + 3][j] << 24);
            *reinterpret_cast<unsigned*>(out_t + (i64)cc * rows + r) = packed;
        }
    }
    __syncthreads();  // the tile is free for the block's next one (fp8_recast's loop)
    return m;
}

template <typename S, int E5>
__global__ void __launch_bounds__(256) fp8_cast(const S* __restrict__ x,
                                               const float* __restrict__ scale_ptr,  // scales
                                               unsigned char* __restrict__ out,
                                               unsigned char* __restrict__ out_t,
                                               int rows, int cols) {
    __shared__ unsigned char tile[FP8_TILE][FP8_TILE + 4];
    cast_tile<S, E5, false>(x, scale_ptr[1], out, out_t, rows, cols, blockIdx.y * FP8_TILE,
                            blockIdx.x * FP8_TILE, tile, nullptr);
}

// The guessed cast: fp8_cast with guess[0] as the scale, and the amax into state[0].
template <typename S, int E5>
__global__ void __launch_bounds__(256) fp8_cast_amax(const S* __restrict__ x,
                                                    const float* __restrict__ guess,
                                                    unsigned char* __restrict__ out,
                                                    unsigned char* __restrict__ out_t,
                                                    int rows, int cols,
                                                    unsigned* __restrict__ state) {
    __shared__ unsigned char tile[FP8_TILE][FP8_TILE + 4];
    __shared__ float red[32];
    const float m = cast_tile<S, E5, true>(x, guess[0], out, out_t, rows, cols,
                                           blockIdx.y * FP8_TILE, blockIdx.x * FP8_TILE, tile,
                                           red);
    // |x| bits order as the values do, a NaN's above inf's: the largest bits are the amax
    if (threadIdx.x == 0 && threadIdx.y == 0) atomicMax(state, __float_as_uint(m));
}

// The cast again with the true scale (scales[1]), only where the check flagged a miss
// (state[1]); a grid-stride loop over the tiles, so a hit costs a few small blocks.
template <typename S, int E5>
__global__ void __launch_bounds__(256) fp8_recast(const S* __restrict__ x,
                                                 const float* __restrict__ scale_ptr,
                                                 unsigned char* __restrict__ out,
                                                 unsigned char* __restrict__ out_t,
                                                 int rows, int cols,
                                                 const unsigned* __restrict__ state) {
    if (state[1] == 0u) return;
    __shared__ unsigned char tile[FP8_TILE][FP8_TILE + 4];
    const int tiles_c = (cols + FP8_TILE - 1) / FP8_TILE;
    const int tiles = tiles_c * ((rows + FP8_TILE - 1) / FP8_TILE);
    const float scale = scale_ptr[1];
    for (int t = blockIdx.x; t < tiles; t += gridDim.x)
        cast_tile<S, E5, false>(x, scale, out, out_t, rows, cols, (t / tiles_c) * FP8_TILE,
                                (t % tiles_c) * FP8_TILE, tile, nullptr);
}
