// Grouped expert GEMMs (kernels/cuda/moe_grouped.py): every expert of a layer in one launch, the
// experts' row ranges read from `offsets` (N + 1 int64) in device memory, so nothing waits for
// the host. bf16 operands, fp32 accumulation (mma.sync m16n8k16), one rounding at the store.
//
// The tile: 128 x 256 outputs a CTA, K in steps of 64 through a 3-stage cp.async pipeline
// (48 KiB a stage, 144 KiB of dynamic shared memory), 8 warps as 2 x 4, each 64 x 64 outputs
// (4 x 8 mma tiles: 8 ldmatrix.x4 feed 32 mma per k16 step). Shared tiles keep the global
// layout (16-byte chunks copied as they are) with the chunk index XORed by (row & 7), so the 8
// rows an ldmatrix phase reads fall in 8 different bank groups; an operand stored K-major is
// read with ldmatrix, one stored M- or N-major with ldmatrix.trans.
//
// rows_kernel: out rows of expert e (offsets[e] .. offsets[e+1]) = A rows @ op(B_e); the CTA's
//   row tile is found by a warp scan of the experts' tile counts (grid.y is an upper bound:
//   ceil(R / 128) + N tiles; the spare CTAs return at once). A is (R, K) K-major; B_e is
//   (N, K) K-major (B_KC: y = x @ W^T) or (K, N) N-major (y = x @ W). TWO_SEGS sums
//   A0 @ B0_e + A1 @ B1_e in one accumulator (the input gradient of gate and up); otherwise
//   grid.z picks problem z (gate and up in one launch).
// k_kernel: C_e (+)= A_e^T @ B_e over the expert's rows (the weight gradients): A_e (rows, M)
//   and B_e (rows, N) both row-major, so both are read transposed; grid.z = expert * nprob +
//   problem; an expert with no rows returns (its gradient untouched, as the loop path).

#define GB_BM 128
#define GB_BN 256
#define GB_BK 64
#define GB_STAGES 3
#define GB_THREADS 256
#define GB_A_ELEMS (GB_BM * GB_BK)
#define GB_B_ELEMS (GB_BN * GB_BK)

typedef unsigned long long u64;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

__device__ __forceinline__ void ldm_x4(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldm_x4_t(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element offset of 16-byte chunk c of row `row` in a shared tile whose rows hold RC chunks.
template <int RC> __device__ __forceinline__ int swz(int row, int c) {
    return row * (RC * 8) + ((c ^ (row & 7)) * 8);
}

// One stage's A tile. A_KC: rows m of the tile (global rows row0 + m, valid below `rows`), K
// columns k0 .. k0 + 63. Otherwise (K-major storage transposed): K rows k0 + kr (valid while
// below `rows`), M columns m0 ..  m0 + 127.
template <bool A_KC>
__device__ __forceinline__ void load_a(bf16* sa, const bf16* a, long long lda, long long row0,
                                       int rows, int k0, int m0) {
    const int t = threadIdx.x;
#pragma unroll
    for (int i = 0; i < GB_A_ELEMS / 8 / GB_THREADS; ++i) {
        const int id = t + i * GB_THREADS;
        if (A_KC) {
            const int r = id >> 3, c = id & 7;
            const bool ok = r < rows;
            const bf16* src = a + (ok ? (row0 + r) * lda + k0 + c * 8 : 0);
            cp_async16(smem_u32(sa + swz<8>(r, c)), src, ok);
        } else {
            const int r = id >> 4, c = id & 15;
            const bool ok = k0 + r < rows;
            const bf16* src = a + (ok ? (row0 + k0 + r) * lda + m0 + c * 8 : 0);
            cp_async16(smem_u32(sa + swz<16>(r, c)), src, ok);
        }
    }
}

// One stage's B tile. B_KC: N rows n0 + n of a (N, K) matrix, K columns k0 ..; otherwise K rows
// (row0 + k0 + kr, valid below `rows`) of a (K, N) matrix, N columns n0 .. n0 + 255.
template <bool B_KC>
__device__ __forceinline__ void load_b(bf16* sb, const bf16* b, long long ldb, long long row0,
                                       int rows, int k0, int n0) {
    const int t = threadIdx.x;
#pragma unroll
    for (int i = 0; i < GB_B_ELEMS / 8 / GB_THREADS; ++i) {
        const int id = t + i * GB_THREADS;
        if (B_KC) {
            const int r = id >> 3, c = id & 7;
            cp_async16(smem_u32(sb + swz<8>(r, c)), b + (long long)(n0 + r) * ldb + k0 + c * 8,
                       true);
        } else {
            const int r = id >> 5, c = id & 31;
            const bool ok = k0 + r < rows;
            const bf16* src = b + (ok ? (row0 + k0 + r) * ldb + n0 + c * 8 : 0);
            cp_async16(smem_u32(sb + swz<32>(r, c)), src, ok);
        }
    }
}

// The warp's 64 x 64 products of one shared stage: 4 k16 steps.
template <bool A_KC, bool B_KC>
__device__ __forceinline__ void compute_stage(const bf16* sa, const bf16* sb, int wm, int wn,
                                              float (&acc)[4][8][4]) {
    const int l = threadIdx.x & 31;
#pragma unroll
    for (int kk = 0; kk < GB_BK / 16; ++kk) {
        unsigned af[4][4], bfr[4][4];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
            if (A_KC) {
                const int r = wm * 64 + mi * 16 + (l & 7) + ((l >> 3) & 1) * 8;
                ldm_x4(smem_u32(sa + swz<8>(r, kk * 2 + (l >> 4))), af[mi]);
            } else {
                const int r = kk * 16 + (l & 7) + (l >> 4) * 8;
                ldm_x4_t(smem_u32(sa + swz<16>(r, (wm * 64 + mi * 16) / 8 + ((l >> 3) & 1))),
                         af[mi]);
            }
        }
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
            if (B_KC) {
                const int r = wn * 64 + nj * 16 + (l & 7) + (l >> 4) * 8;
                ldm_x4(smem_u32(sb + swz<8>(r, kk * 2 + ((l >> 3) & 1))), bfr[nj]);
            } else {
                const int r = kk * 16 + (l & 7) + ((l >> 3) & 1) * 8;
                ldm_x4_t(smem_u32(sb + swz<32>(r, (wn * 64 + nj * 16) / 8 + (l >> 4))), bfr[nj]);
            }
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int nj = 0; nj < 4; ++nj) {
                mma16816(acc[mi][2 * nj], af[mi], bfr[nj][0], bfr[nj][1]);
                mma16816(acc[mi][2 * nj + 1], af[mi], bfr[nj][2], bfr[nj][3]);
            }
    }
}

// The expert of row tile `tile` and its first row and row count (e = -1 past the last tile):
// warp 0 scans the experts' tile counts 32 at a time.
__device__ __forceinline__ void find_tile(const i64* offsets, int n_experts, int tile, int* s) {
    if (threadIdx.x == 0) s[0] = -1;
    __syncwarp();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int base = 0;
        for (int e0 = 0; e0 < n_experts; e0 += 32) {
            const int e = e0 + lane;
            long long r0 = 0, r1 = 0;
            int cnt = 0;
            if (e < n_experts) {
                r0 = offsets[e];
                r1 = offsets[e + 1];
                cnt = (int)((r1 - r0 + GB_BM - 1) / GB_BM);
            }
            int inc = cnt;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, inc, d);
                if (lane >= d) inc += v;
            }
            const int start = base + inc - cnt;
            if (cnt && tile >= start && tile < start + cnt) {
                const long long first = r0 + (long long)(tile - start) * GB_BM;
                s[0] = e;
                s[1] = (int)first;
                s[2] = (int)min((long long)GB_BM, r1 - first);
            }
            base += __shfl_sync(0xffffffffu, inc, 31);
        }
    }
    __syncthreads();
}

template <bool B_KC, bool TWO_SEGS>
__global__ void __launch_bounds__(GB_THREADS, 1) grouped_rows_kernel(
    const i64* __restrict__ offsets, int n_experts, u64 a0p, u64 a1p, u64 b0p, u64 b1p, u64 c0p,
    u64 c1p, long long b_estride, int lda, int ldb, int ldc, int k) {
    extern __shared__ __align__(128) unsigned char gb_smem[];
    __shared__ int s_tile[3];
    find_tile(offsets, n_experts, blockIdx.y, s_tile);
    const int e = s_tile[0];
    if (e < 0) return;
    const long long row0 = s_tile[1];
    const int rows = s_tile[2];
    const int z = TWO_SEGS ? 0 : blockIdx.z;
    const bf16* a_seg[2] = {reinterpret_cast<const bf16*>(TWO_SEGS || z == 0 ? a0p : a1p),
                            reinterpret_cast<const bf16*>(a1p)};
    const bf16* b_seg[2] = {reinterpret_cast<const bf16*>(z == 0 ? b0p : b1p) + e * b_estride,
                            reinterpret_cast<const bf16*>(b1p) + e * b_estride};
    bf16* c = reinterpret_cast<bf16*>(z == 0 ? c0p : c1p);
    const int n0 = blockIdx.x * GB_BN;
    bf16* sa = reinterpret_cast<bf16*>(gb_smem);
    bf16* sb = sa + GB_STAGES * GB_A_ELEMS;
    const int kt_seg = k / GB_BK;
    const int kt_all = TWO_SEGS ? 2 * kt_seg : kt_seg;

    auto load = [&](int stage, int kt) {
        const int seg = kt >= kt_seg ? 1 : 0;
        const int k0 = (kt - seg * kt_seg) * GB_BK;
        load_a<true>(sa + stage * GB_A_ELEMS, a_seg[seg], lda, row0, rows, k0, 0);
        load_b<B_KC>(sb + stage * GB_B_ELEMS, b_seg[seg], ldb, 0, 1 << 30, k0, n0);
    };
    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;
#pragma unroll
    for (int s = 0; s < GB_STAGES - 1; ++s) {
        if (s < kt_all) load(s, s);
        cp_commit();
    }
    const int warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
    for (int kt = 0; kt < kt_all; ++kt) {
        cp_wait<GB_STAGES - 2>();
        __syncthreads();
        const int next = kt + GB_STAGES - 1;
        if (next < kt_all) load(next % GB_STAGES, next);
        cp_commit();
        const int st = kt % GB_STAGES;
        compute_stage<true, B_KC>(sa + st * GB_A_ELEMS, sb + st * GB_B_ELEMS, wm, wn, acc);
    }
    cp_wait<0>();
    const int l = threadIdx.x & 31, g = l >> 2, t4 = l & 3;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * 64 + mi * 16 + g + h * 8;
            if (r >= rows) continue;
            unsigned* out = reinterpret_cast<unsigned*>(c + (row0 + r) * ldc + n0 + wn * 64 + t4 * 2);
#pragma unroll
            for (int ni = 0; ni < 8; ++ni)
                out[ni * 4] = pack_bf16x2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
}

template <typename OutT> __device__ __forceinline__ void store_pair(OutT* p, float x, float y,
                                                                    bool accumulate);
template <> __device__ __forceinline__ void store_pair<float>(float* p, float x, float y,
                                                              bool accumulate) {
    float2* q = reinterpret_cast<float2*>(p);
    if (accumulate) {
        const float2 o = *q;
        x += o.x;
        y += o.y;
    }
    *q = make_float2(x, y);
}
template <> __device__ __forceinline__ void store_pair<bf16>(bf16* p, float x, float y,
                                                             bool accumulate) {
    unsigned* q = reinterpret_cast<unsigned*>(p);
    if (accumulate) {
        float ox, oy;
        unpack_bf16x2(*q, ox, oy);
        x += ox;
        y += oy;
    }
    *q = pack_bf16x2(x, y);
}

template <typename OutT>
__global__ void __launch_bounds__(GB_THREADS, 1) grouped_k_kernel(
    const i64* __restrict__ offsets, int nprob, u64 a0p, u64 a1p, u64 bp, u64 c0p, u64 c1p,
    long long c_estride, int lda, int ldb, int ldc, int accumulate) {
    extern __shared__ __align__(128) unsigned char gb_smem[];
    const int e = blockIdx.z / nprob, z = blockIdx.z % nprob;
    const long long row0 = offsets[e];
    const int rows = (int)(offsets[e + 1] - row0);
    if (rows <= 0) return;
    const bf16* a = reinterpret_cast<const bf16*>(z == 0 ? a0p : a1p);
    const bf16* b = reinterpret_cast<const bf16*>(bp);
    OutT* c = reinterpret_cast<OutT*>(z == 0 ? c0p : c1p) + e * c_estride;
    const int m0 = blockIdx.y * GB_BM, n0 = blockIdx.x * GB_BN;
    bf16* sa = reinterpret_cast<bf16*>(gb_smem);
    bf16* sb = sa + GB_STAGES * GB_A_ELEMS;
    const int kt_all = (rows + GB_BK - 1) / GB_BK;
    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;
#pragma unroll
    for (int s = 0; s < GB_STAGES - 1; ++s) {
        if (s < kt_all) {
            load_a<false>(sa + s * GB_A_ELEMS, a, lda, row0, rows, s * GB_BK, m0);
            load_b<false>(sb + s * GB_B_ELEMS, b, ldb, row0, rows, s * GB_BK, n0);
        }
        cp_commit();
    }
    const int warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
    for (int kt = 0; kt < kt_all; ++kt) {
        cp_wait<GB_STAGES - 2>();
        __syncthreads();
        const int next = kt + GB_STAGES - 1;
        if (next < kt_all) {
            const int st = next % GB_STAGES;
            load_a<false>(sa + st * GB_A_ELEMS, a, lda, row0, rows, next * GB_BK, m0);
            load_b<false>(sb + st * GB_B_ELEMS, b, ldb, row0, rows, next * GB_BK, n0);
        }
        cp_commit();
        const int st = kt % GB_STAGES;
        compute_stage<false, false>(sa + st * GB_A_ELEMS, sb + st * GB_B_ELEMS, wm, wn, acc);
    }
    cp_wait<0>();
    const int l = threadIdx.x & 31, g = l >> 2, t4 = l & 3;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long long r = m0 + wm * 64 + mi * 16 + g + h * 8;
            OutT* out = c + r * ldc + n0 + wn * 64 + t4 * 2;
#pragma unroll
            for (int ni = 0; ni < 8; ++ni)
                store_pair<OutT>(out + ni * 8, acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1],
                                 accumulate != 0);
        }
}
