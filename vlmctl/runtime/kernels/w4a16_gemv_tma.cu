// w4a16_gemv_tma: the batch-1 CUDA GEMV (w4a16_gemv in w4a16_mma.cu, compiled before this file) with its weight
// stream taken off the registers: every warp's rows are copied into shared memory by one bulk copy (the TMA
// engine), issued when the block starts and before the PDL wait, so each block has all of its weight bytes in
// flight at once and the warps' loads no longer wait behind their arithmetic. Measurement kernel of session 37
// (benchmarks/w4a16_gemv_tma_gpu.py): the H200 ablation found the GEMV's loads alone reaching 3.9 TB/s and its
// arithmetic costing 0.24 ms of the 128 linears' 1.35 because the loads are issued behind it.
//
// Block: NW warps of RPW weight rows each; warp w's rows [row0, row0 + RPW) lie contiguous in the packed weight
// (K / 2 bytes a row), so one bulk copy brings them to the warp's own slice of shared memory, completing on the
// warp's own mbarrier (no block barrier anywhere). Rows past N are not copied, read the last copied row and are
// not stored. Lanes walk K in 16-byte chunks as w4a16_gemv does (lane c: chunks c, c + 32, ...; a warp reads 512
// contiguous bytes of a row from shared memory per load, conflict-free), with that kernel's arithmetic
// (gemv_chunk); scales, zero points and x come from global memory, the next chunk's loaded while one is computed.
// ACT >= 0: a gate_up weight with w4a16_gemv's act·mul epilogue; a warp's RPW / 2 gate rows and their up rows
// (N / 2 below) come by two bulk copies on its barrier.
// Dynamic shared memory: 8 * TMA_MAX_TRIPS bytes of mbarriers per warp (rounded to 128), then NW * RPW * K / 2 bytes.

__device__ __forceinline__ void tma_bar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
}

__device__ __forceinline__ void tma_fence_init() {  // the barrier's initialization seen by the copy engine
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void tma_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tma_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void tma_wait(u32 bar) {  // phase 0 of the warp's barrier: its rows have landed
    u32 done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar) : "memory");
    }
}

__device__ __forceinline__ u32x4 tma_lds16(u32 addr) {
    u32x4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

template <int RPW>
struct TmaGemvChunk {
    u32 s[RPW], z[RPW];  // each row's scale bits and zero point for the chunk's group
    u32x4 x[4];          // the chunk's 32 activations
};

template <int RPW, int G>
__device__ __forceinline__ void tma_gemv_load(TmaGemvChunk<RPW>& q, const u16* const (&srow)[RPW],
                                              const u8* const (&zrow)[RPW], const u16* xr, int c) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        q.s[r] = srow[r][(c * 32) / G];
        q.z[r] = zrow[r][(c * 32) / G];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) q.x[j] = ld_act16(xr + 32 * c + 8 * j);
}

// PIPE (session 37's second version): each row comes as one bulk copy per trip of the lanes (32 chunks, 512 bytes),
// each trip completing on its own mbarrier, so a warp computes its first trip as soon as that lands while the rest
// stream in (PIPE = 0: one copy of the warp's rows on one barrier, the first version).
constexpr int TMA_MAX_TRIPS = 32;  // K up to 32 * 32 * 32 = 32768

template <int RPW, int NW, int G, int ACT = -1, int PIPE = 1>
__global__ void __launch_bounds__(NW * 32)
w4a16_gemv_tma(const u16* x, const u32* __restrict__ qw, const u16* __restrict__ sc, const u8* __restrict__ zp,
               const u16* __restrict__ bias, u16* __restrict__ y, int N, int K, int ldx, int has_bias) {
    extern __shared__ __align__(128) unsigned char tma_smem[];
    pdl_release();
    constexpr int H = ACT < 0 ? RPW : RPW / 2;  // output rows a warp (ACT >= 0: gate rows, and their up rows)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * NW + warp) * H;
    const int rows = min(H, (ACT < 0 ? N : N / 2) - row0);  // output rows of this warp that exist (<= 0: none)
    const u32 row_bytes = (u32)K / 2;
    const int KC = K >> 5, KG = K / G;
    const int trips = PIPE ? (KC + 31) / 32 : 1;
    const u32 bars = smem_addr(tma_smem) + 8 * TMA_MAX_TRIPS * warp;  // the warp's barriers, one a trip
    const u32 tile = smem_addr(tma_smem) + ((8 * TMA_MAX_TRIPS * NW + 127) & ~127) + warp * RPW * row_bytes;
    constexpr int HALVES = ACT < 0 ? 1 : 2;
    if (rows > 0) {
        if (lane == 0) {
            for (int t = 0; t < trips; ++t) {
                const u32 bytes = PIPE ? 16u * (u32)min(32, KC - 32 * t) : row_bytes;
                tma_bar_init(bars + 8 * t);
                tma_fence_init();
                tma_expect(bars + 8 * t, HALVES * rows * bytes);
            }
        }
        __syncwarp();
        if (PIPE) {  // lane i: copies i, i + 32, ... of (half, row, trip)
            for (int i = lane; i < HALVES * rows * trips; i += 32) {
                const int t = i % trips, rr = i / trips, half = rr / rows, r = rr % rows;
                const u32 bytes = 16u * (u32)min(32, KC - 32 * t);
                const size_t src_row = (size_t)row0 + r + (half ? N / 2 : 0);
                tma_copy(tile + (half * H + r) * row_bytes + 512u * t,
                         reinterpret_cast<const unsigned char*>(qw + src_row * (K >> 3)) + 512u * t, bytes, bars + 8 * t);
            }
        } else if (lane == 0) {
            tma_copy(tile, qw + (size_t)row0 * (K >> 3), rows * row_bytes, bars);
            if constexpr (ACT >= 0)  // the up rows, N / 2 below, into the tile's second half
                tma_copy(tile + H * row_bytes, qw + (size_t)(row0 + N / 2) * (K >> 3), rows * row_bytes, bars);
        }
    }
    const u16* srow[RPW];
    const u8* zrow[RPW];
    u32 slot[RPW];  // where row slot r lies in shared memory: slots past the warp's rows read its last row
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int n = gemv_weight_row<RPW, ACT>(row0, r, N);
        srow[r] = sc + (size_t)n * KG;
        zrow[r] = zp + (size_t)n * KG;
        const int i = r % H, half = r / H;
        slot[r] = tile + (half * H + min(i, max(rows, 1) - 1)) * row_bytes;
    }
    const u16* xr = x + (size_t)blockIdx.y * ldx;
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
    pdl_wait();
    if (rows > 0) {
        TmaGemvChunk<RPW> a, b;
        if (lane < KC) tma_gemv_load<RPW, G>(a, srow, zrow, xr, lane);
        int trip = 0;
        for (int c = lane; c < KC; c += 64, trip += 2) {  // two trips per loop: a and b take turns
            if (c + 32 < KC) tma_gemv_load<RPW, G>(b, srow, zrow, xr, c + 32);
            tma_wait(bars + 8 * (PIPE ? trip : 0));
#pragma unroll
            for (int r = 0; r < RPW; ++r) gemv_chunk(acc[r], tma_lds16(slot[r] + 16 * c), a.s[r], a.z[r], a.x);
            if (c + 32 >= KC) break;
            if (c + 64 < KC) tma_gemv_load<RPW, G>(a, srow, zrow, xr, c + 64);
            if (PIPE) tma_wait(bars + 8 * (trip + 1));
#pragma unroll
            for (int r = 0; r < RPW; ++r)
                gemv_chunk(acc[r], tma_lds16(slot[r] + 16 * (c + 32)), b.s[r], b.z[r], b.x);
        }
    }
    gemv_store_rows<RPW, ACT>(acc, lane, row0, N, bias, has_bias, y + (size_t)blockIdx.y * (ACT < 0 ? N : N / 2));
}
