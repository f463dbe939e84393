// w4a16_wgmma: W4A16 for 17-64 batch rows on Hopper's warpgroup MMA (sm_90a), persistent and stream-K.
//
// Compiled after w4a16_mma.cu's source (its dequantization, cp.async and epilogue helpers), by NVRTC for
// sm_90a. Reads the engine's packed layout unchanged and computes y[M, N] = x[M, K] W^T (+ bias) for
// M <= BMX (32 or 64), fp16 or bf16 in and out (BF16), fp32 accumulation.
//
// y^T = W x^T: the weights are wgmma's A operand, dequantized into registers exactly as in w4a16_mma
// (a lane's A fragment of a 16-k step is (word >> 4t) & 0x000F000F of two words of each of its two rows),
// and x is the B operand, read by the tensor cores from shared memory in the K-major core-matrix layout
// without swizzle (8 x 8 core matrices of 128 bytes: row group rg, 8-k column p at (p * BMX / 8 + rg) * 128).
// One m64nBMXk16 instruction does the work of BMX / 2 mma.sync, so issue is left to the dequantization.
//
// Why this shape: at 32-64 batch rows the mma.sync and Triton kernels were bound by latency and issue,
// not by the 4-bit bytes (docs/benchmarks.md, sessions 6, 7 and 13). Here
// - a block is NWG warpgroups of 64 weight rows each (BN = 64 NWG rows) that share every x tile, so x is
//   re-read from L2 once per BN rows;
// - K is walked in units of 128 (an x tile of BMX x 128 and BN weight rows x 64 bytes) through a
//   STAGES-deep cp.async ring, STAGES - 2 units ahead (~140 KB in flight per SM with 4 warpgroups);
// - the grid is persistent and stream-K: the (tile, unit) space is cut into gridDim.x equal contiguous
//   ranges, so every block has the same number of units whatever N is and there is no tail wave. A
//   range's first and last tiles may be partial: those sums go to the workspace (ws: two BN x BMX fp32
//   slots per block) and the parts are added in block order (deterministic) with the bias: by the blocks
//   whose ranges end in the tile, each a slice of its rows (W4A16_WGMMA_PFIX, the launcher's default), or by
//   the last block to take the tile's ticket alone. A tile a block covers whole is stored directly.
// A warpgroup's wgmmas of one unit run while it waits at the next unit's barrier, issues that unit's
// loads and reads its weight words; it waits for them only before overwriting its A registers, and the
// other warpgroups keep the tensor cores busy meanwhile. A unit's group scales and zero points travel with
// it: loaded by one thread per weight row when its copies are issued, stored into its stage a unit later.

__device__ __forceinline__ unsigned long long wgmma_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16)
           | ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32);  // base offset 0, no swizzle
}

__device__ __forceinline__ void fence_proxy_async() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }

#define W4A16_WGMMA_N32(TY)                                                                                    \
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " "                                 \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "                     \
                 "{%16, %17, %18, %19}, %20, 1, 1, 1, 0;"                                                       \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),         \
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),     \
                   "+f"(d[14]), "+f"(d[15])                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))

#define W4A16_WGMMA_N64(TY)                                                                                    \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                 \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                 "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                                \
                 "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;"                                                       \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),         \
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),     \
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),  \
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),  \
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))

// d[BMX / 2] += A (64 x 16, registers) * B (16 x BMX, shared memory at desc)
template <int BMX, int BF16>
__device__ __forceinline__ void wgmma_step(float* d, const u32 (&a)[4], unsigned long long desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (BMX == 32) {
        if constexpr (BF16) W4A16_WGMMA_N32("bf16"); else W4A16_WGMMA_N32("f16");
    } else {
        if constexpr (BF16) W4A16_WGMMA_N64("bf16"); else W4A16_WGMMA_N64("f16");
    }
#else
    __trap();  // compiled for a GPU without wgmma (the launcher only takes this kernel on sm_90)
#endif
}

template <int BF16>
__device__ __forceinline__ u32 dequant_pair(u32 w, int shift, u32 zf2, u32 s2, u32 sl2) {
    if constexpr (BF16) return dequant2_bf16(w, shift, zf2, s2, sl2);
    else return dequant2(w, shift, zf2, s2);
}

template <int BF16>
__device__ __forceinline__ u16 to_act(float f) {  // fp32 to one fp16 or bf16 value, rounded to nearest
    if constexpr (BF16) return (u16)bf16_bits(f);
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// W4A16_WGMMA_MODE (measurement builds only, benchmarks/w4a16_wgmma_probe.py; results are wrong there):
// 1 issues no wgmma, 2 skips the dequantization (the raw words are the A fragments), 3 leaves out the
// generic-to-async proxy fence before each unit's barrier (so wgmma may read stale x), 4 copies no x tiles,
// 5 no weight tiles, 6 reads the weights from a unit-contiguous layout (qw[tile][unit][BN rows][64 bytes]: correct
// results for such a repacked tensor), 7 copies neither x nor weights, 8 reads tile 0's weights in every block
// (L2-resident weights at any K), 9 stores every segment's sums as if it were a whole tile (no workspace, tickets
// or fix-up: what the stream-K parts cost), 10 copies nothing and issues no wgmma (the loop's issue alone), 11
// copies nothing and skips the dequantization (the wgmmas and the loop's frame). TMA build (session 17): 12 leaves
// out the block barrier of every unit, 13 the scales' loads and stores in the loop, 14 both, 15 both and issues
// no wgmma, 16 both and skips the dequantization.
#define W4A16_WGMMA_NO_X (W4A16_WGMMA_MODE == 4 || W4A16_WGMMA_MODE == 7 || W4A16_WGMMA_MODE == 10 || W4A16_WGMMA_MODE == 11)
#define W4A16_WGMMA_NO_W (W4A16_WGMMA_MODE == 5 || W4A16_WGMMA_MODE == 7 || W4A16_WGMMA_MODE == 10 || W4A16_WGMMA_MODE == 11)
#define W4A16_WGMMA_NO_BAR (W4A16_WGMMA_MODE == 12 || W4A16_WGMMA_MODE >= 14)
#define W4A16_WGMMA_NO_SC (W4A16_WGMMA_MODE >= 13)
#define W4A16_WGMMA_NO_MMA (W4A16_WGMMA_MODE == 1 || W4A16_WGMMA_MODE == 10 || W4A16_WGMMA_MODE == 15)
#define W4A16_WGMMA_NO_DEQ (W4A16_WGMMA_MODE == 2 || W4A16_WGMMA_MODE == 11 || W4A16_WGMMA_MODE == 16)
#ifndef W4A16_WGMMA_MODE
#define W4A16_WGMMA_MODE 0
#endif
// W4A16_WGMMA_TMA 1 (the build that ships, session 16): x and the weight tile of a unit come by the tensor memory
// accelerator (two tensor maps, kernel parameters tmx and tmw, completion on one mbarrier a stage): x as two
// 64-k boxes in the 128-byte swizzled K-major layout wgmma reads, the weights as one box of BN rows x 64 bytes,
// 64-byte swizzled (conflict-free 16-byte reads). 0: the session-15 build (16-byte cp.async from every thread,
// padded rows), kept for the measurement modes: on an H200 its warps waited for the copy unit to take their
// cp.async addresses (Nsight source view), ~1.6x the TMA build's time a unit.
#ifndef W4A16_WGMMA_TMA
#define W4A16_WGMMA_TMA 1
#endif
// W4A16_WGMMA_PFIX 1 (TMA build only; the launcher's default, VLMCTL_W4A16_WGMMA_FIXUP=serial builds 0): the
// stream-K parts summed in parallel by the blocks that end in a tile (pfix_sum); needs a cooperative launch and
// 2 x tiles counters. Bit-equal to the serial fix-up (H200, session 17 r8-r11); the 7B AWQ decode step at 64 rows
// 10.47-10.50 ms with it, 10.73-10.91 with the serial one on the wide shapes only (r9-r10).
#ifndef W4A16_WGMMA_PFIX
#define W4A16_WGMMA_PFIX 0
#endif
// W4A16_WGMMA_PIPE 1 (TMA build only; opt-in, VLMCTL_W4A16_WGMMA_PIPE=1): no block barrier a unit. Correct (bit-equal)
// but no faster: 1.51 us a unit on the one-tile-a-block shape as the default build's 1.50, the decode step level
// (H200, session 17 r9-r10), although leaving out the barrier and the scale traffic (modes 12-14) saved up to 0.3.
// Each warp releases a stage on an "empty" mbarrier once its wgmmas of that unit completed, and the thread that
// issues the TMA copies waits for that before refilling it; each thread loads its own rows' scales and zero
// points from global memory (L1-cached) two units ahead into registers instead of staging them in the ring.
#ifndef W4A16_WGMMA_PIPE
#define W4A16_WGMMA_PIPE 0
#endif
#ifndef W4A16_WGMMA_FX
#define W4A16_WGMMA_FX 4  // parts in flight per thread in the parallel fix-up (8 made ptxas spill in the unit loop)
#endif

struct __align__(64) TensorMap { unsigned long long v[16]; };  // a CUtensorMap, opaque

__device__ __forceinline__ void tma_mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void tma_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tma_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// The parallel fix-up's sum (W4A16_WGMMA_PFIX) for a block whose range ends in `tile`: wait until every block of
// the tile has arrived, then sum this block's slice of the tile's rows over all parts in block order. Run after
// the main loop (a block's last segment is the only one it may sum). Its part loop must not divide in 64 bits:
// with such a division here ptxas moved the main loop's address arithmetic out of uniform registers (~26 more
// vector instructions a unit in the SASS), and the one-tile-a-block shape, where this never runs, took ~10 %
// longer (H200, session 17 r8).
template <int BN, int BMX, int THREADS, int BF16>
__device__ __forceinline__ void pfix_sum(const float* __restrict__ ws, int* __restrict__ cnt, u16* __restrict__ y,
                                      const u16* __restrict__ bias, int has_bias, int M, int N, int tile, int cpt,
                                      int P, long long U, int b_first, int b_last, int b, int tid) {
    const int r_last = (int)(U * (b_last + 1) / P - 1) / cpt == tile ? b_last : b_last - 1;
    const int R = r_last - b_first + 1, ri = b - b_first;
    if (tid == 0) {
        const u32 want = (u32)(b_last - b_first + 1);
        for (;;) {
            u32 got;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(got) : "l"(cnt + tile) : "memory");
            if (got >= want) break;
            __nanosleep(64);
        }
    }
    __syncthreads();
    fence_gpu();
    // the part of block bb in the tile: its first segment's slot (0), but for b_first when it started in an
    // earlier tile (its last segment's, 1); computed once: a 64-bit division in the loop below cost the kernel's
    // main loop its uniform registers (SASS, session 17)
    const int first_slot = (int)(U * b_first / P) / cpt == tile ? 0 : 1;
    constexpr int FX = W4A16_WGMMA_FX;
    const int lo4 = (BN / 4) * ri / R, n4 = (BN / 4) * (ri + 1) / R - lo4, mm = min(M, BMX);
    for (int e = tid; e < n4 * mm; e += THREADS) {
        const int m = e / n4, r = (lo4 + e % n4) * 4;
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int c0 = b_first; c0 <= b_last; c0 += FX) {  // FX parts' loads in flight, summed in order
            float4 v[FX];
#pragma unroll
            for (int i = 0; i < FX; ++i) {
                const int bb = c0 + i;
                if (bb <= b_last) {
                    const float* pp = ws + (long long)(bb * 2 + (bb == b_first ? first_slot : 0)) * BN * BMX + m * BN + r;
                    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                                 : "=f"(v[i].x), "=f"(v[i].y), "=f"(v[i].z), "=f"(v[i].w) : "l"(pp));
                }
            }
#pragma unroll
            for (int i = 0; i < FX; ++i)
                if (c0 + i <= b_last) {
                    sum.x += v[i].x;
                    sum.y += v[i].y;
                    sum.z += v[i].z;
                    sum.w += v[i].w;
                }
        }
        const float sv[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int n = tile * BN + r + i;
            if (n < N) y[(long long)m * N + n] = to_act<BF16>(sv[i] + (has_bias ? act_to_float<BF16>(bias[n]) : 0.f));
        }
    }
    __syncthreads();
    if (tid == 0) {  // the last of the tile's summing blocks resets its two counters for the next launch
        int* done = cnt + (N + BN - 1) / BN + tile;
        int got;
        asm volatile("atom.global.add.u32 %0, [%1], 1;" : "=r"(got) : "l"(done));
        if (got == R - 1) {
            cnt[tile] = 0;
            *done = 0;
        }
    }
}

template <int NWG, int BMX, int STAGES, int G, int BF16>
__global__ void __launch_bounds__(NWG * 128, 1)
w4a16_wgmma(const u16* __restrict__ x, const u32* __restrict__ qw, const u16* __restrict__ sc,
            const u8* __restrict__ zp, const u16* __restrict__ bias, u16* __restrict__ y,
            float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int K, int ldx, int has_bias
#if W4A16_WGMMA_TMA
            , const __grid_constant__ TensorMap tmx, const __grid_constant__ TensorMap tmw
#endif
            ) {
    constexpr int KC = 128, PF = STAGES - 2;
    static_assert(BMX == 32 || BMX == 64, "wgmma N of 32 or 64 batch rows");
    static_assert(NWG == 2 || NWG == 4, "two or four warpgroups");
    static_assert(G % 64 == 0 && (G % KC == 0 || KC % G == 0), "a unit holds whole groups or a group whole units");
    static_assert(STAGES >= 5, "scales are stored two units after they are loaded, a unit before they are read");
    constexpr int BN = NWG * 64, THREADS = NWG * 128;
    constexpr int WSW = W4A16_WGMMA_TMA ? KC / 8 : KC / 8 + 4;  // words per weight row in shared memory (+4: conflict-free 16-byte reads; TMA: swizzled)
    constexpr int GPU = KC > G ? KC / G : 1;  // groups in a unit
    // a stage: the x tile, the weight rows, then each row's scale bits | zero point << 16 per group of the unit
    // (TMA: a stage rounded up to 1024 bytes, so every stage's swizzle atoms stay aligned)
    constexpr int X_BYTES = BMX * KC * 2, W_BYTES = BN * WSW * 4,
                  STAGE_BYTES = (X_BYTES + W_BYTES + BN * GPU * 4 + (W4A16_WGMMA_TMA ? 1023 : 0)) / (W4A16_WGMMA_TMA ? 1024 : 1) * (W4A16_WGMMA_TMA ? 1024 : 1);
    constexpr int XP = BMX * (KC / 8) / THREADS, WP = BN * (KC / 32) / THREADS;  // 16-byte pieces per thread
    static_assert(XP * THREADS == BMX * (KC / 8) && WP * THREADS == BN * (KC / 32), "whole pieces per thread");
    static_assert(STAGE_BYTES % 128 == 0, "stages keep the x tiles 128-byte aligned");
    constexpr u32 LBO = BMX * 16, SBO = 128;  // K-adjacent and N-adjacent core matrices
    static_assert(!W4A16_WGMMA_TMA || STAGE_BYTES % 1024 == 0, "TMA: stages keep the 128-byte swizzle atoms aligned");
    extern __shared__ __align__(128) u8 smem[];
#if W4A16_WGMMA_TMA
    __shared__ __align__(8) unsigned long long full_bar[STAGES];
    const u32 bar0 = smem_addr(full_bar);
#endif
    constexpr bool PIPE = W4A16_WGMMA_TMA && W4A16_WGMMA_PIPE;
#if W4A16_WGMMA_TMA && W4A16_WGMMA_PIPE
    __shared__ __align__(8) unsigned long long empty_bar[STAGES];  // a stage's warps done with it (NWG * 4 arrivals)
    const u32 ebar0 = smem_addr(empty_bar);
#endif
    __shared__ int is_last;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = warp * 16 + g;  // this lane's weight rows in a tile: r0 and r0 + 8 (warp w%4 of its group: 16 rows)
    const int kw = K >> 3, kg = K / G, cpt = K / KC;  // units per tile: cpt
    const long long U = (long long)((N + BN - 1) / BN) * cpt;
    const int P = gridDim.x, b = blockIdx.x;
    const int u0 = (int)(U * b / P), u1 = (int)(U * (b + 1) / P);
    // TMA: the ring from the first 1024-byte boundary (the launcher adds 1 KB): swizzle atoms are 1024-aligned
    const u32 smem0 = W4A16_WGMMA_TMA ? (smem_addr(smem) + 1023u) & ~1023u : smem_addr(smem);

    // unit (tile, c): its x tile and weight rows into stage st by cp.async
    auto load_unit = [&](int tile, int c, u32 st) {
        const int k0 = c * KC;
#if W4A16_WGMMA_TMA
        if (tid == 0) {  // st is smem0 + stage * STAGE_BYTES
            const u32 bar = bar0 + (st - smem0) / STAGE_BYTES * 8;
            fence_proxy_async();  // the stage's earlier generic-proxy reads before the async-proxy writes
            tma_expect_tx(bar, X_BYTES + W_BYTES);
            tma_load_2d(st, &tmx, k0, 0, bar);
            tma_load_2d(st + X_BYTES / 2, &tmx, k0 + 64, 0, bar);
            tma_load_2d(st + X_BYTES, &tmw, k0 / 8, tile * BN, bar);
        }
        return;
#endif
#pragma unroll
        for (int q = 0; q < (W4A16_WGMMA_NO_X ? 0 : XP); ++q) {  // x: 16 pieces a row, rows past M zero-filled
            const int i = tid + q * THREADS, r = i >> 4, p = i & 15;
            const bool ok = r < M;
            cp_async16_s(st + (p * (BMX / 8) + (r >> 3)) * 128 + (r & 7) * 16,
                         x + (ok ? (long long)r * ldx : 0) + k0 + p * 8, ok);
        }
#pragma unroll
        for (int q = 0; q < (W4A16_WGMMA_NO_W ? 0 : WP); ++q) {  // weights: 4 pieces a row, rows past N zero-filled
            const int i = tid + q * THREADS, r = i >> 2, p = i & 3;
            const int n = (W4A16_WGMMA_MODE == 8 ? 0 : tile) * BN + r;
            const bool ok = n < N;
            const u32* src = W4A16_WGMMA_MODE == 6 ? qw + ((long long)(tile * cpt + c) * BN + r) * 16 + p * 4
                                                   : qw + (ok ? (long long)n * kw : 0) + k0 / 8 + p * 4;
            cp_async16_s(st + X_BYTES + (r * WSW + p * 4) * 4, src, ok);
        }
    };
    // unit (tile, c)'s scales and zero points: thread r < BN loads row r's (rows past N: row N - 1's), one
    // coalesced pass, into one of two register sets, and stores them into the unit's stage two units later,
    // the last iteration before the stage is read: the store waits for the load, and one unit of work did
    // not cover its latency (every unit then took one load's round trip, H200, session 15).
    // The scale and the zero point stay in separate registers until the store: combined at the load, the
    // combining instruction waited there for the load's whole round trip, every unit (SASS, session 16).
    u32 sv0[2][GPU], sv1[2][GPU];
    auto load_scales = [&](int tile, int c, u32 (&sv)[2][GPU]) {
        if (tid < BN) {
            const long long at = (long long)min(tile * BN + tid, N - 1) * kg + c * KC / G;
#pragma unroll
            for (int i = 0; i < GPU; ++i) {
                sv[0][i] = sc[at + i];
                sv[1][i] = zp[at + i];
            }
        }
    };
    auto store_scales = [&](u32 st, const u32 (&sv)[2][GPU]) {
        if (tid < BN) {
#pragma unroll
            for (int i = 0; i < GPU; ++i)
                asm volatile("st.shared.u32 [%0], %1;" :: "r"(st + X_BYTES + W_BYTES + (i * BN + tid) * 4),
                             "r"(sv[0][i] | (sv[1][i] << 16)));
        }
    };

#if W4A16_WGMMA_TMA
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) tma_mbar_init(bar0 + s * 8, 1);
#if W4A16_WGMMA_PIPE
        for (int s = 0; s < STAGES; ++s) tma_mbar_init(ebar0 + s * 8, NWG * 4);
#endif
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
#endif
    float acc[BMX / 2];
#pragma unroll
    for (int e = 0; e < BMX / 2; ++e) acc[e] = 0.f;
#pragma unroll
    for (int s = 0; s < PF; ++s) {
        if (u0 + s < u1) {
            const int tile = (u0 + s) / cpt;
            load_unit(tile, u0 + s - tile * cpt, smem0 + s * STAGE_BYTES);
            if (!PIPE) {
                load_scales(tile, u0 + s - tile * cpt, sv0);
                store_scales(smem0 + s * STAGE_BYTES, sv0);
            }
        }
        cp_async_commit();
    }
    // the unit PF ahead, whose loads the loop issues: (l_tile, l_c), counted on rather than divided out
    int l_tile = (u0 + PF) / cpt, l_c = u0 + PF - l_tile * cpt;
    u32 st0 = 0, st1 = 0;  // the stages whose scales sv0 / sv1 hold, if held0 / held1
    bool held0 = false, held1 = false;
    // PIPE: this thread's rows' raw scale bits and zero points (rows r0, r0 + 8) of units u (set u & 1) and u + 1,
    // and the unit two ahead whose set the loop loads next: (s_tile, s_c)
    u32 ps0[2][2][GPU], ps1[2][2][GPU];
    auto load_own_scales = [&](int tile, int c, u32 (&ps)[2][2][GPU]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long long at = (long long)min(tile * BN + r0 + 8 * h, N - 1) * kg + c * KC / G;
#pragma unroll
            for (int i = 0; i < GPU; ++i) {
                ps[h][0][i] = sc[at + i];
                ps[h][1][i] = zp[at + i];
            }
        }
    };
    int s_tile = (u0 + 2) / cpt, s_c = u0 + 2 - s_tile * cpt;
    if (PIPE) {  // unit v's in set v & 1 (branches, not a selected reference: the sets stay in registers)
        if (u0 & 1) load_own_scales(u0 / cpt, u0 - u0 / cpt * cpt, ps1);
        else load_own_scales(u0 / cpt, u0 - u0 / cpt * cpt, ps0);
        if (u0 + 1 < u1) {
            if (u0 & 1) load_own_scales((u0 + 1) / cpt, u0 + 1 - (u0 + 1) / cpt * cpt, ps0);
            else load_own_scales((u0 + 1) / cpt, u0 + 1 - (u0 + 1) / cpt * cpt, ps1);
        }
    }

    // a tile's sums out: e = 4j + 2h + c holds weight row r0 + 8h, batch row 8j + 2t + c
    auto store_y = [&](const float (&o)[BMX / 2], int n0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n = n0 + r0 + 8 * h;
            if (n >= N) continue;
            const float bv = has_bias ? act_to_float<BF16>(bias[n]) : 0.f;
#pragma unroll
            for (int j = 0; j < BMX / 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int m = 8 * j + 2 * t + c;
                    if (m < M) y[(long long)m * N + n] = to_act<BF16>(o[4 * j + 2 * h + c] + bv);
                }
        }
    };

    // A segment out: this block's sums for `tile` (ends_tile: up to its last unit). A whole tile is stored; a
    // partial one goes to the workspace, and the last of the tile's blocks to take its ticket adds the parts.
    // Called where every thread of the block is (it has barriers).
    auto flush = [&](int tile, bool ends_tile) {
        wgmma_wait<0>();
        // The sums move to o and acc restarts at zero on a path every thread takes, with every condition
        // computed from u0 and the tile rather than from loop-carried state: where ptxas cannot prove the
        // path uniform it serializes all of the kernel's wgmmas.
        float o[BMX / 2];
#pragma unroll
        for (int e = 0; e < BMX / 2; ++e) {
            asm volatile("" : "+f"(acc[e]) :: "memory");  // reads after the wait
            o[e] = acc[e];
            acc[e] = 0.f;
        }
        if ((tile * cpt >= u0 && ends_tile) || W4A16_WGMMA_MODE == 9) {
            store_y(o, tile * BN);
            return;
        }
        const int slot = tile == u0 / cpt ? 0 : 1;  // a block's first segment, or its last
        float* part = ws + (long long)(b * 2 + slot) * BN * BMX;
#if W4A16_WGMMA_TMA && W4A16_WGMMA_PFIX
        // the blocks whose ranges meet this tile: those holding its first and last units
        const int b_first = (int)((((long long)tile * cpt + 1) * P - 1) / U);
        const int b_last = (int)((((long long)tile + 1) * cpt * P - 1) / U);
        // Parallel fix-up (W4A16_WGMMA_PFIX; the launch must be cooperative: every block resident). The parts are
        // stored batch row major ([BMX][BN]); every block arrives on the tile's ticket; the blocks whose ranges end
        // in this tile (all but a last holder that runs on) wait for every arrival, then each sums a slice of the
        // tile's rows over all parts in block order (deterministic) and stores it; a second counter per tile
        // (cnt[tiles + tile]) counts them done. One block summing every part alone costs 7-14 us a call on an
        // H200 (session 16, the cp.async build without its fix-up).
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < BMX / 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) part[(8 * j + 2 * t + c) * BN + r0 + 8 * h] = o[4 * j + 2 * h + c];
        fence_gpu();
        __syncthreads();
        if (tid == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(cnt + tile) : "memory");
        // the blocks whose ranges end in this tile sum it after the loop (it is their last segment); a block that
        // runs on into later tiles leaves it to them
#else
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < BMX / 8; ++j)
                *reinterpret_cast<f32x2*>(part + (r0 + 8 * h) * BMX + 8 * j + 2 * t) =
                    f32x2{o[4 * j + 2 * h], o[4 * j + 2 * h + 1]};
        // the blocks whose ranges meet this tile: those holding its first and last units
        const int b_first = (int)((((long long)tile * cpt + 1) * P - 1) / U);
        const int b_last = (int)((((long long)tile + 1) * cpt * P - 1) / U);
        fence_gpu();
        __syncthreads();
        if (tid == 0) {
            int got;
            asm volatile("atom.global.add.u32 %0, [%1], 1;" : "=r"(got) : "l"(cnt + tile));
            is_last = got == b_last - b_first;
        }
        __syncthreads();
        if (is_last) {
            fence_gpu();
#pragma unroll
            for (int e = 0; e < BMX / 2; ++e) o[e] = 0.f;
            // b_first's part is its last segment's (slot 1) unless it started in this tile; every later block's is
            // its first segment's (slot 0)
            const int first_slot = (int)(U * b_first / P) / cpt == tile ? 0 : 1;
            for (int bb = b_first; bb <= b_last; ++bb) {  // in block order: the sum does not depend on timing
                const float* pp = ws + (long long)(bb * 2 + (bb == b_first ? first_slot : 0)) * BN * BMX;
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int j = 0; j < BMX / 8; ++j) {
                        const f32x2 v = load_cg_f2(pp + (r0 + 8 * h) * BMX + 8 * j + 2 * t);
                        o[4 * j + 2 * h] += v.x;
                        o[4 * j + 2 * h + 1] += v.y;
                    }
            }
            store_y(o, tile * BN);
            if (tid == 0) cnt[tile] = 0;
        }
#endif
    };

    u32 st = 0, ld_st = PF * STAGE_BYTES;
    // A fragments per 16-k step, (row g, k 2t..), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..), in two
    // halves of a unit: each half's wgmmas are one commit group and run while the next half is dequantized
    u32 a[2][4][4];
    // Per tile segment of the range, then its flush: the loop that issues wgmmas never touches their
    // accumulators otherwise (a conditional flush inside it made ptxas wait for every unit's wgmmas).
    // The ring runs on across segments.
    for (int u = u0; u < u1;) {
      const int tile = u / cpt, seg_end = min(u1, (tile + 1) * cpt);
      for (; u < seg_end; ++u) {
#if W4A16_WGMMA_TMA
        {
            const u32 i = (u32)(u - u0);
            tma_wait(bar0 + (i % STAGES) * 8, (i / STAGES) & 1);
        }
#else
        cp_async_wait<PF - 1>();
#endif
        // the scales loaded two iterations ago (for unit u - 2 + PF) into their stage, in the set this
        // iteration loads into next (u is the same for every thread: no divergence)
        if (W4A16_WGMMA_NO_SC || PIPE) {
        } else if (u & 1) {
            if (held1) store_scales(st1, sv1);
        } else {
            if (held0) store_scales(st0, sv0);
        }
        if (W4A16_WGMMA_MODE != 3 && !PIPE) fence_proxy_async();  // this thread's copies (generic proxy) visible to the wgmmas (async proxy)
        if (!W4A16_WGMMA_NO_BAR && !PIPE) __syncthreads();  // unit u landed; every warpgroup's wgmmas of unit u - 2 completed (waited below)
        // the unit PF ahead into the stage unit u - 2 used (every warpgroup's wgmmas of it completed: the barrier);
        // issued here, before the dequantization (issuing it after the unit's wgmmas was slower or equal, session 16)
        auto issue_next = [&]() {
            const bool more = u + PF < u1;
            if (more) {
#if W4A16_WGMMA_TMA && W4A16_WGMMA_PIPE
                // the stage held unit u - 2: wait until every warp released it (from the third unit on)
                if (tid == 0 && u - u0 >= 2) tma_wait(ebar0 + (ld_st / STAGE_BYTES) * 8, ((u - u0 - 2) / STAGES) & 1);
#endif
                load_unit(l_tile, l_c, smem0 + ld_st);
                if (W4A16_WGMMA_NO_SC || PIPE) {
                } else if (u & 1) {
                    load_scales(l_tile, l_c, sv1);
                    st1 = smem0 + ld_st;
                } else {
                    load_scales(l_tile, l_c, sv0);
                    st0 = smem0 + ld_st;
                }
                if (++l_c == cpt) {
                    l_c = 0;
                    ++l_tile;
                }
            }
            if (u & 1) held1 = more; else held0 = more;
            cp_async_commit();
            ld_st = ld_st + STAGE_BYTES == STAGES * STAGE_BYTES ? 0 : ld_st + STAGE_BYTES;
        };
        issue_next();
        const u32 xc = smem0 + st, wc = smem0 + st + X_BYTES + r0 * WSW * 4;
        // TMA: 16-byte piece q of weight row r sits at piece q ^ ((r >> 1) & 3) (64-byte swizzle); r0 + 8 alike
        const u32 wsz = W4A16_WGMMA_TMA ? (u32)((r0 >> 1) & 3) : 0u;
        u32 zf2[GPU][2], s2[GPU][2], sl2[GPU][2];
        if (PIPE) {
            // unit u's scales, loaded two units ago; then the set takes unit u + 2's
            auto take = [&](u32 (&ps)[2][2][GPU]) {
#pragma unroll
                for (int i = 0; i < GPU; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) group_consts<BF16>(ps[h][0][i], ps[h][1][i], zf2[i][h], s2[i][h], sl2[i][h]);
                if (u + 2 < u1) load_own_scales(s_tile, s_c, ps);
            };
            if (u & 1) take(ps1); else take(ps0);
            if (u + 2 < u1 && ++s_c == cpt) {
                s_c = 0;
                ++s_tile;
            }
        } else {
#pragma unroll
        for (int i = 0; i < GPU; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32 v;
                asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(smem0 + st + X_BYTES + W_BYTES + (i * BN + r0 + 8 * h) * 4));
                group_consts<BF16>(v & 0xFFFFu, v >> 16, zf2[i][h], s2[i][h], sl2[i][h]);
            }
        }
        st = st + STAGE_BYTES == STAGES * STAGE_BYTES ? 0 : st + STAGE_BYTES;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            wgmma_wait<1>();  // the group that last read a[half] (the same half of unit u - 1) is done
#if W4A16_WGMMA_TMA && W4A16_WGMMA_PIPE
            if (half == 1 && u > u0 && lane == 0)  // all of unit u - 1's wgmmas are done: its stage is free
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];"
                             :: "r"(ebar0 + ((u - 1 - u0) % STAGES) * 8) : "memory");
#endif
#pragma unroll
            for (int q = 2 * half; q < 2 * half + 2; ++q) {  // 16-byte reads: words 4q .. 4q + 3 of rows r0, r0 + 8
                u32 w0[4], w1[4];
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(w0[0]), "=r"(w0[1]), "=r"(w0[2]), "=r"(w0[3]) : "r"(wc + (q ^ wsz) * 16));
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(w1[0]), "=r"(w1[1]), "=r"(w1[2]), "=r"(w1[3]) : "r"(wc + 8 * WSW * 4 + (q ^ wsz) * 16));
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int s = 2 * q + hh, gi = GPU == 1 ? 0 : s * 16 / G;
                    u32 (&f)[4] = a[half][s - 4 * half];
                    if (W4A16_WGMMA_NO_DEQ) {
                        f[0] = w0[2 * hh]; f[1] = w1[2 * hh]; f[2] = w0[2 * hh + 1]; f[3] = w1[2 * hh + 1];
                        continue;
                    }
                    f[0] = dequant_pair<BF16>(w0[2 * hh], 4 * t, zf2[gi][0], s2[gi][0], sl2[gi][0]);
                    f[1] = dequant_pair<BF16>(w1[2 * hh], 4 * t, zf2[gi][1], s2[gi][1], sl2[gi][1]);
                    f[2] = dequant_pair<BF16>(w0[2 * hh + 1], 4 * t, zf2[gi][0], s2[gi][0], sl2[gi][0]);
                    f[3] = dequant_pair<BF16>(w1[2 * hh + 1], 4 * t, zf2[gi][1], s2[gi][1], sl2[gi][1]);
                }
            }
            if (W4A16_WGMMA_NO_MMA) {  // keep the dequantized values live without the tensor cores
#pragma unroll
                for (int s = 0; s < 4; ++s) acc[s] += __int_as_float(a[half][s][0] ^ a[half][s][1] ^ a[half][s][2] ^ a[half][s][3]);
                continue;
            }
            wgmma_fence();
#pragma unroll
            for (int s = 0; s < 4; ++s)
#if W4A16_WGMMA_TMA  // box `half` (64 k), k16 step s: 32 bytes into each 128-byte swizzled row; 8-row groups 1024 apart
                wgmma_step<BMX, BF16>(acc, a[half][s], wgmma_desc(xc + half * (X_BYTES / 2) + s * 32, 16, 1024) | (1ull << 62));
#else
                wgmma_step<BMX, BF16>(acc, a[half][s], wgmma_desc(xc + (4 * half + s) * 2 * (BMX / 8) * 128, LBO, SBO));
#endif
            wgmma_commit();
        }
      }
      flush(tile, seg_end == (tile + 1) * cpt);
    }
    cp_async_wait<0>();
#if W4A16_WGMMA_TMA && W4A16_WGMMA_PFIX
    // the range's last segment, unless flush stored it whole (computed from u0 and u1 alone: a flag set in the loop
    // also cost the loop its uniform registers)
    const int last_tile = (u1 - 1) / cpt;
    if (W4A16_WGMMA_MODE != 9 && !(last_tile * cpt >= u0 && u1 == (last_tile + 1) * cpt)) {
        const int b_first = (int)((((long long)last_tile * cpt + 1) * P - 1) / U);
        const int b_last = (int)((((long long)last_tile + 1) * cpt * P - 1) / U);
        pfix_sum<BN, BMX, THREADS, BF16>(ws, cnt, y, bias, has_bias, M, N, last_tile, cpt, P, U, b_first, b_last, b, tid);
    }
#endif
}
