// W4A16 on tensor cores with the weights dequantized straight into mma.sync's B-operand registers;
// further down, w4a16_gemv, a batch-1 GEMV that shares its dequantization and PDL helpers, and at the end
// w4a16_mma_gemv, that GEMV's shape on the tensor cores for 2-16 rows.
//
// Compiled at run time by NVRTC (cuda_rtc.py) for the GPU in use; no headers, so every half2 and
// memory instruction below is inline PTX. It reads the engine's packed layout unchanged
// (formats/w4a16.py: q4weight int32 [N, K/8], the code of k = 8j + 2t + e in bits 4t + 16e of word j;
// q4scales fp16 [N, K/G]; q4zeros uint8 [N, K/G]) and computes y[M, N] = x[M, K] W^T (+ bias) for
// any M in tiles of 16 * MT rows (gridDim.z), fp16 or bf16 in and out (BF16), fp32 accumulation.
//
// Why it is shaped this way: in mma.m16n8k16 the B fragment of lane (g = lane / 4, t = lane % 4) is
// W[n = g][k = 2t, 2t+1] and W[g][2t+8, 2t+9] of a 16-k step, and (word >> 4t) & 0x000F000F of the
// step's first and second word is exactly that pair of codes, one per 16-bit half. OR 0x64006400 makes
// them two fp16 numbers 1024 + code, so the dequantization is LOP3, HSUB2 (- 1024 - zero, exact) and
// HMUL2 (* scale, one rounding, as dequantize(...).half()) per register, with no shared-memory trip of
// the dequantized tile (what Triton's tl.dot needs) and no int->float conversion.
// bf16 activations (BF16 = 1): OR 0x43004300 makes two bf16 numbers 128 + code, and an fma subtracts
// 128 + zero (exact). The scales stay fp16, whose 11-bit significand bf16 (8 bits) cannot hold, so each
// group's scale is split into a bf16 head and the exact bf16 tail s - head (at most 3 significant bits):
// (code - zero) * tail is exact in bf16, and fma((code - zero), head, that) rounds the exact product
// (code - zero) * s to bf16 once, as dequantize(...).to(torch.bfloat16) does. Five instructions a pair
// against the fp16 path's four (a first version that dequantized in fp32 took ten and ran 30-40 %
// slower at batches 2-16 on an H200).
//
// Block: WM x WN warps, each NT n8-tiles x MT m16-tiles (warps along M dequantize the same weights
// for their own rows: fewer registers per warp, more warps per SM); K in KC-wide chunks (64, 128 or
// 256: wider chunks read longer contiguous runs of each weight row, KC / 2 bytes), a STAGES-deep
// cp.async ring in shared memory holding each chunk's x tile and packed weight tile. The group size G
// (a template argument) is a multiple of 64; K is walked in units of max(KC, G), so a chunk holds whole
// groups or a group whole chunks. Split-K over gridDim.y at unit boundaries: each split writes fp32
// partials to ws, the last to take a ticket sums them in split order (deterministic), adds the bias,
// stores, and resets its counter.
//
// Programmatic dependent launch (sm_90): the kernel lets the next one be scheduled at once, and reads
// only weights (the packed tiles of its first stages, its scales and zero points) before
// griddepcontrol.wait; x, ws, cnt and y are touched after it. Launched without PDL, both are no-ops.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
struct alignas(8) u32x2 { u32 x, y; };
struct alignas(8) f32x2 { float x, y; };


__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16_s(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

__device__ __forceinline__ void ld_shared_v4(u32& a, u32& b, u32& c, u32& d, u32 addr) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_s(u32 (&a)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 sub_f16x2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 mul_f16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// The nibble masks of a word's pairs as constants in memory. LOP3 takes one immediate (the magic goes there), so
// the mask is a register, and under the kernels' register pressure ptxas rebuilt it before most LOP3s (a MOV or an
// HFMA2.MMA each: 216 of w4a16_gemv<4, 2, 2, 128>'s 1,904 instructions, a third of w4a16_gemv_tc's loop; 29 of
// w4a16_mma_gemv<8, 1, 1, 128, 0>'s loop of 207); a constant-bank operand it reads in place. The batch-1 GEMVs
// since session 52 (measured: 2 % off their 128 linears on an H100). dequant2, the batched kernels', reads it so only
// in the W4A16_DEQUANT_MASK_CONSTANT build (VLMCTL_W4A16_DEQUANT_MASK=constant, session 56: the same bits, fewer
// instructions, not yet measured on a GPU; docs/benchmarks.md). W4A16_NIBBLE_MASK_IMMEDIATE (a measurement build,
// benchmarks/w4a16_gemv_ablate_gpu.py) writes every mask as an immediate, as before session 52.
__constant__ u32 kNibbleMask[2] = {0x000F000Fu, 0x00F000F0u};
#ifdef W4A16_NIBBLE_MASK_IMMEDIATE
#define NIBBLE_MASK(i) ((i) ? 0x00F000F0u : 0x000F000Fu)
#else
#define NIBBLE_MASK(i) kNibbleMask[i]
#endif
#if defined(W4A16_DEQUANT_MASK_CONSTANT) && !defined(W4A16_NIBBLE_MASK_IMMEDIATE)
#define DEQUANT_MASK kNibbleMask[0]
#else
#define DEQUANT_MASK 0x000F000Fu
#endif

// two fp16 weights (code - zero) * scale from the pair of codes at bits 4t and 4t + 16 of w
__device__ __forceinline__ u32 dequant2(u32 w, int shift, u32 zf2, u32 s2) {
    const u32 v = ((w >> shift) & DEQUANT_MASK) | 0x64006400u;
    return mul_f16x2(sub_f16x2(v, zf2), s2);
}

__device__ __forceinline__ float as_float(u32 u) {
    float f;
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(u));
    return f;
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {  // round to nearest even
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u32 bf16_bits(float f) {  // round to nearest bf16, its 16 bits
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// two bf16 weights from the pair of codes at bits 4t and 4t + 16 of w: nz2 is -(128 + zero) twice,
// sh2 / sl2 the scale's bf16 head and tail twice
__device__ __forceinline__ u32 dequant2_bf16(u32 w, int shift, u32 nz2, u32 sh2, u32 sl2) {
    const u32 v = ((w >> shift) & DEQUANT_MASK) | 0x43004300u;
    const u32 d = fma_bf16x2(v, 0x3F803F80u, nz2);       // code - zero, exact
    const u32 t = fma_bf16x2(d, sl2, 0x80008000u);       // (code - zero) * tail, exact (+ -0)
    return fma_bf16x2(d, sh2, t);                        // one rounding of (code - zero) * scale
}

__device__ __forceinline__ void mma16816_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// A group's constants for dequant2 / dequant2_bf16, twice each, from its fp16 scale bits and zero point:
// fp16: zf2 = 1024 + zero, s2 = the scale; bf16: zf2 = -(128 + zero), s2 / sl2 the scale's bf16 head
// and its exact tail (the file's header says why).
template <int BF16>
__device__ __forceinline__ void group_consts(u32 scale_bits, u32 zero, u32& zf2, u32& s2, u32& sl2) {
    if constexpr (BF16) {
        const float sc32 = half_to_float((u16)scale_bits);
        const u32 head = bf16_bits(sc32);
        zf2 = (0xC300u | zero) * 0x00010001u;
        s2 = head * 0x00010001u;
        sl2 = bf16_bits(sc32 - as_float(head << 16)) * 0x00010001u;
    } else {
        zf2 = (0x6400u | zero) * 0x00010001u;
        s2 = scale_bits * 0x00010001u;
    }
}

template <int BF16>
__device__ __forceinline__ float act_to_float(u16 h) {  // an fp16 or bf16 value (the bias) as fp32
    return BF16 ? as_float((u32)h << 16) : half_to_float(h);
}

__device__ __forceinline__ void pdl_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ int take_ticket(int* ticket) {  // the count before this block's increment
    int got;
    asm volatile("atom.global.add.u32 %0, [%1], 1;" : "=r"(got) : "l"(ticket));
    return got;
}

__device__ __forceinline__ f32x2 load_cg_f2(const float* p) {
    f32x2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}

// The C fragments out: fragment (i, j) holds rows row0 + 16i + g (+ 8), columns col0 + 8j + 2t (+1), of the
// block's tile; y and M are the block's (m_base rows in), ws keeps global rows. With split-K each split writes
// fp32 partials to ws, the last block of the tile to take a ticket sums them in split order (deterministic),
// adds the bias, stores, and resets the ticket. Called by every thread of the block (it has barriers).
template <int MT, int NT, int BF16>
__device__ __forceinline__ void mma_epilogue(const float (&acc)[MT][NT][4], int row0, int col0, int g, int t,
                                             int M, int N, int M_all, int m_base, int split, int splits,
                                             float* __restrict__ ws, int* ticket, u16* __restrict__ y,
                                             const u16* __restrict__ bias, int has_bias, int* is_last, int tid) {
    if (splits > 1) {  // partials out; the last block of the tile to take a ticket reduces them below
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = col0 + j * 8 + 2 * t;
                if (n >= N) continue;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int m = row0 + i * 16 + g + 8 * h;
                    if (m < M)
                        *reinterpret_cast<f32x2*>(ws + ((long long)split * M_all + m_base + m) * N + n) =
                            f32x2{acc[i][j][2 * h], acc[i][j][2 * h + 1]};
                }
            }
        fence_gpu();
        __syncthreads();
        if (tid == 0) *is_last = take_ticket(ticket) == splits - 1;
        __syncthreads();
        if (!*is_last) return;
        fence_gpu();
    }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int n = col0 + j * 8 + 2 * t;
            if (n >= N) continue;
            float b0 = 0.f, b1 = 0.f;
            if (has_bias) { b0 = act_to_float<BF16>(bias[n]); b1 = act_to_float<BF16>(bias[n + 1]); }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = row0 + i * 16 + g + 8 * h;
                if (m >= M) continue;
                float s0 = acc[i][j][2 * h], s1 = acc[i][j][2 * h + 1];
                if (splits > 1) {  // in split order, so the result does not depend on which block came last
                    s0 = s1 = 0.f;
                    for (int s = 0; s < splits; ++s) {
                        const f32x2 v = load_cg_f2(ws + ((long long)s * M_all + m_base + m) * N + n);
                        s0 += v.x;
                        s1 += v.y;
                    }
                }
                *reinterpret_cast<u32*>(y + (long long)m * N + n) =
                    BF16 ? pack_bf16x2(s0 + b0, s1 + b1) : pack_half2(s0 + b0, s1 + b1);
            }
        }
    if (splits > 1 && tid == 0) *ticket = 0;
}

template <int MT, int NT, int WM, int WN, int STAGES, int G, int KC, int BF16>
__global__ void __launch_bounds__(WM * WN * 32)
w4a16_mma(const u16* __restrict__ x, const u32* __restrict__ qw, const u16* __restrict__ sc,
          const u8* __restrict__ zp, const u16* __restrict__ bias, u16* __restrict__ y,
          float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int K, int ldx, int has_bias,
          int max_groups) {
    static_assert(KC == 64 || KC == 128 || KC == 256, "chunks of 64, 128 or 256");
    static_assert(G % 64 == 0 && (G % KC == 0 || KC % G == 0), "a chunk holds whole groups or a group whole chunks");
    constexpr int BN = WN * NT * 8;
    constexpr int BM = WM * MT * 16;
    constexpr int THREADS = WM * WN * 32;
    constexpr int XS = KC + 8;        // halfs per x row in shared memory (+8: conflict-free ldmatrix)
    constexpr int WSW = KC / 8 + 4;   // words per weight row in shared memory (+4: conflict-free 16-byte reads)
    constexpr int UNIT = KC > G ? KC : G, CPU = UNIT / KC;  // K unit and chunks per unit
    constexpr int X_BYTES = BM * XS * 2, STAGE_BYTES = X_BYTES + BN * WSW * 4;
    extern __shared__ __align__(16) u8 smem[];
    __shared__ int is_last;
    pdl_release();

    // M tiles over gridDim.z: this block's rows start at m_base (ws keeps global rows, cnt one per tile)
    const int m_base = blockIdx.z * BM;
    x += (long long)m_base * ldx;
    y += (long long)m_base * N;
    const int M_all = M;
    M = M - m_base < BM ? M - m_base : BM;
    cnt += blockIdx.z * gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) % WN, warp_m = (tid >> 5) / WN;
    const int g = lane >> 2, t = lane & 3;
    const int n_block = blockIdx.x * BN;
    const int split = blockIdx.y, splits = gridDim.y;
    const int kw = K >> 3, kg = K / G, ku = K / UNIT;
    // splits cut K at unit boundaries (whole groups), so each block loads a group's scales once
    const int u_begin = (int)((long long)split * ku / splits);
    const int nunits = (int)((long long)(split + 1) * ku / splits) - u_begin;
    const int nchunks = nunits * CPU;
    const int g_begin = u_begin * (UNIT / G), ngroups = nunits * (UNIT / G);

    // Each thread's cp.async pieces (16 bytes each): piece q of a tile is row tid / PR + q * THREADS / PR,
    // 16-byte column tid % PR, in every chunk (PR pieces per row; THREADS is a multiple of PR). Rows
    // past M or N copy nothing (src-size 0 zero-fills) and point at row 0. Addresses are recomputed per
    // chunk from one running K offset rather than kept per piece: fewer registers at KC = 256.
    constexpr int XPR = KC / 8, WPR = KC / 32;  // 16-byte pieces per x row and per weight row
    constexpr int XP = (BM * XPR + THREADS - 1) / THREADS, WP = (BN * WPR + THREADS - 1) / THREADS;
    const int xr0 = tid / XPR, xp = tid % XPR, wr0 = tid / WPR, wp = tid % WPR;
    const u16* xbase = x + u_begin * UNIT + xp * 8;
    const u32* wbase = qw + u_begin * (UNIT / 8) + wp * 4;
    const u32 smem0 = smem_addr(smem);
    int kx = 0;  // K offset (elements) of the next chunk to load within this split
    auto load_w = [&](u32 stage_addr) {
#pragma unroll
        for (int q = 0; q < WP; ++q) {
            const int r = wr0 + q * (THREADS / WPR);
            if (BN * WPR % THREADS == 0 || r < BN) {
                const bool ok = n_block + r < N;
                cp_async16_s(stage_addr + X_BYTES + (r * WSW + wp * 4) * 4,
                             wbase + (ok ? (long long)(n_block + r) * kw : 0) + kx / 8, ok);
            }
        }
    };
    auto load_x = [&](u32 stage_addr) {
#pragma unroll
        for (int q = 0; q < XP; ++q) {
            const int r = xr0 + q * (THREADS / XPR);
            if (BM * XPR % THREADS == 0 || r < BM) {
                const bool ok = r < M;
                cp_async16_s(stage_addr + (r * XS + xp * 8) * 2, xbase + (ok ? r * ldx : 0) + kx, ok);
            }
        }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    // Prologue: the first stages' weight tiles, then the block's scales and zero points for its whole
    // K range (to shared memory once, so the loop reads them with short-latency loads), all before the
    // wait for the previous kernel; then the x tiles. The first commit group holds every prologue
    // weight tile and the first x tile, so the loop's wait accounting is unchanged.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nchunks) load_w(smem0 + s * STAGE_BYTES);
        kx += KC;
    }
    kx = 0;
    // Rows past N are clamped to a real row (computed, never stored).
    u16* s_sm = reinterpret_cast<u16*>(smem + STAGES * STAGE_BYTES);
    u8* z_sm = reinterpret_cast<u8*>(s_sm + BN * max_groups);
    for (int idx = tid; idx < BN * ngroups; idx += THREADS) {
        const int r = idx / ngroups, gq = idx - r * ngroups;
        const int n = n_block + r < N ? n_block + r : N - 1;
        s_sm[r * max_groups + gq] = sc[(long long)n * kg + g_begin + gq];
        z_sm[r * max_groups + gq] = zp[(long long)n * kg + g_begin + gq];
    }
    pdl_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nchunks) load_x(smem0 + s * STAGE_BYTES);
        kx += KC;
        cp_async_commit();
    }
    __syncthreads();  // the loop reads a group's entries before its first chunk's barrier
    int row_sz[NT];  // this lane's row (one per n8-tile) in those tables
#pragma unroll
    for (int j = 0; j < NT; ++j) row_sz[j] = (warp * NT * 8 + j * 8 + g) * max_groups;

    const u32 x_lane = ((warp_m * MT * 16 + (lane & 15)) * XS + (lane >> 4) * 8) * 2;
    const u32 w_lane = X_BYTES + (warp * NT * 8 + g) * WSW * 4;
    u32 stage = 0, load_stage = (STAGES - 1) * STAGE_BYTES;
    int c = 0;
    u32 zf2[NT], s2[NT];  // fp16: 1024 + zero and the scale, twice each
    u32 sl2[NT];          // bf16: zf2 holds -(128 + zero), s2 the scale's bf16 head, sl2 its tail
    for (int un = 0; un < nunits; ++un) {
#pragma unroll
        for (int cc = 0; cc < CPU; ++cc, ++c) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            if (c + STAGES - 1 < nchunks) {
                load_w(smem0 + load_stage);
                load_x(smem0 + load_stage);
            }
            kx += KC;
            cp_async_commit();
            load_stage = load_stage + STAGE_BYTES == STAGES * STAGE_BYTES ? 0 : load_stage + STAGE_BYTES;

            const u32 xc = smem0 + stage + x_lane;
            const u32 wc = smem0 + stage + w_lane;
            stage = stage + STAGE_BYTES == STAGES * STAGE_BYTES ? 0 : stage + STAGE_BYTES;
#pragma unroll
            for (int sub = 0; sub < KC / 64; ++sub) {  // 64-k pieces of the chunk
                const int k_in_unit = cc * KC + sub * 64;  // compile-time after unrolling
                if (k_in_unit % G == 0) {  // a new group: its scale and 1024 + zero, twice, per row
                    const int gq = un * (UNIT / G) + k_in_unit / G;
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        group_consts<BF16>(s_sm[row_sz[j] + gq], z_sm[row_sz[j] + gq], zf2[j], s2[j], sl2[j]);
                    }
                }
                // software-pipelined: this piece's weight words for all NT rows up front (two 16-byte
                // reads each), the next 16-k step's x fragments loaded while this step's mma run
                u32 wv[NT][8];
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const u32 addr = wc + (j * 8 * WSW + sub * 8) * 4;
                    ld_shared_v4(wv[j][0], wv[j][1], wv[j][2], wv[j][3], addr);
                    ld_shared_v4(wv[j][4], wv[j][5], wv[j][6], wv[j][7], addr + 16);
                }
                const u32 xs = xc + sub * 64 * 2;
                u32 a[2][MT][4];
#pragma unroll
                for (int i = 0; i < MT; ++i) ldmatrix_x4_s(a[0][i], xs + i * 16 * XS * 2);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    if (kk < 3) {
#pragma unroll
                        for (int i = 0; i < MT; ++i)
                            ldmatrix_x4_s(a[(kk + 1) & 1][i], xs + (i * 16 * XS + (kk + 1) * 16) * 2);
                    }
                    u32 b[NT][2];
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        if constexpr (BF16) {
                            b[j][0] = dequant2_bf16(wv[j][2 * kk], 4 * t, zf2[j], s2[j], sl2[j]);
                            b[j][1] = dequant2_bf16(wv[j][2 * kk + 1], 4 * t, zf2[j], s2[j], sl2[j]);
                        } else {
                            b[j][0] = dequant2(wv[j][2 * kk], 4 * t, zf2[j], s2[j]);
                            b[j][1] = dequant2(wv[j][2 * kk + 1], 4 * t, zf2[j], s2[j]);
                        }
                    }
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int i = 0; i < MT; ++i) {
                            if constexpr (BF16) mma16816_bf16(acc[i][j], a[kk & 1][i], b[j][0], b[j][1]);
                            else mma16816(acc[i][j], a[kk & 1][i], b[j][0], b[j][1]);
                        }
                }
            }
        }
    }
    cp_async_wait<0>();

    mma_epilogue<MT, NT, BF16>(acc, warp_m * MT * 16, n_block + warp * NT * 8, g, t, M, N, M_all, m_base, split,
                               splits, ws, cnt + blockIdx.x, y, bias, has_bias, &is_last, tid);
}


// ---------------------------------------------------------------------------------------------------
// w4a16_gemv: one x row per blockIdx.y (decode at batch 1), fp16 activations, no tensor cores.
//
// At M = 1 a step is a stream of the int4 weights, so what counts is bytes in flight per SM and few
// instructions per weight. Each warp owns RPW weight rows; its lanes walk K in 32-k chunks (16 bytes of
// a row: lane c % 32 takes chunk c, a warp reads 512 contiguous bytes of each row per load), KS chunks
// per lane and row per batch, and the next batch (weights, scales, zero points and the x chunks) is
// loaded into registers while the current one is computed. No shared memory, no barrier, no split-K:
// lanes add up by shuffles at the end. A chunk never straddles a group (G is a multiple of 32), so it
// takes one scale and one zero point.
// Numerics (since session 29): code - zero exact in fp16 at a scale of 1/128, its products with x summed with
// fma.f16x2 in runs of two words (8 products per half), each run's sum times 128 * scale added in fp32, runs and
// lanes in fp32: 3.25 instructions a pair of weights. W4A16_GEMV_SCALE_PER_RUN=0 builds the arithmetic before,
// the Triton half2 GEMV's ("gemv_h2"): every pair dequantized and rounded to fp16 first (dequant2), 4.75
// instructions a pair; the AWQ batch-1 step was 2-4 % slower with it (docs/benchmarks.md, session 29).
// PDL: weights, scales and zero points of the first batch (W4A16_GEMV_PRELOAD=2: two batches) are loaded before
// griddepcontrol.wait; x after it, y at the end.

struct alignas(16) u32x4 { u32 x, y, z, w; };

// How many of a warp's batches (w4a16_gemv) or runs (w4a16_gemv_tc) of weights are loaded before the PDL wait: 1 (the
// default), or 2 (VLMCTL_W4A16_GEMV_PRELOAD=2, opt-in). Weights do not depend on the kernel before; where K is only
// two of them a warp (o at 4 rows x 2 chunks, gemv_tc at 16 warps), the second one's HBM trip otherwise starts after
// the wait. The sums are the same bits either way (same products, same order). Measured on an H100 (session 55), 2
// was 3.5 % slower on the AWQ batch-1 step and slower at every shipped linear: the early loads compete with the
// kernel before for HBM, and some configs lose a block a multiprocessor to the extra registers.
#ifndef W4A16_GEMV_PRELOAD
#define W4A16_GEMV_PRELOAD 1
#endif
constexpr bool kPreloadTwo = W4A16_GEMV_PRELOAD >= 2;

__device__ __forceinline__ u32x4 ld_stream16(const void* p) {  // weights: read once, not kept in L1
    u32x4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32x4 ld_act16(const void* p) {  // x: written by the previous kernel, read after the wait
    u32x4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u32 fma_f16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ void unpack_half2(u32 h, u16& lo, u16& hi) {
    asm("mov.b32 {%0, %1}, %2;" : "=h"(lo), "=h"(hi) : "r"(h));
}

__device__ __forceinline__ float half2_sum(u32 h) {
    u16 lo, hi;
    unpack_half2(h, lo, hi);
    return half_to_float(lo) + half_to_float(hi);
}

__device__ __forceinline__ u32 x_pair(const u32x4& v, int t) {
    return t == 0 ? v.x : t == 1 ? v.y : t == 2 ? v.z : v.w;
}

#ifdef W4A16_GEMV_ABLATE
// Measurement build (benchmarks/w4a16_gemv_ablate_gpu.py): parts of the GEMV left out, to find which of them holds
// it below its loads' ceiling (session 11). Bits: 1 x not loaded (a per-lane constant), 2 scales and zero points
// not loaded, 4 no dequantize or multiply (the words XORed into the sums), 8 the first batch's weights (two
// batches' with W4A16_GEMV_PRELOAD=2) loaded after the PDL wait, 64 zero points not loaded (one small load a row and
// chunk instead of two).
#define GEMV_ABL(bit) ((W4A16_GEMV_ABLATE) & (bit))
#else
#define GEMV_ABL(bit) 0
#endif

template <int RPW, int KS>
struct GemvBatch {
    u32x4 w[KS][RPW];  // 32 codes of each row
    u32 s[KS][RPW];    // its group's scale (fp16 bits)
    u32 z[KS][RPW];    // and zero point
    u32x4 x[KS][4];    // the chunk's 32 activations, shared by the RPW rows
};

template <int RPW, int KS, int G>
__device__ __forceinline__ void gemv_load_weights(GemvBatch<RPW, KS>& b, const u32* const (&rows)[RPW],
                                                  const u16* const (&srow)[RPW], const u8* const (&zrow)[RPW],
                                                  int c0, int KC) {
#pragma unroll
    for (int u = 0; u < KS; ++u) {
        const int c = c0 + 32 * u;
        if (c < KC) {
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                b.w[u][r] = ld_stream16(rows[r] + 4 * c);
                if constexpr (GEMV_ABL(2)) {
                    b.s[u][r] = 0x3c00u;
                    b.z[u][r] = 8u;
                } else if constexpr (GEMV_ABL(64)) {
                    b.s[u][r] = srow[r][(c * 32) / G];
                    b.z[u][r] = 8u;
                } else {
                    b.s[u][r] = srow[r][(c * 32) / G];
                    b.z[u][r] = zrow[r][(c * 32) / G];
                }
            }
        }
    }
}

template <int RPW, int KS>
__device__ __forceinline__ void gemv_load_x(GemvBatch<RPW, KS>& b, const u16* xr, int c0, int KC) {
#pragma unroll
    for (int u = 0; u < KS; ++u) {
        const int c = c0 + 32 * u;
        if (c < KC) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if constexpr (GEMV_ABL(1)) {
                    const u32 v = 0x3c003c00u ^ (u32)((c + j) & 7);
                    b.x[u][j] = u32x4{v, v, v, v};
                } else {
                    b.x[u][j] = ld_act16(xr + 32 * c + 8 * j);
                }
            }
        }
    }
}

// one row's 32 codes of a chunk (w; its group's scale bits s and zero point z) against the chunk's 32
// activations x, added to acc in two runs of two words. A magic exponent puts a code at 1/128 a unit of the
// mantissa: 8 + code / 128 for the codes at bits 0-3 of a byte (0x4800), 0.5 + code /
// 128 for those at bits 4-7 (0x3800), so one shift a word reaches all four pairs and one subtraction leaves
// (code - zero) / 128 exact; at that scale a run (8 products a half of at most 15 / 128 * 65504) cannot overflow
// for any fp16 x.
__device__ __forceinline__ void gemv_chunk(float& acc, const u32x4& w, u32 s, u32 z, const u32x4 (&x)[4]) {
#if defined(W4A16_GEMV_SCALE_PER_RUN) && !W4A16_GEMV_SCALE_PER_RUN
    const u32 zf2 = (0x6400u | z) * 0x10001u;  // fp16 1024 + zero, twice
    const u32 s2 = s * 0x10001u;
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // runs of two words
        u32 run = 0;
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            const int j = 2 * h + jj;
#pragma unroll
            for (int t = 0; t < 4; ++t)  // k = 8j + 2t, 8j + 2t + 1
                run = fma_f16x2(dequant2(words[j], 4 * t, zf2, s2), x_pair(x[j], t), run);
        }
        acc += half2_sum(run);
    }
#else
    const u32 zlo = (0x4800u | z) * 0x10001u;         // fp16 8 + zero / 128, twice
    const u32 zhi = (0x3800u | (z << 4)) * 0x10001u;  // fp16 0.5 + zero / 128, twice
    const float s128 = half_to_float((u16)s) * 128.f;  // exact
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // runs of two words
        u32 run = 0;
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            const int j = 2 * h + jj;
            const u32 lo = words[j], hi = words[j] >> 8;  // pair t: bits 4t and 4t + 16
            run = fma_f16x2(sub_f16x2((lo & NIBBLE_MASK(0)) | 0x48004800u, zlo), x[j].x, run);  // t = 0
            run = fma_f16x2(sub_f16x2((lo & NIBBLE_MASK(1)) | 0x38003800u, zhi), x[j].y, run);  // t = 1
            run = fma_f16x2(sub_f16x2((hi & NIBBLE_MASK(0)) | 0x48004800u, zlo), x[j].z, run);  // t = 2
            run = fma_f16x2(sub_f16x2((hi & NIBBLE_MASK(1)) | 0x38003800u, zhi), x[j].w, run);  // t = 3
        }
        acc += s128 * half2_sum(run);
    }
#endif
}

template <int RPW, int KS>
__device__ __forceinline__ void gemv_compute(const GemvBatch<RPW, KS>& b, float (&acc)[RPW], int c0, int KC) {
#pragma unroll
    for (int u = 0; u < KS; ++u) {
        if (c0 + 32 * u < KC) {
            if constexpr (GEMV_ABL(4)) {
                u32 xx = 0;
#pragma unroll
                for (int j = 0; j < 4; ++j) xx ^= b.x[u][j].x ^ b.x[u][j].y ^ b.x[u][j].z ^ b.x[u][j].w;
#pragma unroll
                for (int r = 0; r < RPW; ++r) {
                    const u32x4& w = b.w[u][r];
                    const u32 h = w.x ^ w.y ^ w.z ^ w.w ^ b.s[u][r] ^ b.z[u][r] ^ xx;
                    acc[r] += __uint_as_float((h & 0x007fffffu) | 0x3f000000u);
                }
            } else {
#pragma unroll
                for (int r = 0; r < RPW; ++r) gemv_chunk(acc[r], b.w[u][r], b.s[u][r], b.z[u][r], b.x[u]);
            }
        }
    }
}

// The GEMVs' gate_up epilogue (ACT >= 0: 0 SiLU, 1 GELU with the tanh approximation): a warp's RPW rows are
// RPW / 2 gate rows and the up rows N / 2 below them, and it stores act(gate) * up, rounded as the act·mul
// kernel rounds it (kernels/fused.py: gate and up to fp16, act(gate) in fp32 to fp16, the product to fp16).
// `act_f32` follows fused.py's act_f32 formula; expf and the division are IEEE here where Triton's are
// approximate, so a result may differ from the Triton GEMV's by one fp16 rounding.
template <int ACT>
__device__ __forceinline__ float act_f32(float g) {
    if constexpr (ACT == 0) return g / (1.f + expf(-g));
    const float inner = fminf(fmaxf(0.7978845608028654f * (g + 0.044715f * g * g * g), -15.f), 15.f);
    const float th = 1.f - 2.f / (expf(2.f * inner) + 1.f);
    return 0.5f * g * (1.f + th);
}

// The weight row that row slot r of a warp whose first output row is row0 reads: row0 + r, or with the gate_up
// epilogue the gate row row0 + r (r < RPW / 2) or its up row. Rows past the end read the last row and are
// not stored.
template <int RPW, int ACT>
__device__ __forceinline__ int gemv_weight_row(int row0, int r, int N) {
    if constexpr (ACT < 0) return min(row0 + r, N - 1);
    constexpr int H = RPW / 2;
    return min(row0 + r % H, N / 2 - 1) + (r < H ? 0 : N / 2);
}

// the warp's row sums (each lane's share added across the warp), plus the bias, rounded to fp16 and stored
// (ACT >= 0: act(gate) * up of its RPW / 2 output rows from row0, y's rows N / 2 long)
template <int RPW, int ACT>
__device__ __forceinline__ void gemv_store_rows(float (&acc)[RPW], int lane, int row0, int N, const u16* bias,
                                                int has_bias, u16* y) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    }
    if (lane == 0) {
        if constexpr (ACT < 0) {
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                const int n = row0 + r;
                if (n < N) {
                    y[n] = f32_to_f16(acc[r] + (has_bias ? half_to_float(bias[n]) : 0.f));
                }
            }
        } else {
            constexpr int H = RPW / 2;
            const int half = N / 2;
#pragma unroll
            for (int r = 0; r < H; ++r) {
                const int n = row0 + r;
                if (n < half) {
                    const float g = half_to_float(f32_to_f16(acc[r] + (has_bias ? half_to_float(bias[n]) : 0.f)));
                    const float u = half_to_float(f32_to_f16(acc[r + H] + (has_bias ? half_to_float(bias[n + half])
                                                                                       : 0.f)));
                    y[n] = f32_to_f16(half_to_float(f32_to_f16(act_f32<ACT>(g))) * u);
                }
            }
        }
    }
}

#ifdef W4A16_GEMV_L2_NEXT
// Measurement build (benchmarks/w4a16_gemv_chain_gpu.py): the GEMV also asks L2 for the first `pre` bytes of
// each of `rows` rows (`row_bytes` apart) of the NEXT linear's weights, so that DRAM keeps streaming across
// the boundary between two dependent kernels. when: 1 before the PDL wait, 2 after the main loop.
__device__ __forceinline__ void l2_prefetch_rows(const char* nxt, int rows, int row_bytes, int pre) {
    const int threads = gridDim.x * gridDim.y * blockDim.x;
    for (int r = (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += threads)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(nxt + (size_t)r * row_bytes), "r"(pre)
                     : "memory");
}
#define GEMV_NEXT_PARAMS , const char* nxt, int nxt_rows, int nxt_row_bytes, int nxt_pre, int nxt_when
#define GEMV_NEXT_AT(w) if (nxt_when == (w)) l2_prefetch_rows(nxt, nxt_rows, nxt_row_bytes, nxt_pre)
#else
#define GEMV_NEXT_PARAMS
#define GEMV_NEXT_AT(w)
#endif

template <int RPW, int NW, int KS, int G, int ACT = -1>
__global__ void __launch_bounds__(NW * 32)
w4a16_gemv(const u16* x, const u32* __restrict__ qw, const u16* __restrict__ sc, const u8* __restrict__ zp,
           const u16* __restrict__ bias, u16* __restrict__ y, int N, int K, int ldx, int has_bias GEMV_NEXT_PARAMS) {
    pdl_release();
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * NW + (threadIdx.x >> 5)) * (ACT < 0 ? RPW : RPW / 2);  // its first output row
    const int KC = K >> 5;  // 32-k chunks of a row
    const int KG = K / G;
    const u32* rows[RPW];
    const u16* srow[RPW];
    const u8* zrow[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int n = gemv_weight_row<RPW, ACT>(row0, r, N);
        rows[r] = qw + (size_t)n * (K >> 3);
        srow[r] = sc + (size_t)n * KG;
        zrow[r] = zp + (size_t)n * KG;
    }
    const u16* xr = x + (size_t)blockIdx.y * ldx;
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
    GemvBatch<RPW, KS> a, b;
    if constexpr (!GEMV_ABL(8)) {
        gemv_load_weights<RPW, KS, G>(a, rows, srow, zrow, lane, KC);
        if constexpr (kPreloadTwo) gemv_load_weights<RPW, KS, G>(b, rows, srow, zrow, lane + 32 * KS, KC);
    }
    GEMV_NEXT_AT(1);
    pdl_wait();
    if constexpr (GEMV_ABL(8)) {
        gemv_load_weights<RPW, KS, G>(a, rows, srow, zrow, lane, KC);
        if constexpr (kPreloadTwo) gemv_load_weights<RPW, KS, G>(b, rows, srow, zrow, lane + 32 * KS, KC);
    }
    gemv_load_x(a, xr, lane, KC);
    if constexpr (kPreloadTwo) gemv_load_x(b, xr, lane + 32 * KS, KC);
    for (int c0 = lane; c0 < KC; c0 += 64 * KS) {  // two batches per trip: a and b take turns
        if constexpr (!kPreloadTwo) {  // b's batch: here, or (preloading two) at the end of the trip before
            gemv_load_weights<RPW, KS, G>(b, rows, srow, zrow, c0 + 32 * KS, KC);
            gemv_load_x(b, xr, c0 + 32 * KS, KC);
        }
        gemv_compute(a, acc, c0, KC);
        if (c0 + 32 * KS >= KC) break;
        gemv_load_weights<RPW, KS, G>(a, rows, srow, zrow, c0 + 64 * KS, KC);
        gemv_load_x(a, xr, c0 + 64 * KS, KC);
        gemv_compute(b, acc, c0 + 32 * KS, KC);
        if constexpr (kPreloadTwo) {
            gemv_load_weights<RPW, KS, G>(b, rows, srow, zrow, c0 + 96 * KS, KC);
            gemv_load_x(b, xr, c0 + 96 * KS, KC);
        }
    }
    GEMV_NEXT_AT(2);
    gemv_store_rows<RPW, ACT>(acc, lane, row0, N, bias, has_bias, y + (size_t)blockIdx.y * (ACT < 0 ? N : N / 2));
}



// ---------------------------------------------------------------------------------------------------
// w4a16_mma_gemv: decode batches of up to 16 rows as a GEMV whose multiply-adds run on the tensor cores.
//
// For 2-16 rows the mma kernel above streams weights through a cp.async ring behind a block-wide barrier
// per chunk; on an H200 it took ~20 us for a 7B decoder's qkv at every M from 2 to 16, against ~12 us for
// the barrier-free batch-1 GEMV (docs/benchmarks.md, session 12). This kernel is shaped like that GEMV:
// no shared-memory staging and no barrier in the K loop, each lane loading straight into registers the
// weight bytes it uses and the x it multiplies them with. A warp's A operand is a 16-row tile of W,
// dequantized into the A registers (each pair rounded once, as dequantize(...)); B holds x, batch row
// 8 nb + g in column g of n8-tile nb (NB tiles: up to 8 NB rows); C is that tile of y, transposed. So 2-16
// rows cost the tensor cores' time (idle otherwise) and the x loads, not more weight traffic.
// K is summed in a permuted order inside each 128-k chunk (a dot product does not care, as long as A and
// B agree), so that each lane reads only its own 16 bytes of a row: lane (g = lane / 4, t = lane % 4)
// loads words 4t .. 4t+3 of the chunk for W rows g and g + 8 and uses word 4t + u in the chunk's 16-k
// steps 2u and 2u + 1; in step 2u + h its pairs at bits 8h / 8h+16 and 8h+4 / 8h+20 (k = 32t + 8u + 4h +
// {0, 1} and + {2, 3}) stand where the A layout has columns 2t, 2t+1 and 2t+8, 2t+9. The x a lane needs
// for B are then x[row][32t .. 32t+31] of the chunk: four 16-byte loads per batch row, L1 hits after the
// first warp. A lane's 32 k lie in one group (G % 32 == 0): one scale and zero point per chunk and row.
// Block: 16 W rows; KW warps take the tile's chunks in turn (warp w: chunks w, w + KW, ...), each with
// its next PF chunks loaded ahead into registers; the warps' sums are added in warp order through shared
// memory (deterministic), then the bias. Batch rows past M read row M - 1 and are not stored; W rows past
// N read row N - 1 and are not stored. PDL: the first PF chunks' weights, scales and zero points are
// loaded before griddepcontrol.wait, x after it.

template <int NB>
struct MmaGemvChunk {
    u32x4 wa, wb;      // W rows g and g + 8: words 4t .. 4t+3 of the chunk
    u32x4 x[NB][4];    // batch row 8 nb + g at the same 32 k (word u's 8 k in x[nb][u])
    u32 sa, za, sb, zb;  // the two rows' scale bits and zero points for those k
};

template <int NB, int G>
__device__ __forceinline__ void mma_gemv_load_weights(MmaGemvChunk<NB>& q, const u32* ra, const u32* rb,
                                                      const u16* sa, const u16* sb, const u8* za, const u8* zb,
                                                      int chunk, int t) {
    q.wa = ld_stream16(ra + 16 * chunk + 4 * t);
    q.wb = ld_stream16(rb + 16 * chunk + 4 * t);
    const int grp = (128 * chunk + 32 * t) / G;
    q.sa = sa[grp];
    q.sb = sb[grp];
    q.za = za[grp];
    q.zb = zb[grp];
}

template <int NB>
__device__ __forceinline__ void mma_gemv_load_x(MmaGemvChunk<NB>& q, const u16* const (&xr)[NB], int chunk, int t) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int u = 0; u < 4; ++u) q.x[nb][u] = ld_act16(xr[nb] + 128 * chunk + 32 * t + 8 * u);
}

template <int NB, int BF16>
__device__ __forceinline__ void mma_gemv_compute(const MmaGemvChunk<NB>& q, float (&acc)[NB][4]) {
    u32 zfa, s2a, sla, zfb, s2b, slb;
    group_consts<BF16>(q.sa, q.za, zfa, s2a, sla);
    group_consts<BF16>(q.sb, q.zb, zfb, s2b, slb);
    const u32 wa[4] = {q.wa.x, q.wa.y, q.wa.z, q.wa.w};
    const u32 wb[4] = {q.wb.x, q.wb.y, q.wb.z, q.wb.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // steps 2u and 2u + 1 of the chunk, from word u of the lane's four
            u32 a[4];
            if constexpr (BF16) {
                a[0] = dequant2_bf16(wa[u], 8 * h, zfa, s2a, sla);      // row g, columns 2t, 2t+1
                a[1] = dequant2_bf16(wb[u], 8 * h, zfb, s2b, slb);      // row g + 8
                a[2] = dequant2_bf16(wa[u], 8 * h + 4, zfa, s2a, sla);  // row g, columns 2t+8, 2t+9
                a[3] = dequant2_bf16(wb[u], 8 * h + 4, zfb, s2b, slb);
            } else {
                a[0] = dequant2(wa[u], 8 * h, zfa, s2a);
                a[1] = dequant2(wb[u], 8 * h, zfb, s2b);
                a[2] = dequant2(wa[u], 8 * h + 4, zfa, s2a);
                a[3] = dequant2(wb[u], 8 * h + 4, zfb, s2b);
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                const u32 b0 = h ? q.x[nb][u].z : q.x[nb][u].x, b1 = h ? q.x[nb][u].w : q.x[nb][u].y;
                if constexpr (BF16) mma16816_bf16(acc[nb], a, b0, b1);
                else mma16816(acc[nb], a, b0, b1);
            }
        }
    }
}

template <int KW, int NB, int PF, int G, int BF16>
__global__ void __launch_bounds__(KW * 32)
w4a16_mma_gemv(const u16* x, const u32* __restrict__ qw, const u16* __restrict__ sc, const u8* __restrict__ zp,
               const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int K, int ldx, int has_bias) {
    static_assert(G % 32 == 0, "a lane's 32 k of a chunk lie in one group");
    __shared__ float red[KW][NB * 8][16];  // the warps' partial sums: [warp][batch row][W row]
    pdl_release();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16, m0 = blockIdx.y * NB * 8;
    const int na = min(n0 + g, N - 1), nb8 = min(n0 + g + 8, N - 1);
    const int KG = K / G, KC = K >> 7;
    const u32* ra = qw + (size_t)na * (K >> 3);
    const u32* rb = qw + (size_t)nb8 * (K >> 3);
    const u16* sa = sc + (size_t)na * KG;
    const u16* sb = sc + (size_t)nb8 * KG;
    const u8* za = zp + (size_t)na * KG;
    const u8* zb = zp + (size_t)nb8 * KG;
    const u16* xr[NB];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) xr[nb] = x + (size_t)min(m0 + 8 * nb + g, M - 1) * ldx;
    MmaGemvChunk<NB> q[PF];  // a ring of the warp's next PF chunks
#pragma unroll
    for (int i = 0; i < PF; ++i)
        if (warp + i * KW < KC) mma_gemv_load_weights<NB, G>(q[i], ra, rb, sa, sb, za, zb, warp + i * KW, t);
    pdl_wait();
#pragma unroll
    for (int i = 0; i < PF; ++i)
        if (warp + i * KW < KC) mma_gemv_load_x<NB>(q[i], xr, warp + i * KW, t);
    float acc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nb][e] = 0.f;
    for (int base = warp; base < KC; base += PF * KW) {
#pragma unroll
        for (int i = 0; i < PF; ++i) {  // compute a slot, then refill it with the chunk PF turns ahead
            const int chunk = base + i * KW;
            if (chunk < KC) {
                mma_gemv_compute<NB, BF16>(q[i], acc);
                if (chunk + PF * KW < KC) {
                    mma_gemv_load_weights<NB, G>(q[i], ra, rb, sa, sb, za, zb, chunk + PF * KW, t);
                    mma_gemv_load_x<NB>(q[i], xr, chunk + PF * KW, t);
                }
            }
        }
    }
    // C of tile nb: acc[nb][0 / 1] = (W row g, batch rows 8 nb + 2t / + 1), acc[nb][2 / 3] the same for row g + 8
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        red[warp][8 * nb + 2 * t][g] = acc[nb][0];
        red[warp][8 * nb + 2 * t + 1][g] = acc[nb][1];
        red[warp][8 * nb + 2 * t][g + 8] = acc[nb][2];
        red[warp][8 * nb + 2 * t + 1][g + 8] = acc[nb][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < NB * 8 * 16; i += KW * 32) {
        const int r = i >> 4, c = i & 15;
        const int m = m0 + r, n = n0 + c;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < KW; ++w) v += red[w][r][c];
        if (m < M && n < N) {
            if (has_bias) v += act_to_float<BF16>(bias[n]);
            y[(size_t)m * N + n] = BF16 ? (u16)bf16_bits(v) : f32_to_f16(v);
        }
    }
}


// ---------------------------------------------------------------------------------------------------
// w4a16_gemv_tc: the batch-1 GEMV on the tensor cores, the zero point and the codes' magic folded out of the
// K loop. Where the tuned table names it (an H100: a 7B decoder's qkv and gate_up) or VLMCTL_W4A16_GEMV_TC forces
// it; docs/benchmarks.md, session 52.
//
// Why: w4a16_gemv spends 3.25 instructions a pair of weights on arithmetic (mask-or, subtract the zero point,
// fp16 multiply-add) because its fp16 sums need each code cancelled against its magic before the products are
// added; with that arithmetic it runs at ~60 % of the copy bandwidth, its loads alone at ~90 % (session 37).
// mma.sync sums exact fp16 products in fp32, where the cancellation can wait to the end of a chunk. A code
// enters the A registers as magic + code / 128 by one AND-OR a pair: the low nibble of a byte in place at
// magic 8 (0x4800), the high one in place at magic 0.5 (0x3800); one shift a word reaches its other two
// pairs. Over a 128-k chunk of one group, with acc the mma's sum of those values times x,
//     sum_k (code_k - zero) x_k = 128 (acc - 8 Lo - 0.5 Hi) - zero (Lo + Hi),
// Lo and Hi being the chunk's sums of x at the low- and high-nibble positions. Those are the same for every
// weight row: four mma a chunk, with the x registers as A and ones as B, make them for all of the warp's tiles,
// and each row's chunk sum takes its scale once, in fp32: 1.25 instructions a pair, one mma per 256 weights, and
// a few fp32 instructions per row and chunk.
// Layout: a tile is 16 weight rows, lane (g = lane / 4, t = lane % 4) holding A's rows g and g + 8; K is
// permuted inside each 128-k chunk as in w4a16_mma_gemv (lane t loads words 4t .. 4t+3 of the chunk of both
// rows, and its word u serves the chunk's 16-k steps 2u and 2u + 1); every column of B is x (one batch row),
// so every lane ends a chunk holding its two rows' sums. A warp takes T tiles, which share its x registers;
// the block's NW warps split K in runs of KS chunks (warp w: runs w, w + NW, ...), the next run of every tile
// loaded into registers while one is computed. The warps' sums meet in shared memory and are added in warp
// order (deterministic); then the bias, and y in fp16 (ACT >= 0: the tiles are T / 2 gate tiles and their up
// tiles, and y = act(gate) * up rounded as w4a16_gemv's epilogue rounds it). blockIdx.y: the x row.
// Needs K % 128 == 0 and G % 128 == 0 (a step's 16 k come from all four lanes t, so a chunk lies in one group),
// and N a multiple of a block's rows. K is a template argument, so that every load but the first of a run is at an
// immediate offset from a base pointer: with run-time strides the compiler rebuilt each run's row addresses
// (about 180 address instructions a run of 4 KB) and reloaded constants.
// PDL: the first run's weights, scales and zero points (W4A16_GEMV_PRELOAD=2: two runs') are loaded before
// griddepcontrol.wait, x after it.

template <int T, int KS>
struct TcRun {
    u32x4 w[KS][T][2];  // chunk, tile, row g / g + 8: words 4t .. 4t+3 of the chunk
    u32 s[KS][T][2];    // their group's scale bits
    u32 z[KS][T][2];    // and zero point
    u32x4 x[KS][4];     // x[128 c + 32 t + 8 u .. + 7], u = 0..3
};

// Where a lane's loads start: the weight bytes, scales and zero points of its row g in the block's first tile
// (and, with the act·mul epilogue, in its first up tile), and its x. Everything else a run loads lies at a
// compile-time offset from these (K is a template argument), so a load is one instruction with an immediate.
struct TcBase {
    const char* w[2];
    const u16* s[2];
    const u8* z[2];
    const u16* x;
};

template <int T, int ACT>
__device__ __forceinline__ constexpr int tc_base(int i) { return ACT < 0 || i < T / 2 ? 0 : 1; }

template <int T, int ACT>
__device__ __forceinline__ constexpr int tc_row_offset(int i, int h) {  // rows from the tile's base row
    return 16 * (ACT < 0 ? i : i % (T / 2)) + 8 * h;
}

template <int T, int KS, int G, int K, int ACT>
__device__ __forceinline__ void tc_load_weights(TcRun<T, KS>& r, const TcBase& b, int c0) {
    constexpr int KC = K / 128, KG = K / G;
#pragma unroll
    for (int j = 0; j < KS; ++j) {
        const int c = c0 + j;
        if (c < KC) {
            const int grp = (128 * c) / G;
#pragma unroll
            for (int i = 0; i < T; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int base = tc_base<T, ACT>(i);
                    const int rows = tc_row_offset<T, ACT>(i, h);
                    r.w[j][i][h] = ld_stream16(b.w[base] + 64 * c + rows * (K / 2));
                    r.s[j][i][h] = b.s[base][rows * KG + grp];
                    r.z[j][i][h] = b.z[base][rows * KG + grp];
                }
        }
    }
}

template <int T, int KS, int K>
__device__ __forceinline__ void tc_load_x(TcRun<T, KS>& r, const u16* xr, int c0) {
    constexpr int KC = K / 128;
#pragma unroll
    for (int j = 0; j < KS; ++j)
        if (c0 + j < KC)
#pragma unroll
            for (int u = 0; u < 4; ++u) r.x[j][u] = ld_act16(xr + 128 * (c0 + j) + 8 * u);
}

__device__ __forceinline__ u32 tc_low(u32 w) { return (w & NIBBLE_MASK(0)) | 0x48004800u; }   // 8 + code / 128
__device__ __forceinline__ u32 tc_high(u32 w) { return (w & NIBBLE_MASK(1)) | 0x38003800u; }  // 0.5 + code / 128

// one tile's mma over chunk j of a run: acc = the sums of (magic + code / 128) x for its rows g / g + 8 (acc[0, 1] /
// acc[2, 3]) and B's columns 2t, 2t + 1; gemv_tc's columns are all the one row of x, gemv_tc8's its rows
template <int T, int KS>
__device__ __forceinline__ void tc_tile_sum(const TcRun<T, KS>& r, int j, int i, float (&acc)[4]) {
    const u32 wa[4] = {r.w[j][i][0].x, r.w[j][i][0].y, r.w[j][i][0].z, r.w[j][i][0].w};
    const u32 wb[4] = {r.w[j][i][1].x, r.w[j][i][1].y, r.w[j][i][1].z, r.w[j][i][1].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] = 0.f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const u32 a0[4] = {tc_low(wa[u]), tc_low(wb[u]), tc_high(wa[u]), tc_high(wb[u])};
        mma16816(acc, a0, r.x[j][u].x, r.x[j][u].y);  // step 2u: pairs at bits 0 / 16 and 4 / 20
        const u32 ha = wa[u] >> 8, hb = wb[u] >> 8;
        const u32 a1[4] = {tc_low(ha), tc_low(hb), tc_high(ha), tc_high(hb)};
        mma16816(acc, a1, r.x[j][u].z, r.x[j][u].w);  // step 2u + 1: bits 8 / 24 and 12 / 28
    }
}

// Chunk j's sums of this lane's x that fold the magic and the zero point out: magic = 8 Lo + 0.5 Hi and
// per_zero = (Lo + Hi) / 128. A lane's x quad of word u, read as an A fragment, puts that word's low-position pairs
// (k + 0, 1 and k + 4, 5) in row g and its high-position pairs in row g + 8, the same in every lane of a t; against
// B = ones each row sums them over the four lanes t, and four such mma a chunk.
template <int T, int KS>
__device__ __forceinline__ void tc_fold_sums(const TcRun<T, KS>& r, int j, float& magic, float& per_zero) {
    float lh[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const u32 xq[4] = {r.x[j][u].x, r.x[j][u].y, r.x[j][u].z, r.x[j][u].w};
        mma16816(lh, xq, 0x3C003C00u, 0x3C003C00u);
    }
    magic = 8.f * lh[0] + 0.5f * lh[2];
    per_zero = (lh[0] + lh[2]) * (1.f / 128.f);  // exact scaling
}

// one run: each chunk's Lo / Hi, then every tile's rows, their chunk sums scaled into tot (tot holds sum / 128:
// the power of two is applied once at the end)
template <int T, int KS, int K>
__device__ __forceinline__ void tc_compute(const TcRun<T, KS>& r, float (&tot)[T][2], int c0) {
    constexpr int KC = K / 128;
#pragma unroll
    for (int j = 0; j < KS; ++j) {
        if (c0 + j < KC) {
            float magic, per_zero;
            tc_fold_sums(r, j, magic, per_zero);
#pragma unroll
            for (int i = 0; i < T; ++i) {
                float acc[4];
                tc_tile_sum(r, j, i, acc);
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // acc[0]: row g, acc[2]: row g + 8 (every column alike)
                    const float v = fmaf(-(float)r.z[j][i][h], per_zero, acc[2 * h] - magic);
                    tot[i][h] = fmaf(half_to_float((u16)r.s[j][i][h]), v, tot[i][h]);
                }
            }
        }
    }
}

// Block bx covers weight rows 16 T bx .. + 16 T (ACT < 0), or gate rows 16 (T / 2) bx .. and their up rows N / 2
// below (ACT >= 0); the launcher checks that N (N / 2) is a multiple of those, so no row is past the end.
template <int T, int NW, int KS, int G, int K, int ACT = -1>
__global__ void __launch_bounds__(NW * 32)
w4a16_gemv_tc(const u16* x, const u32* __restrict__ qw, const u16* __restrict__ sc, const u8* __restrict__ zp,
              const u16* __restrict__ bias, u16* __restrict__ y, int N, int ldx, int has_bias) {
    static_assert(G % 128 == 0 && K % G == 0, "a 128-k chunk lies in one group");
    static_assert(ACT < 0 || T % 2 == 0, "gate tiles and their up tiles");
    constexpr int KC = K / 128, KG = K / G;
    __shared__ float red[NW][16 * T];
    pdl_release();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = (ACT < 0 ? 16 * T : 8 * T) * blockIdx.x + g;  // row g of the first (gate) tile
    TcBase b;
#pragma unroll
    for (int base = 0; base < (ACT < 0 ? 1 : 2); ++base) {
        const int n = row0 + (base ? N / 2 : 0);
        b.w[base] = (const char*)qw + (size_t)n * (K / 2) + 16 * t;
        b.s[base] = sc + (size_t)n * KG;
        b.z[base] = zp + (size_t)n * KG;
    }
    b.x = x + (size_t)blockIdx.y * ldx + 32 * t;
    float tot[T][2];
#pragma unroll
    for (int i = 0; i < T; ++i) tot[i][0] = tot[i][1] = 0.f;
    TcRun<T, KS> ra, rb;
    int run = warp;
    tc_load_weights<T, KS, G, K, ACT>(ra, b, run * KS);
    if constexpr (kPreloadTwo) tc_load_weights<T, KS, G, K, ACT>(rb, b, (run + NW) * KS);
    pdl_wait();
    tc_load_x<T, KS, K>(ra, b.x, run * KS);
    if constexpr (kPreloadTwo) tc_load_x<T, KS, K>(rb, b.x, (run + NW) * KS);
    for (; run * KS < KC; run += 2 * NW) {  // two runs per trip: ra and rb take turns
        const int nb = run + NW;
        if constexpr (!kPreloadTwo) {  // rb's run: here, or (preloading two) at the end of the trip before
            tc_load_weights<T, KS, G, K, ACT>(rb, b, nb * KS);
            tc_load_x<T, KS, K>(rb, b.x, nb * KS);
        }
        tc_compute<T, KS, K>(ra, tot, run * KS);
        if (nb * KS >= KC) break;
        tc_load_weights<T, KS, G, K, ACT>(ra, b, (nb + NW) * KS);
        tc_load_x<T, KS, K>(ra, b.x, (nb + NW) * KS);
        tc_compute<T, KS, K>(rb, tot, nb * KS);
        if constexpr (kPreloadTwo) {
            tc_load_weights<T, KS, G, K, ACT>(rb, b, (nb + 2 * NW) * KS);
            tc_load_x<T, KS, K>(rb, b.x, (nb + 2 * NW) * KS);
        }
    }
    if (t == 0) {
#pragma unroll
        for (int i = 0; i < T; ++i) {
            red[warp][16 * i + g] = tot[i][0];
            red[warp][16 * i + g + 8] = tot[i][1];
        }
    }
    __syncthreads();
    if constexpr (ACT < 0) {
        u16* yr = y + (size_t)blockIdx.y * N;
        for (int r = threadIdx.x; r < 16 * T; r += NW * 32) {
            const int n = 16 * T * blockIdx.x + r;
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < NW; ++w) v += red[w][r];
            yr[n] = f32_to_f16(128.f * v + (has_bias ? half_to_float(bias[n]) : 0.f));
        }
    } else {
        constexpr int H = T / 2;
        const int half = N / 2;
        u16* yr = y + (size_t)blockIdx.y * half;
        for (int r = threadIdx.x; r < 16 * H; r += NW * 32) {
            const int n = 16 * H * blockIdx.x + r;
            float vg = 0.f, vu = 0.f;
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                vg += red[w][r];
                vu += red[w][16 * H + r];
            }
            const float gt = half_to_float(f32_to_f16(128.f * vg + (has_bias ? half_to_float(bias[n]) : 0.f)));
            const float up = half_to_float(f32_to_f16(128.f * vu + (has_bias ? half_to_float(bias[n + half]) : 0.f)));
            yr[n] = f32_to_f16(half_to_float(f32_to_f16(act_f32<ACT>(gt))) * up);
        }
    }
}


// ---------------------------------------------------------------------------------------------------
// w4a16_gemv_tc8: gemv_tc for 2-8 rows of x (a decode batch), opt-in (VLMCTL_W4A16_GEMV_TC_BATCH) until a GPU
// measures it against w4a16_mma_gemv, which selection runs there. mma_gemv dequantizes every pair to fp16 before its
// mma (about four instructions a pair); here the codes enter A as in gemv_tc (1.25 a pair) and B's eight columns
// are eight rows of x: lane (g, t) loads row m0 + g (rows past M read row M - 1 and are not stored) at the same k
// as gemv_tc's x, so B column g is that row. Lo and Hi differ by column now. gemv_tc's four mma a chunk (x as A,
// ones as B) leave Lo and Hi of row m0 + g in every lane of group g; lane (g, t) sums columns 2t and 2t + 1, so it
// takes their magic and zero sums from lanes 8t and 8t + 4 (four shuffles a chunk). Session 55's version made them
// by eight mma a chunk against a constant A instead, which ptxas rebuilt with four moves before most of them (66
// moves in tc8<2, 8, 1>'s loop of 470 instructions).
// Weights, scales, zero points, the blocks' rows and the warps' runs are gemv_tc's.

template <int T, int KS, int K>
__device__ __forceinline__ void tc8_compute(const TcRun<T, KS>& r, float (&tot)[T][4], int c0, int t) {
    constexpr int KC = K / 128;
#pragma unroll
    for (int j = 0; j < KS; ++j) {
        if (c0 + j < KC) {
            float own_magic, own_per_zero;  // of this lane's row of x, m0 + g
            tc_fold_sums(r, j, own_magic, own_per_zero);
            float magic[2], per_zero[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {  // column 2t + c is x row m0 + 2t + c, whose sums lane 4 (2t + c) holds
                magic[c] = __shfl_sync(0xffffffffu, own_magic, 8 * t + 4 * c);
                per_zero[c] = __shfl_sync(0xffffffffu, own_per_zero, 8 * t + 4 * c);
            }
#pragma unroll
            for (int i = 0; i < T; ++i) {
                float acc[4];
                tc_tile_sum(r, j, i, acc);
#pragma unroll
                for (int h = 0; h < 2; ++h)  // acc[2 h + c]: row g + 8 h, column 2t + c
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float v = fmaf(-(float)r.z[j][i][h], per_zero[c], acc[2 * h + c] - magic[c]);
                        tot[i][2 * h + c] = fmaf(half_to_float((u16)r.s[j][i][h]), v, tot[i][2 * h + c]);
                    }
            }
        }
    }
}

// Blocks as gemv_tc's without act·mul (blockIdx.x: 16 T weight rows; batched steps run the act·mul kernel after
// their gate_up); blockIdx.y: x rows 8 blockIdx.y .. + 7.
template <int T, int NW, int KS, int G, int K>
__global__ void __launch_bounds__(NW * 32)
w4a16_gemv_tc8(const u16* x, const u32* __restrict__ qw, const u16* __restrict__ sc, const u8* __restrict__ zp,
               const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int ldx, int has_bias) {
    static_assert(G % 128 == 0 && K % G == 0, "a 128-k chunk lies in one group");
    constexpr int KC = K / 128, KG = K / G;
    __shared__ float red[NW][8][16 * T];  // [warp][x row of the block][weight row of the block]
    pdl_release();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = 8 * blockIdx.y;
    const int n = 16 * T * blockIdx.x + g;
    TcBase b;
    b.w[0] = (const char*)qw + (size_t)n * (K / 2) + 16 * t;
    b.s[0] = sc + (size_t)n * KG;
    b.z[0] = zp + (size_t)n * KG;
    b.x = x + (size_t)min(m0 + g, M - 1) * ldx + 32 * t;
    float tot[T][4];
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) tot[i][e] = 0.f;
    TcRun<T, KS> ra, rb;
    int run = warp;
    tc_load_weights<T, KS, G, K, -1>(ra, b, run * KS);
    pdl_wait();
    tc_load_x<T, KS, K>(ra, b.x, run * KS);
    for (; run * KS < KC; run += 2 * NW) {  // two runs per trip, as in gemv_tc: ra and rb take turns
        const int nb = run + NW;
        tc_load_weights<T, KS, G, K, -1>(rb, b, nb * KS);
        tc_load_x<T, KS, K>(rb, b.x, nb * KS);
        tc8_compute<T, KS, K>(ra, tot, run * KS, t);
        if (nb * KS >= KC) break;
        tc_load_weights<T, KS, G, K, -1>(ra, b, (nb + NW) * KS);
        tc_load_x<T, KS, K>(ra, b.x, (nb + NW) * KS);
        tc8_compute<T, KS, K>(rb, tot, nb * KS, t);
    }
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int c = 0; c < 2; ++c) red[warp][2 * t + c][16 * i + g + 8 * h] = tot[i][2 * h + c];
    __syncthreads();
    for (int e = threadIdx.x; e < 8 * 16 * T; e += NW * 32) {
        const int col = e / (16 * T), r = e % (16 * T);
        const int m = m0 + col, row = 16 * T * blockIdx.x + r;
        if (m < M) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < NW; ++w) v += red[w][col][r];
            y[(size_t)m * N + row] = f32_to_f16(128.f * v + (has_bias ? half_to_float(bias[row]) : 0.f));
        }
    }
}
