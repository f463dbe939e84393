// decode_step: every layer of a batch-1 decode step of an AWQ decoder in one persistent kernel.
//
// Compiled after w4a16_mma.cu (fused_step.py puts the two sources together), whose helpers it uses:
// dequant2, the tensor-core GEMV's chunk compute (mma_gemv_compute), u32x4 and the fp16 conversions.
//
// Why: at batch 1 a step of kernels (norm, GEMV, attention, combine, GEMV, ...) leaves the memory system
// idle at every kernel boundary: a GEMV cannot read its weights faster than its own loads ramp up, and it
// cannot start them before the kernel it depends on ends (PDL lets it prefetch a little). The int4 weights
// do not depend on the activations, so here one producer warp per block streams the block's share of every
// linear's packed weights, scales and zero points, layer after layer, into a ring of shared-memory slots
// with cp.async.bulk, running as far ahead of the computation as the ring allows, across the grid-wide
// barriers that separate the phases of a layer. The phases (consumer warps, all blocks):
//   1. RMSNorm of the residual stream (each block for itself) -> qkv (+ bias)
//   2. rotary of q and k, the new K/V appended to the paged cache, attention partials over 32-token tiles
//   3. the partials combined per head -> attn
//   4. o projection, added to the residual stream
//   5. RMSNorm -> gate_up, act(gate) * up in the epilogue
//   6. down projection, added to the residual stream
// with a grid barrier before each (all blocks are resident: one block per SM, cooperative launch).
//
// Weights: a block owns a contiguous range of 8-row units of each linear (gate_up: units of 8 gate rows and
// their up rows), rotated by one block per linear so the blocks' totals even out. A ring slot holds one tile:
// 16 weight rows (8 for a linear whose rows are too long for the slot: then A rows 8-15 are not used), or
// 8 gate rows and their 8 up rows, in the packed layout (formats/w4a16.py) as it lies in memory: the tile's
// scales [TR][K/G], zero points [TR][K/G], words [TR][K/8], each copied by one bulk copy per row range.
// A tile's K is split across the consumer warps in pairs of 128-k chunks and multiplied on the tensor cores
// as w4a16_mma_gemv does (W dequantized into A, x in B). Shared-memory banks: a phase of 8 lanes reads rows
// g and g + 1, K/2 bytes apart (a multiple of 128 for most shapes, so the same banks); odd rows therefore
// take a chunk pair in the other order, and lane (g, t) puts x in B's column g in its row's order, so row g's
// result is C[g][g & 1]. x lies in shared memory in 256-byte chunks of 16 pieces, swizzled so that the 8
// lanes of a phase (4 pieces of 2 chunks) hit distinct banks. The warps' sums are added in warp order.
//
// Numerics: as w4a16_mma_gemv (each weight rounded once, fp32 sums); the norms, rotary, residual adds and
// act*mul round where torch's ops do; attention in fp32 with p rounded to fp16 before it meets V (as the
// Triton decode kernel does).

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    unsigned long long state;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;" : "=l"(state) : "r"(bar), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    unsigned long long state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];" : "=l"(state) : "r"(bar) : "memory");
}

// A wait that cannot end (a bug, or blocks that are not all resident) traps instead of hanging the GPU.
#define SPIN_LIMIT (1u << 24)

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0, spins = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        if (++spins == SPIN_LIMIT) __trap();
    }
}

__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ u32x4 lds16(u32 addr) {
    u32x4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ void sts16(u32 addr, const u32x4& v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ u32x4 ld_cg16(const void* p) {  // activations written by other blocks: from L2
    u32x4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u32x2 ld_cg8(const void* p) {
    u32x2 v;
    asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u16 ld_cg_u16(const u16* p) {
    u16 v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ float ld_cg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u32 ld_acquire_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float h2f(u16 h) { return half_to_float(h); }

__device__ __forceinline__ float lo_f(u32 w) { return half_to_float((u16)(w & 0xFFFFu)); }
__device__ __forceinline__ float hi_f(u32 w) { return half_to_float((u16)(w >> 16)); }

#define NEG_INF __int_as_float(0xff800000)

template <int NC>
__device__ __forceinline__ void consumers_sync() {  // the consumer warps only (the producer never joins)
    asm volatile("bar.sync 1, %0;" :: "n"(NC * 32) : "memory");
}

// Byte offset of piece p (x[128 ch + 8 p .. + 7]) of 128-k chunk ch in the x buffer (header: why).
__device__ __forceinline__ u32 x_piece(int ch, int p) {
    return (u32)ch * 256u + 16u * (u32)(p ^ (((p >> 3) & 1) << 1) ^ (ch & 1));
}

// One linear of the step as the tables hold it (int64 fields, fused_step.py writes them).
struct StepLinear {
    const u32* qw;
    const u16* sc;
    const u8* zp;
    const u16* bias;  // or null
    long long n;      // rows (gate_up: pairs)
    long long k;
    long long up;     // gate_up: the row where the up half starts; 0 otherwise
    long long tr;     // rows a tile holds: 16, or 8 (gate_up tiles are 8 pairs = 16 rows)
};

struct StepLayer {
    const u16* in_norm;
    const u16* post_norm;
    u16* kc;  // this layer's K pool [blocks, block_size, n_kv, 128]
    u16* vc;
};

// The block's rows of linear L: whole 8-row units, the blocks' order rotated by L.
__device__ __forceinline__ void block_rows(long long n, int L, int& r0, int& r1) {
    const int nu = (int)(n >> 3);
    const int b = (blockIdx.x + L) % gridDim.x;
    r0 = 8 * (int)((long long)b * nu / gridDim.x);
    r1 = 8 * (int)((long long)(b + 1) * nu / gridDim.x);
}


// The step's grid barrier: every consumer thread's writes before it are visible to every block after it.
// `bar` counts arrivals (zeroed before the launch); the n-th barrier waits for n * gridDim.x of them.
template <int NC>
__device__ __forceinline__ void grid_sync(u32* bar, u32& nsync, int ctid) {
    consumers_sync<NC>();
    ++nsync;
    if (ctid == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(bar) : "memory");
        const u32 target = nsync * gridDim.x;
        u32 spins = 0;
        while (ld_acquire_u32(bar) < target) {
            if (++spins == SPIN_LIMIT) __trap();
        }
    }
    consumers_sync<NC>();
}

// The producer (one lane): every tile of the block's rows of every linear, in the consumers' order.
template <int G>
__device__ void produce(const StepLinear* lins, int nlin, u32 ring, int nslot, int slot_bytes, u32 full0,
                        u32 empty0, int mode) {
    u32 it = 0;
    for (int L = 0; L < nlin; ++L) {
        const StepLinear l = lins[L];
        const int K = (int)l.k, KG = K / G, TR = (int)l.tr;
        const bool pairs = (L & 3) == 2;
        const int step = pairs ? 8 : TR;
        const u32 zp_off = (u32)(TR * KG * 2), w_off = zp_off + (u32)(TR * KG);
        int r0, r1;
        block_rows(l.n, L, r0, r1);
        for (int r = r0; r < r1; r += step) {
            const int R = min(step, r1 - r);
            const u32 s = it % (u32)nslot;
            if (it >= (u32)nslot) mbar_wait(empty0 + 8 * s, ((it / nslot) - 1) & 1);
            const u32 dst = ring + s * (u32)slot_bytes;
            const u32 fb = full0 + 8 * s;
            const int parts = pairs ? 2 : 1;
            if (mode & 1) {  // measurements: the slot "arrives" without its weights
                mbar_arrive(fb);
                ++it;
                continue;
            }
            mbar_expect_tx(fb, (u32)(parts * R * (KG * 3 + K / 2)));
            for (int h = 0; h < parts; ++h) {
                const long long row = h ? l.up + r : r;
                const u32 a0 = 8u * h;  // the part's first A row
                bulk_copy(dst + a0 * KG * 2, l.sc + row * KG, (u32)(R * KG * 2), fb);
                bulk_copy(dst + zp_off + a0 * KG, l.zp + row * KG, (u32)(R * KG), fb);
                bulk_copy(dst + w_off + a0 * (K / 2), l.qw + row * (K / 8), (u32)(R * (K / 2)), fb);
            }
            ++it;
        }
    }
}

// x (K values) into the shared x buffer, from global memory as it is.
template <int NC>
__device__ __forceinline__ void fill_copy(const u16* src, int K, u32 xs, int ctid) {
    for (int P = ctid; P < K / 8; P += NC * 32) sts16(xs + x_piece(P >> 4, P & 15), ld_cg16(src + 8 * P));
    consumers_sync<NC>();
}

// RMSNorm of the residual stream into the x buffer: weight * fp16(x * rsqrt(mean(x^2) + eps)), as ops.rms_norm.
template <int NC>
__device__ void fill_norm(const u16* resid, const u16* w, int D, float eps, u32 xs, float* bred, int ctid) {
    float ss = 0.f;
    for (int P = ctid; P < D / 8; P += NC * 32) {
        const u32x4 v = ld_cg16(resid + 8 * P);
        const u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float lo = lo_f(a[j]), hi = hi_f(a[j]);
            ss += lo * lo + hi * hi;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((ctid & 31) == 0) bred[ctid >> 5] = ss;
    consumers_sync<NC>();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < NC; ++i) total += bred[i];
    const float rstd = rsqrtf(total / (float)D + eps);
    for (int P = ctid; P < D / 8; P += NC * 32) {
        const u32x4 v = ld_cg16(resid + 8 * P);
        const u32x4 wv = *(const u32x4*)(w + 8 * P);
        const u32 a[4] = {v.x, v.y, v.z, v.w}, b[4] = {wv.x, wv.y, wv.z, wv.w};
        u32 o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u16 nlo = f2h(lo_f(a[j]) * rstd), nhi = f2h(hi_f(a[j]) * rstd);
            const u16 ylo = f2h(lo_f(b[j]) * h2f(nlo)), yhi = f2h(hi_f(b[j]) * h2f(nhi));
            o[j] = (u32)ylo | ((u32)yhi << 16);
        }
        sts16(xs + x_piece(P >> 4, P & 15), u32x4{o[0], o[1], o[2], o[3]});
    }
    consumers_sync<NC>();
}

// Two fp16 weights' A-fragment products into four independent accumulators (one per word u: shorter
// dependency chains than mma_gemv_compute's single one); the same products in the same order per chain.
__device__ __forceinline__ void tile_chunk(const u32x4& wa, const u32x4& wb, u32 sa, u32 za, u32 sb, u32 zb,
                                           const u32x4 (&x)[4], float (&acc)[4][4]) {
    u32 zfa, s2a, sla, zfb, s2b, slb;
    group_consts<0>(sa, za, zfa, s2a, sla);
    group_consts<0>(sb, zb, zfb, s2b, slb);
    const u32 wav[4] = {wa.x, wa.y, wa.z, wa.w}, wbv[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 a[4];
            a[0] = dequant2(wav[u], 8 * h, zfa, s2a);
            a[1] = dequant2(wbv[u], 8 * h, zfb, s2b);
            a[2] = dequant2(wav[u], 8 * h + 4, zfa, s2a);
            a[3] = dequant2(wbv[u], 8 * h + 4, zfb, s2b);
            mma16816(acc[u], a, h ? x[u].z : x[u].x, h ? x[u].w : x[u].y);
        }
    }
}

__device__ __forceinline__ u32 lds_u16(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

__device__ __forceinline__ u32 lds_u8(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// One linear's phase: the block's tiles, as the producer sends them. kind: 0 qkv (out = qkv, + bias), 1 o and
// 3 down (added to the residual stream), 2 gate_up (out = act(gate) * up).
// A tile's K is split across the warps; they add their partial sums through shared memory (in warp order)
// behind a consumer barrier, and threads 0-15 write the tile's outputs.
// A tile of 8 long rows (TR 8) puts the second part of each row's K in A rows 8-15 ("split"): A row g + 8 is
// row g's chunks from `first` on, multiplied by B columns 4-7, which hold x from there (lanes g >= 4 load it);
// row g's result is C[g][g & 1] + C[g + 8][4 + (g & 1)].
// The epilogue's residual values (or biases) of the block's rows are loaded when the phase starts and put in
// shared memory with the first tile, so no tile waits on a global load.
template <int NC, int G>
__device__ void gemv_phase(const StepLinear& l, int L, int kind, u32 ring, int nslot, int slot_bytes, u32 full0,
                           u32 empty0, u32& it, u32 xs, float* red, u16* pre_s, u32& rbuf, u16* out, u16* resid,
                           int act_kind, int ctid, int mode) {
    const int warp = ctid >> 5, lane = ctid & 31, g = lane >> 2, t = lane & 3;
    const int K = (int)l.k, KG = K / G, TR = (int)l.tr, KCH = K >> 7;
    const bool pairs = kind == 2, split = TR == 8;
    const int first = split ? 2 * ((KCH + 3) / 4) : KCH;  // chunks of A rows 0-7 (all of K unless split)
    const int np = first >> 1;
    const int step = pairs ? 8 : TR;
    const u32 zp_off = (u32)(TR * KG * 2), w_off = zp_off + (u32)(TR * KG);
    const int rowb = K >> 1;
    const int sw = (rowb & 127) == 0 ? (g & 1) : 0;
    const int rb_row = split ? g : g + 8;  // the slot row A row g + 8 reads
    int r0, r1;
    block_rows(l.n, L, r0, r1);
    const int nrows = r1 - r0;
    const bool use_pre = (kind == 1 || kind == 3 || (kind == 0 && l.bias)) && nrows <= NC * 32;
    u32 pre = 0;
    if (use_pre && ctid < nrows) pre = kind == 0 ? l.bias[r0 + ctid] : ld_cg_u16(resid + r0 + ctid);
    for (int r = r0; r < r1; r += step) {
        const int R = min(step, r1 - r);
        const u32 s = it % (u32)nslot;
        mbar_wait(full0 + 8 * s, (it / nslot) & 1);
        const u32 slot = ring + s * (u32)slot_bytes;
        float acc[4][4] = {};
        for (int cp = warp; cp < ((mode & 2) ? 0 : np); cp += NC) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = 2 * cp + (e ^ sw);
                const int cb = split ? first + c : c;
                const bool vb = cb < KCH;
                const u32 wrow = slot + w_off + (u32)(16 * t);
                const u32x4 wa = lds16(wrow + (u32)(g * rowb + c * 64));
                const u32 ga = (u32)(g * KG + (c * 128 + 32 * t) / G);
                const u32 gb = (u32)(rb_row * KG + (cb * 128 + 32 * t) / G);
                const u32 sa = lds_u16(slot + 2 * ga), za = lds_u8(slot + zp_off + ga);
                u32x4 wb = u32x4{0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u};  // code 8 - zero 8: zeros
                u32 sb = 0, zb = 8;
                if (vb) {
                    wb = lds16(wrow + (u32)(rb_row * rowb + cb * 64));
                    sb = lds_u16(slot + 2 * gb);
                    zb = lds_u8(slot + zp_off + gb);
                }
                const int xc = (split && g >= 4 && vb) ? cb : c;
                u32x4 xv[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) xv[u] = lds16(xs + x_piece(xc, 4 * t + u));
                tile_chunk(wa, wb, sa, za, sb, zb, xv, acc);
            }
        }
        float* rb = red + rbuf * (NC * 16);
        float sum[4];  // C[g][2t], C[g][2t + 1], C[g + 8][2t], C[g + 8][2t + 1] over the four chains
#pragma unroll
        for (int e = 0; e < 4; ++e) sum[e] = acc[0][e] + acc[1][e] + acc[2][e] + acc[3][e];
        const bool odd = g & 1;  // (not an index: a register array indexed at run time would go to local memory)
        if (t == 0) rb[warp * 16 + g] = odd ? sum[1] : sum[0];
        if (t == (split ? 2 : 0)) rb[warp * 16 + g + 8] = odd ? sum[3] : sum[2];
        if (r == r0 && use_pre && ctid < nrows) pre_s[ctid] = (u16)pre;
        consumers_sync<NC>();
        if (ctid == 0) mbar_arrive(empty0 + 8 * s);
        if (ctid < R) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < NC; ++w) v += rb[w * 16 + ctid];
            if (split) {
#pragma unroll
                for (int w = 0; w < NC; ++w) v += rb[w * 16 + 8 + ctid];
            }
            const int row = r + ctid;
            const u16 pv = use_pre ? pre_s[row - r0] : 0;
            if (kind == 0) {
                out[row] = f2h(v + (l.bias ? h2f(use_pre ? pv : l.bias[row]) : 0.f));
            } else if (kind == 2) {
                float u = 0.f;
#pragma unroll
                for (int w = 0; w < NC; ++w) u += rb[w * 16 + 8 + ctid];
                const float gf = h2f(f2h(v));
                float a;
                if (act_kind == 0) {
                    a = gf / (1.f + __expf(-gf));
                } else {
                    const float inner = 0.7978845608028654f * (gf + 0.044715f * gf * gf * gf);
                    a = 0.5f * gf * (1.f + tanhf(inner));
                }
                out[row] = f2h(h2f(f2h(a)) * h2f(f2h(u)));
            } else {
                resid[row] = f2h(h2f(use_pre ? pv : ld_cg_u16(resid + row)) + h2f(f2h(v)));
            }
        }
        rbuf ^= 1u;
        ++it;
    }
}

// Rotary of one pair (d, d + 64) of a head, in fp16 as ops.rope_and_cache rounds it.
__device__ __forceinline__ void rope_pair(float x1, float x2, float c, float s, u16& o1, u16& o2) {
    o1 = f2h(h2f(f2h(x1 * c)) + h2f(f2h(-x2 * s)));
    o2 = f2h(h2f(f2h(x2 * c)) + h2f(f2h(x1 * s)));
}

// The rotated q of KV head kvh's grp query heads into shared memory at qs, 256 bytes a head: lane's pair (d, d + 64)
// at 2 lane and 2 lane + 128, its pair (d + 32, d + 96) at 2 lane + 64 and 2 lane + 192 (c0 / s0, c1 / s1: the
// rotary's cos / sin of dims lane and lane + 32).
__device__ __forceinline__ void stage_rotated_q(const u16* qkv, int kvh, int grp, int lane, float c0, float s0,
                                                float c1, float s1, u32 qs) {
    for (int j = 0; j < grp; ++j) {
        const u16* qh = qkv + (size_t)(kvh * grp + j) * 128;
        const float x0 = h2f(ld_cg_u16(qh + lane)), x1 = h2f(ld_cg_u16(qh + lane + 32));
        const float y0 = h2f(ld_cg_u16(qh + lane + 64)), y1 = h2f(ld_cg_u16(qh + lane + 96));
        u16 o1, o2, o3, o4;
        rope_pair(x0, y0, c0, s0, o1, o2);
        rope_pair(x1, y1, c1, s1, o3, o4);
        const u32 q = qs + (u32)(j * 256);
        asm volatile("st.shared.u16 [%0], %1;" :: "r"(q + 2 * lane), "h"(o1) : "memory");
        asm volatile("st.shared.u16 [%0], %1;" :: "r"(q + 2 * lane + 64), "h"(o3) : "memory");
        asm volatile("st.shared.u16 [%0], %1;" :: "r"(q + 2 * lane + 128), "h"(o2) : "memory");
        asm volatile("st.shared.u16 [%0], %1;" :: "r"(q + 2 * lane + 192), "h"(o4) : "memory");
    }
}

// The new token's K (rotated) and V of KV head kvh appended to the cache at `slot`, and kept in shared memory
// (knew, vnew: 256 bytes each, in dim order) for the tile that holds the token.
__device__ __forceinline__ void append_new_kv(const StepLayer& ly, const u16* qkv, int kvh, int n_heads, int n_kv,
                                              int slot, int lane, float c0, float s0, float c1, float s1, u32 knew,
                                              u32 vnew) {
    const u16* kh = qkv + (size_t)(n_heads + kvh) * 128;
    const u16* vh = qkv + (size_t)(n_heads + n_kv + kvh) * 128;
    u16* kd = ly.kc + ((size_t)slot * n_kv + kvh) * 128;
    u16* vd = ly.vc + ((size_t)slot * n_kv + kvh) * 128;
    u16 o[4];
    rope_pair(h2f(ld_cg_u16(kh + lane)), h2f(ld_cg_u16(kh + lane + 64)), c0, s0, o[0], o[2]);
    rope_pair(h2f(ld_cg_u16(kh + lane + 32)), h2f(ld_cg_u16(kh + lane + 96)), c1, s1, o[1], o[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u16 v = ld_cg_u16(vh + lane + 32 * i);
        kd[lane + 32 * i] = o[i];
        vd[lane + 32 * i] = v;
        asm volatile("st.shared.u16 [%0], %1;" :: "r"(knew + 2 * (lane + 32 * i)), "h"(o[i]) : "memory");
        asm volatile("st.shared.u16 [%0], %1;" :: "r"(vnew + 2 * (lane + 32 * i)), "h"(v) : "memory");
    }
}

// One 32-token tile's attention partials for the grp query heads of KV head kvh, after stage_rotated_q (and, in the
// tile with the new token, append_new_kv and a warp sync): lane = token for the scores, dims 4 lane .. + 3 for V.
// kr: the lane's cached K row; its V rows are vv (VPRE, loaded earlier) or loaded here, token u's from cache row
// `row` of lane u. The new token (lane newu of the last tile) takes K and V from shared memory instead of the cache,
// so no load waits for that step's store. Partials: [head][tile] records of 132 floats (un-normalized output [128],
// max, sum), log2 domain.
template <bool VPRE>
__device__ __forceinline__ void tile_partials(u32x4 (&kr)[16], const u32x2 (&vv)[32], const StepLayer& ly,
                                              long long row, int kvh, int n_kv, int grp, int tile, bool valid,
                                              bool newtile, int newu, float scale_log2, u32 qs, u32 knew, u32 vnew,
                                              float* part, int max_tiles, int lane) {
    if (newtile && lane == newu) {
#pragma unroll
        for (int i = 0; i < 16; ++i) kr[i] = lds16(knew + 16u * i);
    }
    u32x2 vn = u32x2{0u, 0u};
    if (newtile) asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(vn.x), "=r"(vn.y) : "r"(vnew + 8u * lane));
    for (int j = 0; j < grp; ++j) {
        float sc = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32x4 qv = lds16(qs + (u32)(j * 256 + 16 * i));
            const u32 qa[4] = {qv.x, qv.y, qv.z, qv.w}, ka[4] = {kr[i].x, kr[i].y, kr[i].z, kr[i].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) sc += lo_f(qa[e]) * lo_f(ka[e]) + hi_f(qa[e]) * hi_f(ka[e]);
        }
        sc = valid ? sc * scale_log2 : NEG_INF;
        float m = sc;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const float p = valid ? exp2f(sc - m) : 0.f;
        float lsum = p;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
        const u32 p16 = f2h(p);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int u = 0; u < 32; ++u) {
            const float pu = h2f((u16)__shfl_sync(0xffffffffu, p16, u));
            u32x2 v;
            if constexpr (VPRE) {
                v = vv[u];
            } else {
                const long long ru = __shfl_sync(0xffffffffu, row, u);
                v = ld_cg8(ly.vc + ((size_t)ru * n_kv + kvh) * 128 + 4 * lane);
            }
            if (newtile && u == newu) v = vn;
            acc[0] += pu * lo_f(v.x);
            acc[1] += pu * hi_f(v.x);
            acc[2] += pu * lo_f(v.y);
            acc[3] += pu * hi_f(v.y);
        }
        float* pp = part + ((size_t)(kvh * grp + j) * max_tiles + tile) * 132;
        asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(pp + 4 * lane), "f"(acc[0]), "f"(acc[1]),
                     "f"(acc[2]), "f"(acc[3]) : "memory");
        if (lane == 0) {
            pp[128] = m;
            pp[129] = lsum;
        }
    }
}

// Attention partials: one warp per (KV head, 32-token tile) item, its q rotated into shared memory, the tile with the
// new token rotating its K and appending K and V to the cache, then the tile's partials (tile_partials). Per warp in
// the x buffer: the rotated q of its heads (grp x 256 bytes), then the new token's K and V (256 bytes each).
template <int NC>
__device__ void attention_phase(const StepLayer& ly, const u16* qkv, float* part, int pos, int slot, int ctx,
                                const int* bt, const float* cos_sin, int n_heads, int n_kv, int block_size,
                                int max_tiles, float scale_log2, u32 xs, int ctid) {
    const int warp = ctid >> 5, lane = ctid & 31;
    const int grp = n_heads / n_kv;
    const int ntiles = (ctx + 31) >> 5;
    const int items = n_kv * ntiles;
    const u32 qs = xs + (u32)(warp * (grp + 2) * 256), knew = qs + (u32)(grp * 256), vnew = knew + 256u;
    const float* cs = cos_sin + (size_t)pos * 128;
    const float c0 = h2f(f2h(cs[lane])), c1 = h2f(f2h(cs[lane + 32]));
    const float s0 = h2f(f2h(cs[64 + lane])), s1 = h2f(f2h(cs[64 + lane + 32]));
    for (int item = blockIdx.x * NC + warp; item < items; item += gridDim.x * NC) {
        const int kvh = item / ntiles, tile = item % ntiles;
        const int tok = tile * 32 + lane;
        const bool valid = tok < ctx;
        const int blk = valid ? bt[tok / block_size] : 0;  // issued with the q loads below
        stage_rotated_q(qkv, kvh, grp, lane, c0, s0, c1, s1, qs);
        const bool newtile = tile == ntiles - 1;
        const int newu = ctx - 1 - tile * 32;  // the new token's lane in its tile
        if (newtile) append_new_kv(ly, qkv, kvh, n_heads, n_kv, slot, lane, c0, s0, c1, s1, knew, vnew);
        __syncwarp();
        // tokens past the context read block 0's first row (never handed out) and get p = 0
        const long long row = valid ? (long long)blk * block_size + tok % block_size : 0;
        u32x4 kr[16];
        const u16* krow = ly.kc + ((size_t)row * n_kv + kvh) * 128;
#pragma unroll
        for (int i = 0; i < 16; ++i) kr[i] = ld_cg16(krow + 8 * i);
        u32x2 vv[32];
#pragma unroll
        for (int u = 0; u < 32; ++u) {
            const long long ru = __shfl_sync(0xffffffffu, row, u);
            vv[u] = ld_cg8(ly.vc + ((size_t)ru * n_kv + kvh) * 128 + 4 * lane);
        }
        tile_partials<true>(kr, vv, ly, row, kvh, n_kv, grp, tile, valid, newtile, newu, scale_log2, qs, knew, vnew,
                            part, max_tiles, lane);
        __syncwarp();
    }
}

// The partials of each head combined (one warp per head, one pass with a running max) -> attn [n_heads * 128].
template <int NC>
__device__ void combine_phase(const float* part, u16* attn, int ctx, int n_heads, int max_tiles, int ctid) {
    const int warp = ctid >> 5, lane = ctid & 31;
    const int ntiles = (ctx + 31) >> 5;
    for (int h = blockIdx.x * NC + warp; h < n_heads; h += gridDim.x * NC) {
        const float* ph = part + (size_t)h * max_tiles * 132;
        float M = NEG_INF, lsum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int tt = 0; tt < ntiles; ++tt) {
            const float* pp = ph + tt * 132;
            const float m = ld_cg_f32(pp + 128), l = ld_cg_f32(pp + 129);
            const u32x4 v = ld_cg16(pp + 4 * lane);
            const float Mn = fmaxf(M, m);
            const float a = exp2f(M - Mn), b = exp2f(m - Mn);
            lsum = lsum * a + l * b;
            acc[0] = acc[0] * a + as_float(v.x) * b;
            acc[1] = acc[1] * a + as_float(v.y) * b;
            acc[2] = acc[2] * a + as_float(v.z) * b;
            acc[3] = acc[3] * a + as_float(v.w) * b;
            M = Mn;
        }
        const float inv = 1.f / lsum;
        const u32 lo = (u32)f2h(acc[0] * inv) | ((u32)f2h(acc[1] * inv) << 16);
        const u32 hi = (u32)f2h(acc[2] * inv) | ((u32)f2h(acc[3] * inv) << 16);
        *(u32x2*)(attn + (size_t)h * 128 + 4 * lane) = u32x2{lo, hi};
    }
}

template <int NC, int G>
__global__ void __launch_bounds__((NC + 1) * 32, 1)
decode_step(const StepLinear* lins, const StepLayer* layers, u16* resid, u16* qkv, u16* attn, u16* act,
            float* part, u32* bar, const int* pos_p, const int* slot_p, const int* ctx_p, const int* bt,
            const float* cos_sin, int n_layers, int D, int n_heads, int n_kv, int block_size, int max_tiles,
            int scale_log2_bits, int eps_bits, int nslot, int slot_bytes, int x_bytes, int act_kind,
            unsigned long long* trace, int mode) {
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 base = smem_addr(smem);
    const u32 ring = base, xs = base + (u32)(nslot * slot_bytes);
    float* red = (float*)(smem + nslot * slot_bytes + x_bytes);  // [2][NC][16]: the warps' sums of a tile
    float* bred = red + 2 * NC * 16;                             // [NC]: a norm's partial sums
    u16* pre_s = (u16*)(bred + NC);                              // [NC * 32]: a phase's residuals or biases
    const u32 full0 = base + (u32)(nslot * slot_bytes + x_bytes + (2 * NC * 16 + NC) * 4 + NC * 64 + 7) / 8 * 8;
    const u32 empty0 = full0 + 8u * (u32)nslot;
    if (threadIdx.x == 0) {
        for (int s = 0; s < nslot; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5;
    if (warp == NC) {
        if ((threadIdx.x & 31) == 0) produce<G>(lins, 4 * n_layers, ring, nslot, slot_bytes, full0, empty0, mode);
        return;
    }
    const int ctid = threadIdx.x;
    const float scale_log2 = __int_as_float(scale_log2_bits), eps = __int_as_float(eps_bits);
    const int pos = pos_p[0], slot = slot_p[0], ctx = ctx_p[0];  // the step's inputs, copied before the launch
    u32 it = 0, rbuf = 0, nsync = 0, ntr = 0;
    const bool tracing = trace != nullptr && blockIdx.x == 0 && ctid == 0;
#define MARK() do { if (tracing) { unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); trace[ntr++] = t_; } } while (0)
    for (int li = 0; li < n_layers; ++li) {
        const StepLayer ly = layers[li];
        const StepLinear* l4 = lins + 4 * li;
        if (li > 0) grid_sync<NC>(bar, nsync, ctid);
        MARK();
        fill_norm<NC>(resid, ly.in_norm, D, eps, xs, bred, ctid);
        MARK();
        gemv_phase<NC, G>(l4[0], 4 * li, 0, ring, nslot, slot_bytes, full0, empty0, it, xs, red, pre_s, rbuf, qkv, resid,
                          act_kind, ctid, mode);
        MARK();
        grid_sync<NC>(bar, nsync, ctid);
        MARK();
        attention_phase<NC>(ly, qkv, part, pos, slot, ctx, bt, cos_sin, n_heads, n_kv, block_size, max_tiles,
                            scale_log2, xs, ctid);
        MARK();
        grid_sync<NC>(bar, nsync, ctid);
        MARK();
        combine_phase<NC>(part, attn, ctx, n_heads, max_tiles, ctid);
        MARK();
        grid_sync<NC>(bar, nsync, ctid);
        MARK();
        fill_copy<NC>(attn, n_heads * 128, xs, ctid);
        MARK();
        gemv_phase<NC, G>(l4[1], 4 * li + 1, 1, ring, nslot, slot_bytes, full0, empty0, it, xs, red, pre_s, rbuf, nullptr,
                          resid, act_kind, ctid, mode);
        MARK();
        grid_sync<NC>(bar, nsync, ctid);
        MARK();
        fill_norm<NC>(resid, ly.post_norm, D, eps, xs, bred, ctid);
        MARK();
        gemv_phase<NC, G>(l4[2], 4 * li + 2, 2, ring, nslot, slot_bytes, full0, empty0, it, xs, red, pre_s, rbuf, act, resid,
                          act_kind, ctid, mode);
        MARK();
        grid_sync<NC>(bar, nsync, ctid);
        MARK();
        fill_copy<NC>(act, (int)l4[3].k, xs, ctid);
        MARK();
        gemv_phase<NC, G>(l4[3], 4 * li + 3, 3, ring, nslot, slot_bytes, full0, empty0, it, xs, red, pre_s, rbuf, nullptr,
                          resid, act_kind, ctid, mode);
        MARK();
    }
}
