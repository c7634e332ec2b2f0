// The FP8-stored frozen base's dequantisation (docs/lora.md, `--lora-base fp8`); truth
// dataflow.kernels.reference.fp8_base.fp8_base_dequant, matched bit for bit.
//
// fp8_base_dequant_kernel<V>: out[r, c] = bf16(e4m3(codes[r, c]) * scales[r]) for an (R, C)
//   weight: codes uint8 (E4M3 bits, float8_e4m3fn: no infinities, S.1111.111 is NaN), scales
//   fp32 per row, out bf16. The decode is exact (by hand from the bits: no cuda_fp8.h, which
//   NVRTC on the GPU image may not find), the product one fp32 multiply (__fmul_rn), rounded
//   once to nearest even (cvt.rn.bf16.f32, _common.cuh). Grid-stride loop over packs of V
//   consecutive elements of one row (V = 4 when C % 4 == 0 and codes / out are 4 / 8-byte
//   aligned, else 1); 64-bit indices. Launch: flat grid of 256-thread blocks.

__device__ __forceinline__ float e4m3_to_f(unsigned b) {
    const unsigned s = (b >> 7) & 1u, e = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (e == 0u) {
        v = (float)m * 0.001953125f;                    // subnormal: m / 8 * 2^-6 = m * 2^-9
    } else if (e == 15u && m == 7u) {
        v = __int_as_float(0x7fc00000);                 // the format's one NaN
    } else {
        v = __uint_as_float(((e + 120u) << 23) | (m << 20));  // (1 + m / 8) * 2^(e - 7)
    }
    return s ? -v : v;
}

template <int V>
__global__ void __launch_bounds__(256) fp8_base_dequant_kernel(
        const unsigned char* __restrict__ codes, const float* __restrict__ scales,
        bf16* __restrict__ out, i64 rows, i64 cols) {
    const i64 npacks = rows * cols / V;
    for (i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x; p < npacks;
         p += (i64)gridDim.x * blockDim.x) {
        const i64 at = p * V;
        const float s = scales[at / cols];
        if (V == 4) {
            const unsigned w = *reinterpret_cast<const unsigned*>(codes + at);
            uint2 o;
            o.x = pack_bf16x2(__fmul_rn(e4m3_to_f(w & 255u), s),
                              __fmul_rn(e4m3_to_f((w >> 8) & 255u), s));
            o.y = pack_bf16x2(__fmul_rn(e4m3_to_f((w >> 16) & 255u), s),
                              __fmul_rn(e4m3_to_f(w >> 24), s));
            *reinterpret_cast<uint2*>(out + at) = o;
        } else {
            out[at] = from_f<bf16>(__fmul_rn(e4m3_to_f(codes[at]), s));
        }
    }
}
