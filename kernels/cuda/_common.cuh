// Shared device helpers for every kernels/cuda/*.cu: bf16 <-> fp32 conversion, 16-byte vector
// loads and stores that widen to fp32 registers, and warp/block sum and max reductions.
// The launcher (kernels/cuda/_build.py) pastes this text in front of each .cu source before
// NVRTC compiles it, so no CUDA header is needed (NVRTC on the GPU image may not find
// cuda_bf16.h). bf16 here is a plain 16-bit storage type with the same bytes as
// ml_dtypes.bfloat16; arithmetic is always fp32. Conversions round to nearest even, like
// ml_dtypes' astype, through the sm_80+ cvt instructions.

typedef long long i64;
#define NEG_INF __int_as_float(0xff800000)

struct __align__(2) bf16 {
    unsigned short x;
};

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __uint_as_float(((unsigned)v.x) << 16); }

template <typename T> __device__ __forceinline__ T from_f(float f);
template <> __device__ __forceinline__ float from_f<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float f) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
    return r;
}

// Two fp32 values -> one 32-bit word of two bf16 (lo in the low half, as memory order wants).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ void unpack_bf16x2(unsigned w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}

// vload / vstore: V consecutive elements at p (16-byte aligned when V == 8) <-> float[V].
__device__ __forceinline__ void vload(const bf16* p, float (&f)[8]) {
    uint4 u = *reinterpret_cast<const uint4*>(p);
    unpack_bf16x2(u.x, f[0], f[1]);
    unpack_bf16x2(u.y, f[2], f[3]);
    unpack_bf16x2(u.z, f[4], f[5]);
    unpack_bf16x2(u.w, f[6], f[7]);
}
__device__ __forceinline__ void vload(const float* p, float (&f)[8]) {
    float4 a = reinterpret_cast<const float4*>(p)[0];
    float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void vload(const bf16* p, float (&f)[1]) { f[0] = to_f(*p); }
__device__ __forceinline__ void vload(const float* p, float (&f)[1]) { f[0] = *p; }

__device__ __forceinline__ void vstore(bf16* p, const float (&f)[8]) {
    uint4 u;
    u.x = pack_bf16x2(f[0], f[1]);
    u.y = pack_bf16x2(f[2], f[3]);
    u.z = pack_bf16x2(f[4], f[5]);
    u.w = pack_bf16x2(f[6], f[7]);
    *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ void vstore(float* p, const float (&f)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void vstore(bf16* p, const float (&f)[1]) { *p = from_f<bf16>(f[0]); }
__device__ __forceinline__ void vstore(float* p, const float (&f)[1]) { *p = f[0]; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block, returned to every thread. `red` is >= 32 floats of shared memory; the
// leading barrier makes it safe to call several times in a row with the same buffer.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nwarps ? red[lane] : 0.0f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nwarps ? red[lane] : NEG_INF;
    return warp_max(v);
}
