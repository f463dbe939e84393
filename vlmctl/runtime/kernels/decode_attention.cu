// Decode attention for small batches, with the new token's rotary and KV append folded in: the CUDA
// counterpart of paged_attention.py's `_decode_rope_kernel` (same inputs, same split workspace, same
// result up to the order of float32 sums), written to shorten the chain of dependent memory round trips
// that a batch-1 step pays once per layer.
//
// Why: at batch 1 the Triton kernel took ~10.5 us a layer for a ~2.6 us KV read on an H200
// (docs/benchmarks.md, session 21). After its griddepcontrol.wait it loads the context length, then the
// position, then the rotary table, then the block table, then K, then V, each waiting for the one before.
// None of those depend on the kernel before it (the qkv GEMV): the lengths, positions, slots and block
// tables are step inputs, written before the step's first kernel, and the cached K/V rows it reads
// (positions < context - 1) were written by earlier steps. So this kernel reads all of them, and starts
// the cp.async copies of its first STAGES tiles of K and V into shared memory, BEFORE the wait, while the
// GEMV still runs; after the wait it loads q, k and v of the new token (the GEMV's output), rotates them,
// and computes from shared memory. That widens `kernels/pdl.py`'s contract for this one kernel (step
// inputs and earlier steps' cache rows may be read before the wait); it still writes nothing before it.
//
// Layout: grid (sequence, KV head, split), 4 warps. A split owns positions [start, end) of the context in
// whole 16-position tiles (`T`), the splits cover [lo, context - 1) (lo > 0 with a sliding window); the split
// whose span holds the last position (the "owner") appends the new token's K/V at its slot and attends to
// it from registers. Each warp takes T / 4 positions of every tile; lane l holds head dims [E l, E l + E)
// (E = head_dim / 32) of q and of every K/V row it reads, so a score is E multiply-adds and a 5-step
// shuffle reduction, and the rotary partner of a dim (d + head_dim / 2) sits in lane l ^ 16. Each warp keeps
// an online softmax (max, sum, un-normalized output) per q head of the KV head's group (GP: the group
// rounded up to a power of two, at most 8); the warps' states are merged in shared memory, then written as
// the split's partial (or, unsplit, divided and stored). With splits the last split of a (sequence, KV head)
// to finish, counted by an arrival counter (zero before and after), merges the splits' partials in split
// order, as `_combine_head` does, and resets the counter.
//
// Rounding follows the Triton kernel: the rotary's cos/sin are rounded to the model dtype, each product is
// rounded to it (mul.rn, not contracted into an FMA), their difference or sum is rounded once more; scores,
// softmax and the weighted sum of V are float32 (the Triton kernel rounds p to the model dtype before its
// PV dot; here p stays float32).
//
// Compiled at run time by NVRTC (cuda_rtc.py); no headers, so conversions and the cp.async and cache
// operators are inline PTX, each in a helper of one instruction (tests/cuda_host.py runs the kernel on the
// CPU with those helpers emulated).

typedef unsigned int u32;
typedef unsigned short u16;

#define T 16         // positions per tile
#define NWARPS 4
#define STAGES 4     // tiles of K and V in flight (the first STAGES are requested before the wait)
#define NEG_INF __int_as_float(0xff800000)
#define MAX_SPLITS 32  // splits of a context at most (paged_attention.choose_splits caps them there)

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

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {  // invalid: 16 zero bytes
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {  // all but the newest N groups have landed
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {  // round to nearest even
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {  // round to nearest even
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

template <int BF16>
__device__ __forceinline__ float to_f32(u16 h) {
    if constexpr (BF16) return __uint_as_float((u32)h << 16);
    return f16_to_f32(h);
}

template <int BF16>
__device__ __forceinline__ u16 from_f32(float f) {
    if constexpr (BF16) return f32_to_bf16(f);
    return f32_to_f16(f);
}

template <int BF16>
__device__ __forceinline__ float round_dt(float f) { return to_f32<BF16>(from_f32<BF16>(f)); }

__device__ __forceinline__ float mul_rn(float a, float b) {  // a product that is never fused into an FMA
    float c;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(c) : "f"(a), "f"(b));
    return c;
}

// E consecutive 16-bit values (E = 1, 2, 4 or 8; 2E-byte aligned) as float32
template <int E, int BF16>
__device__ __forceinline__ void load_row(const u16* p, float (&v)[E]) {
    if constexpr (E == 8) {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        const u32 a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) { v[2 * i] = to_f32<BF16>(a[i] & 0xFFFF); v[2 * i + 1] = to_f32<BF16>(a[i] >> 16); }
    } else if constexpr (E == 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        v[0] = to_f32<BF16>(w.x & 0xFFFF); v[1] = to_f32<BF16>(w.x >> 16);
        v[2] = to_f32<BF16>(w.y & 0xFFFF); v[3] = to_f32<BF16>(w.y >> 16);
    } else if constexpr (E == 2) {
        const u32 w = *reinterpret_cast<const u32*>(p);
        v[0] = to_f32<BF16>(w & 0xFFFF); v[1] = to_f32<BF16>(w >> 16);
    } else {
        v[0] = to_f32<BF16>(*p);
    }
}

// E values rounded to the model dtype, stored at p
template <int E, int BF16>
__device__ __forceinline__ void store_row(u16* p, const float (&v)[E]) {
#pragma unroll
    for (int i = 0; i < E; ++i) p[i] = from_f32<BF16>(v[i]);
}

__device__ __forceinline__ float ld_cg(const float* p) {  // another block's write, after an acquire: not from L1
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ int take_ticket_acq_rel(int* counter) {  // the count before this increment
    int got;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(got) : "l"(counter) : "memory");
    return got;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// lane l's E dims of one head of the new token, rotated (x cos -/+ partner sin, rounded per term as the
// Triton kernel does); c and s are the lane's rotary coefficients, already rounded to the model dtype
template <int E, int BF16>
__device__ __forceinline__ void rotate(float (&x)[E], const float (&c)[E], const float (&s)[E], int lane) {
    const bool first = lane < 16;
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const float partner = __shfl_xor_sync(0xffffffffu, x[i], 16);
        const float a = round_dt<BF16>(mul_rn(x[i], c[i]));
        const float b = round_dt<BF16>(mul_rn(partner, s[i]));
        x[i] = round_dt<BF16>(first ? a - b : a + b);
    }
}

// EARLY 0: the same kernel with its wait first, for the A/B measurement of reading ahead (session 21 saw a Triton
// build that loaded its first tile before the wait slow the step: its programs held SM slots that the qkv GEMV's
// last blocks needed)
template <int E, int GP, int BF16, int EARLY>
__global__ void __launch_bounds__(NWARPS * 32)
decode_attention_rope(const u16* qkv, const float* __restrict__ cos_sin, const void* pos_ptr, const void* slot_ptr,
                      u16* k_cache, u16* v_cache, const int* __restrict__ block_tables, const int* __restrict__ lens,
                      u16* out, float* part, float* ml, int* cnt,
                      int stride_qt, int stride_cs, int stride_kb, int stride_ks, int stride_kh, int stride_bt,
                      int stride_ot, int stride_oh, float scale_log2, int block_size, int group, int num_splits,
                      int n_q, int n_kv, int window, int pos64, int slot64) {
    constexpr int D = 32 * E, HALF = D / 2;
    constexpr int CPR = D / 8;  // 16-byte copies per K or V row
    constexpr int PW = T / NWARPS;  // positions of a tile per warp
    extern __shared__ __align__(16) unsigned char smem[];
    u16* ks = reinterpret_cast<u16*>(smem);  // [STAGES][T][D]
    u16* vs = ks + STAGES * T * D;           // [STAGES][T][D]
    __shared__ int last_flag;

    pdl_release();
    if constexpr (!EARLY) pdl_wait();
    const int seq = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    // ---- before the wait: step inputs and earlier steps' cache rows only ----
    const int ctx = lens[seq];
    const int lo = window > 0 ? max(ctx - window, 0) : 0;
    const int per = ((ctx - lo + num_splits - 1) / num_splits + T - 1) / T * T;  // positions per split, whole tiles
    const int start = lo + split * per;
    const int end = min(start + per, ctx - 1);  // cached positions; the new one (ctx - 1) comes from qkv
    const int ntiles = end > start ? (end - start + T - 1) / T : 0;
    const bool owner = split == (ctx - 1 - lo) / per;
    const int* bt = block_tables + (size_t)seq * stride_bt;
    const size_t head_off = (size_t)kvh * stride_kh;

    auto load_tile = [&](int i) {  // tile i of the split into ring slot i % STAGES
        const int tok0 = start + i * T;
        const u32 kdst = smem_addr(ks + (i % STAGES) * T * D), vdst = smem_addr(vs + (i % STAGES) * T * D);
        for (int c = tid; c < T * CPR; c += NWARPS * 32) {
            const int r = c / CPR, piece = c % CPR;
            const int tok = tok0 + r;
            const bool valid = tok < end;
            const int t = valid ? tok : start;  // a readable address; nothing is read from it
            const size_t src = (size_t)bt[t / block_size] * stride_kb + (size_t)(t % block_size) * stride_ks
                               + head_off + 8 * piece;
            const u32 off = (u32)(r * D + 8 * piece) * 2;
            cp_async16(kdst + off, k_cache + src, valid);
            cp_async16(vdst + off, v_cache + src, valid);
        }
    };
#pragma unroll
    for (int i = 0; i < STAGES; ++i) {
        if (i < ntiles) load_tile(i);
        cp_async_commit();
    }
    const long long pos = pos64 ? static_cast<const long long*>(pos_ptr)[seq] : static_cast<const int*>(pos_ptr)[seq];
    float c[E], s[E];
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int j = (E * lane + i) % HALF;
        c[i] = round_dt<BF16>(cos_sin[pos * stride_cs + j]);
        s[i] = round_dt<BF16>(cos_sin[pos * stride_cs + HALF + j]);
    }

    if constexpr (EARLY) pdl_wait();
    // ---- after it: the new token's q, k, v (the qkv GEMV's output), then everything the kernel writes ----
    const u16* row = qkv + (size_t)seq * stride_qt;
    float q[GP][E];
#pragma unroll
    for (int g = 0; g < GP; ++g) {
        if (g < group) {
            load_row<E, BF16>(row + (size_t)(kvh * group + g) * D + E * lane, q[g]);
            rotate<E, BF16>(q[g], c, s, lane);
        } else {
#pragma unroll
            for (int i = 0; i < E; ++i) q[g][i] = 0.f;
        }
    }
    float m[GP], l[GP], acc[GP][E];
#pragma unroll
    for (int g = 0; g < GP; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i) acc[g][i] = 0.f;
    }

    for (int it = 0; it < ntiles; ++it) {
        cp_async_wait<STAGES - 1>();  // this thread's copies of tile `it` have landed
        __syncthreads();
        const u16* kt = ks + (it % STAGES) * T * D;
        const u16* vt = vs + (it % STAGES) * T * D;
        float sc[GP][PW];
#pragma unroll
        for (int j = 0; j < PW; ++j) {
            const int r = warp * PW + j;
            const bool valid = start + it * T + r < end;
            float kf[E];
            load_row<E, BF16>(kt + r * D + E * lane, kf);
#pragma unroll
            for (int g = 0; g < GP; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < E; ++i) dot = fmaf(q[g][i], kf[i], dot);
                dot = warp_sum(dot);
                sc[g][j] = valid ? dot * scale_log2 : NEG_INF;
            }
        }
        float vf[PW][E];
#pragma unroll
        for (int j = 0; j < PW; ++j) load_row<E, BF16>(vt + (warp * PW + j) * D + E * lane, vf[j]);
#pragma unroll
        for (int g = 0; g < GP; ++g) {
            float mt = sc[g][0];
#pragma unroll
            for (int j = 1; j < PW; ++j) mt = fmaxf(mt, sc[g][j]);
            const float m_new = fmaxf(m[g], mt);
            if (m_new == NEG_INF) continue;  // nothing valid seen yet
            const float alpha = exp2f(m[g] - m_new);
            l[g] *= alpha;
#pragma unroll
            for (int i = 0; i < E; ++i) acc[g][i] *= alpha;
#pragma unroll
            for (int j = 0; j < PW; ++j) {
                const float p = exp2f(sc[g][j] - m_new);
                l[g] += p;
#pragma unroll
                for (int i = 0; i < E; ++i) acc[g][i] = fmaf(p, vf[j][i], acc[g][i]);
            }
            m[g] = m_new;
        }
        __syncthreads();  // every warp is done with the slot before it is refilled
        if (it + STAGES < ntiles) load_tile(it + STAGES);
        cp_async_commit();
    }
    cp_async_wait_all();

    if (owner && warp == 0) {  // the new token: appended to the cache and attended from registers
        float kn[E], vn[E];
        load_row<E, BF16>(row + (size_t)(n_q + kvh) * D + E * lane, kn);
        load_row<E, BF16>(row + (size_t)(n_q + n_kv + kvh) * D + E * lane, vn);
        rotate<E, BF16>(kn, c, s, lane);
        const long long slot = slot64 ? static_cast<const long long*>(slot_ptr)[seq]
                                      : static_cast<const int*>(slot_ptr)[seq];
        const size_t dst = (size_t)(slot / block_size) * stride_kb + (size_t)(slot % block_size) * stride_ks
                           + head_off + E * lane;
        store_row<E, BF16>(k_cache + dst, kn);
        store_row<E, BF16>(v_cache + dst, vn);
#pragma unroll
        for (int g = 0; g < GP; ++g) {
            if (g >= group) continue;
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < E; ++i) dot = fmaf(q[g][i], kn[i], dot);
            const float s_new = warp_sum(dot) * scale_log2;
            const float m_new = fmaxf(m[g], s_new);
            const float alpha = exp2f(m[g] - m_new);
            const float p = exp2f(s_new - m_new);
            l[g] = l[g] * alpha + p;
#pragma unroll
            for (int i = 0; i < E; ++i) acc[g][i] = fmaf(p, vn[i], acc[g][i] * alpha);
            m[g] = m_new;
        }
    }

    // ---- the warps' states merged (shared memory reused: the ring is drained) ----
    __syncthreads();
    float* wacc = reinterpret_cast<float*>(smem);      // [NWARPS][GP][D]
    float* wm = wacc + NWARPS * GP * D;                // [NWARPS][GP]
    float* wl = wm + NWARPS * GP;                      // [NWARPS][GP]
#pragma unroll
    for (int g = 0; g < GP; ++g) {
#pragma unroll
        for (int i = 0; i < E; ++i) wacc[(warp * GP + g) * D + E * lane + i] = acc[g][i];
        if (lane == 0) {
            wm[warp * GP + g] = m[g];
            wl[warp * GP + g] = l[g];
        }
    }
    __syncthreads();
    const bool split_mode = num_splits > 1;
    const int heads_total = n_q;  // partial rows: (seq, head, split)
    for (int idx = tid; idx < group * D; idx += NWARPS * 32) {
        const int g = idx / D, d = idx % D;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) mx = fmaxf(mx, wm[w * GP + g]);
        float a = 0.f, den = 0.f;
        if (mx != NEG_INF) {
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float mw = wm[w * GP + g];
                const float f = mw == NEG_INF ? 0.f : exp2f(mw - mx);
                a = fmaf(wacc[(w * GP + g) * D + d], f, a);
                den = fmaf(wl[w * GP + g], f, den);
            }
        }
        const int head = kvh * group + g;
        if (split_mode) {
            const size_t pidx = ((size_t)seq * heads_total + head) * num_splits + split;
            part[pidx * D + d] = a;
            if (d == 0) {
                ml[pidx * 2] = mx;
                ml[pidx * 2 + 1] = den;
            }
        } else {
            out[(size_t)seq * stride_ot + (size_t)head * stride_oh + d] = from_f32<BF16>(a / den);
        }
    }
    if (!split_mode) return;

    // ---- the last split of (sequence, KV head) merges the splits' partials ----
    // The block's partials are released by thread 0's ticket after the barrier (acq_rel: it also acquires the
    // other splits' partials for the last block), as the Triton kernel's combine does; no fence per thread.
    __syncthreads();
    if (tid == 0) last_flag = take_ticket_acq_rel(cnt + seq * n_kv + kvh) == num_splits - 1;
    __syncthreads();
    if (!last_flag) return;
    // Two reads, requested together: every split's partial of this thread's first output element (into
    // registers: MAX_SPLITS predicated loads at once, as a loop with a load per trip would wait one L2 round trip
    // per split), and each split's (max, sum) (into shared memory), which become the splits' weights per head.
    // The partials do not depend on the weights, so the merge waits one round trip, not two.
    float* sw = reinterpret_cast<float*>(smem);  // [GP][MAX_SPLITS]: m, then the weight exp2(m - max)
    float* sl = sw + GP * MAX_SPLITS;             // [GP][MAX_SPLITS]: l
    float* sden = sl + GP * MAX_SPLITS;           // [GP]
    const size_t base0 = ((size_t)seq * heads_total + (size_t)kvh * group) * num_splits;
    float v[MAX_SPLITS];
    auto load_partials = [&](int idx) {  // output element idx = (q head of the group, dim)
        const float* pg = part + (base0 + (size_t)(idx / D) * num_splits) * D + idx % D;
#pragma unroll
        for (int sp = 0; sp < MAX_SPLITS; ++sp) v[sp] = sp < num_splits ? ld_cg(pg + (size_t)sp * D) : 0.f;
    };
    if (tid < group * D) load_partials(tid);
    for (int idx = tid; idx < group * num_splits; idx += NWARPS * 32) {
        const int g = idx / num_splits, sp = idx % num_splits;
        sw[g * MAX_SPLITS + sp] = ld_cg(ml + (base0 + idx) * 2);
        sl[g * MAX_SPLITS + sp] = ld_cg(ml + (base0 + idx) * 2 + 1);
    }
    __syncthreads();
    if (tid < group) {
        float mx = NEG_INF;
        for (int sp = 0; sp < num_splits; ++sp) mx = fmaxf(mx, sw[tid * MAX_SPLITS + sp]);
        float den = 0.f;
        for (int sp = 0; sp < num_splits; ++sp) {
            const float ms = sw[tid * MAX_SPLITS + sp];
            const float f = ms == NEG_INF ? 0.f : exp2f(ms - mx);
            sw[tid * MAX_SPLITS + sp] = f;
            den = fmaf(sl[tid * MAX_SPLITS + sp], f, den);
        }
        sden[tid] = den;
    }
    __syncthreads();
    for (int idx = tid; idx < group * D; idx += NWARPS * 32) {
        const int g = idx / D, d = idx % D;
        if (idx != tid) load_partials(idx);  // the later elements of a large group
        float a = 0.f;
#pragma unroll
        for (int sp = 0; sp < MAX_SPLITS; ++sp)
            if (sp < num_splits) a = fmaf(v[sp], sw[g * MAX_SPLITS + sp], a);
        out[(size_t)seq * stride_ot + (size_t)(kvh * group + g) * stride_oh + d] = from_f32<BF16>(a / sden[g]);
    }
    if (tid == 0) atomicExch(cnt + seq * n_kv + kvh, 0);
}
