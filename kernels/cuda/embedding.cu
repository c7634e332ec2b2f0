// Token embedding: a gather forward and a deterministic scatter-add backward. Must match
// kernels/reference/embedding.py (embedding_fwd, embedding_bwd).
//
// embedding_fwd_kernel<U>: out[t, :] = table[ids[t], :], copied as raw units U (uint4 = 16
//   bytes when rows are 16-byte aligned, else unsigned short), bit-exact. An id outside
//   [0, V) cannot raise on the device; its row is filled with all-ones bytes (NaN in bf16 and
//   fp32) so the error shows in the loss instead of reading out of bounds.
// embedding_bwd_kernel<T, W, MAXP>: one block (256 threads) per token t. If ids[t] occurred at
//   an earlier token the block exits; otherwise it is the only block for that id: it walks
//   tokens t.. T-1 in order, gathers those with the same id (ballot compaction in shared
//   memory), sums their dx rows in fp32 registers (MAXP packs of 8 columns per thread), and
//   adds the sum into dtable[id] once. No atomics, no scratch: the result is deterministic and
//   the fp32 sum runs in token order, as np.add.at does. T = dx storage, W = dtable storage
//   (bf16 or float); D % 8 == 0, rows 16-byte aligned. Out-of-range ids are skipped.

template <typename U>
__global__ void __launch_bounds__(256) embedding_fwd_kernel(
    const int* __restrict__ ids, const U* __restrict__ table, U* __restrict__ out,
    int n_tokens, i64 units_per_row, int vocab) {
    const i64 total = (i64)n_tokens * units_per_row;
    U bad;
    unsigned char* bb = reinterpret_cast<unsigned char*>(&bad);
#pragma unroll
    for (int i = 0; i < (int)sizeof(U); i++) bb[i] = 0xff;
    for (i64 u = (i64)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (i64)gridDim.x * blockDim.x) {
        const i64 t = u / units_per_row, c = u % units_per_row;
        const int id = ids[t];
        out[u] = (id >= 0 && id < vocab) ? table[(i64)id * units_per_row + c] : bad;
    }
}

template <typename T, typename W, int MAXP>
__global__ void __launch_bounds__(256) embedding_bwd_kernel(
    const int* __restrict__ ids, const T* __restrict__ dx, W* __restrict__ dtable,
    int n_tokens, int D, int vocab) {
    __shared__ int match[256];
    __shared__ int wcount[8];
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int id = ids[t];
    if (id < 0 || id >= vocab) return;
    for (int c0 = 0; c0 < t; c0 += blockDim.x) {         // an earlier token owns this id?
        const int j = c0 + tid;
        if (__syncthreads_or(j < t && ids[j] == id)) return;
    }
    const int npacks = D / 8;
    float acc[MAXP][8];
#pragma unroll
    for (int i = 0; i < MAXP; i++)
#pragma unroll
        for (int k = 0; k < 8; k++) acc[i][k] = 0.0f;
    for (int c0 = t; c0 < n_tokens; c0 += blockDim.x) {
        const int j = c0 + tid;
        const bool hit = j < n_tokens && ids[j] == id;
        const unsigned b = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) wcount[warp] = __popc(b);
        __syncthreads();
        int off = 0, total = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
            off += w < warp ? wcount[w] : 0;
            total += wcount[w];
        }
        if (hit) match[off + __popc(b & ((1u << lane) - 1u))] = j;
        __syncthreads();
        for (int m = 0; m < total; m++) {
            const i64 row = match[m];
#pragma unroll
            for (int i = 0; i < MAXP; i++) {
                const int p = tid + i * blockDim.x;
                if (p < npacks) {
                    float v[8];
                    vload(dx + row * D + 8 * p, v);
#pragma unroll
                    for (int k = 0; k < 8; k++) acc[i][k] += v[k];
                }
            }
        }
        __syncthreads();                                  // match[] is reused by the next chunk
    }
#pragma unroll
    for (int i = 0; i < MAXP; i++) {
        const int p = tid + i * blockDim.x;
        if (p < npacks) {
            float cur[8];
            W* dst = dtable + (i64)id * D + 8 * p;
            vload(dst, cur);
#pragma unroll
            for (int k = 0; k < 8; k++) cur[k] += acc[i][k];
            vstore(dst, cur);
        }
    }
}
