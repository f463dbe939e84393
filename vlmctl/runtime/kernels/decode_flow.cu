// decode_flow: every layer of a batch-1 decode step of an AWQ decoder in one persistent kernel, its work
// ordered by counters in memory instead of kernel ends or grid barriers (a dataflow step).
//
// Compiled after w4a16_mma.cu and decode_step.cu (flow_step.py puts the sources together), whose helpers it
// uses: the batch-1 CUDA GEMV's chunk arithmetic (gemv_chunk, the same products and sums per row), the
// uncached loads, rotary, an attention tile's steps (stage_rotated_q, append_new_kv, tile_partials) and the
// StepLinear / StepLayer tables.
//
// Why: kernel by kernel, each linear of a batch-1 step starts its weight stream only when the kernel before it
// has ended (PDL lets its resident blocks load one batch early), and the attention between qkv and o leaves
// the memory system idle for ~6 us a layer. decode_step.cu (one producer warp per SM streaming weights into
// shared memory, phases between grid barriers) was slower: its consumer warps could not keep up.
// Here one block per SM runs a layer's stages in order: qkv (of the input RMSNorm), attention, o (+ residual),
// gate_up (of the post-attention RMSNorm, act(gate) * up), down (+ residual). In a linear's stage (flow_stage)
// each warp computes tasks of R weight rows as the batch-1 CUDA GEMV does (its lanes hold their chunks of every
// row in registers); it loads its first task's weights before the stage's input is ready, so the weights
// stream while the grid finishes the stage before. The input is staged once per block in shared memory (the
// RMSNorms computed there). A stage's completion is a counter in memory each block adds one to (release) and
// the next stage polls (acquire): no grid barrier, no kernel boundary. Attention runs as warp tasks over the
// whole grid (one KV head's 32-token tile, the last tile of a head combining by ticket); o waits for every head.
// All blocks are resident (cooperative launch) and every wait is for earlier work, so nothing can deadlock.
// Each layer has its own activation buffers, so no address is written twice in a step.
//
// Numerics: each linear's rows as the batch-1 CUDA GEMV computes them (gemv_chunk: the same products and sums
// per lane, lanes added by the same shuffles); norms, rotary, residual adds and act*mul round as decode_step.cu.
//
// Status: correct on an H100, slower than the kernel-by-kernel step (2.6-2.9 against 2.1 ms a 7B step, the ring
// variant 2.8); opt-in. Its GEMV arithmetic holds it (docs/benchmarks.md, session 51).
// docs/benchmarks.md, session 50, has block 0's per-stage trace and what it says.

// Stages of a layer, in task order.
#define FS_QKV 0
#define FS_ATT 1
#define FS_O 2
#define FS_GU 3
#define FS_DOWN 4
#define FS_STAGES 5
// A layer's sync words: the five stages' counters (blocks done; for FS_ATT, KV heads combined), then the KV
// heads' tile tickets.
#define FS_SYNC 5


__device__ __forceinline__ void red_release_add(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 atom_acq_rel_add(u32* p, u32 v) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Read inside each task (volatile: not hoisted out of the task loops, where the compiler would otherwise keep
// every linear's table fields and lane offsets live across the whole step and spill).
__device__ __forceinline__ int lane_id() {
    int l;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
    return l;
}

__device__ __forceinline__ long long ld_table(const long long* p) {
    long long v;
    asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ld_nc_u16(const u16* p) {
    u16 v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ld_nc_u8(const u8* p) {
    u32 v;
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// The consumer warps' block barrier (named barrier 1: the ring kernel's producer warp never joins it).
template <int NW>
__device__ __forceinline__ void flow_sync() {
    asm volatile("bar.sync 1, %0;" :: "n"(NW * 32) : "memory");
}

// Byte offset of piece P (x[8 P .. 8 P + 7]) of a staged input in shared memory. A lane reads chunk c's four
// pieces (4 c + j) one j at a time, and the 8 lanes of a phase read 8 consecutive chunks: the pieces of a chunk
// are rotated by (c / 2) % 4 so that those 8 reads hit 8 different 16-byte bank groups (unswizzled, 4-way
// conflicts).
__device__ __forceinline__ u32 xs_piece(int P) {
    const int c = P >> 2, j = P & 3;
    return (u32)(64 * c + 16 * (j ^ ((c >> 1) & 3)));
}

// One linear's table row, as its task reads it.
struct FlowLinear {
    const u32* qw;
    const u16* sc;
    const u8* zp;
    const u16* bias;
    int k, up;
};

__device__ __forceinline__ FlowLinear flow_linear(const StepLinear* lp) {
    const long long* f = (const long long*)lp;
    return FlowLinear{(const u32*)ld_table(f), (const u16*)ld_table(f + 1), (const u8*)ld_table(f + 2),
                      (const u16*)ld_table(f + 3), (int)ld_table(f + 5), (int)ld_table(f + 6)};
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void nanosleep_ns(u32 ns) { asm volatile("nanosleep.u32 %0;" :: "r"(ns)); }

// Wait (every lane) until counter `c` reaches `target`; `known` caches the last key (the attention's: its layer)
// this warp saw satisfied, so its later tasks of that layer skip the poll.
__device__ __forceinline__ void flow_wait(const u32* c, u32 target, int key, int& known) {
    if (key <= known) return;
    u32 spins = 0, ns = 16;
    while (ld_acquire_u32(c) < target) {
        nanosleep_ns(ns);
        ns = min(ns * 2u, 64u);  // one poller a block: a short back-off
        if (++spins == SPIN_LIMIT) __trap();
    }
    known = key;
}

// A lane's share of R rows of a W4A16 linear: chunk c = lane + 32 u of each row (u < CPL), loaded at once.
template <int R, int CPL>
struct FlowRows {
    u32x4 w[CPL][R];
    u32 sz[CPL][R];  // scale bits | zero point << 16
};

template <int R, int CPL, int G>
__device__ __forceinline__ void flow_load_rows(FlowRows<R, CPL>& b, const FlowLinear& l, const int (&rows)[R],
                                               int lane) {
    const int K = l.k, KC = K >> 5, KG = K / G;
    // unconditional loads (a lane past the row's end reloads its last chunk, not used): registers assigned on
    // only some paths would send the whole array to local memory
#pragma unroll
    for (int u = 0; u < CPL; ++u) {
        const int c = min(lane + 32 * u, KC - 1);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const long long n = rows[r];
            b.w[u][r] = ld_stream16(l.qw + n * (K >> 3) + 4 * c);
            const int gi = (c * 32) / G;
            b.sz[u][r] = (u32)ld_nc_u16(l.sc + n * KG + gi) | ((u32)ld_nc_u8(l.zp + n * KG + gi) << 16);
        }
    }
}

// Step 2 of flow_stage: warp 0 waits for the input, then the block stages it in shared memory: x as stored,
// or (norm_w) its RMSNorm, weight * fp16(x * rsqrt(mean(x^2) + eps)), rounded as fill_norm (decode_step.cu)
// and ops.rms_norm round. Reads after warp 0's acquire are ordered by the barrier. A thread's first NP pieces of
// 8 (all of them for K <= NP * 8 * 32 * NW) are loaded once and kept in registers between the norm's two passes;
// the norm weights are loaded before the wait.
template <int NW>
__device__ __forceinline__ void flow_stage_input(const u16* xsrc, const u16* norm_w, float eps, int K,
                                                 const u32* wait_c, u32 wait_target, u32 xs, float* red, int warp,
                                                 int lane, unsigned long long* tr) {
    constexpr int NP = 4;
    const int np = K / 8;
    u32x4 wv[NP], v[NP];
    if (norm_w) {
#pragma unroll
        for (int i = 0; i < NP; ++i) wv[i] = *(const u32x4*)(norm_w + 8 * min((int)threadIdx.x + i * NW * 32, np - 1));
    }
    if (wait_c && warp == 0) {
        u32 spins = 0, ns = 16;
        while (ld_acquire_u32(wait_c) < wait_target) {
            nanosleep_ns(ns);
            ns = min(ns * 2u, 64u);  // one poller a block: a short back-off
            if (++spins == SPIN_LIMIT) __trap();
        }
    }
    if (tr) tr[1] = global_ns();
    flow_sync<NW>();
#pragma unroll
    for (int i = 0; i < NP; ++i) v[i] = ld_act16(xsrc + 8 * min((int)threadIdx.x + i * NW * 32, np - 1));
    if (norm_w) {
        float ss = 0.f;
        auto sum_sq = [&](const u32x4& x) {
            const u32 a[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float lo = lo_f(a[j]), hi = hi_f(a[j]);
                ss += lo * lo + hi * hi;
            }
        };
#pragma unroll
        for (int i = 0; i < NP; ++i) {
            if ((int)threadIdx.x + i * NW * 32 < np) sum_sq(v[i]);
        }
        for (int P = threadIdx.x + NP * NW * 32; P < np; P += NW * 32) sum_sq(ld_act16(xsrc + 8 * P));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) red[warp] = ss;
        flow_sync<NW>();
        float total = 0.f;
#pragma unroll
        for (int i = 0; i < NW; ++i) total += red[i];
        const float rstd = rsqrtf(total / (float)K + eps);
        auto put = [&](int P, const u32x4& x, const u32x4& w) {
            const u32 a[4] = {x.x, x.y, x.z, x.w}, c[4] = {w.x, w.y, w.z, w.w};
            u32 o[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u16 nlo = f2h(lo_f(a[j]) * rstd), nhi = f2h(hi_f(a[j]) * rstd);
                const u16 ylo = f2h(lo_f(c[j]) * h2f(nlo)), yhi = f2h(hi_f(c[j]) * h2f(nhi));
                o[j] = (u32)ylo | ((u32)yhi << 16);
            }
            sts16(xs + xs_piece(P), u32x4{o[0], o[1], o[2], o[3]});
        };
#pragma unroll
        for (int i = 0; i < NP; ++i) {
            const int P = (int)threadIdx.x + i * NW * 32;
            if (P < np) put(P, v[i], wv[i]);
        }
        for (int P = threadIdx.x + NP * NW * 32; P < np; P += NW * 32)
            put(P, ld_act16(xsrc + 8 * P), *(const u32x4*)(norm_w + 8 * P));
    } else {
#pragma unroll
        for (int i = 0; i < NP; ++i) {
            const int P = (int)threadIdx.x + i * NW * 32;
            if (P < np) sts16(xs + xs_piece(P), v[i]);
        }
        for (int P = threadIdx.x + NP * NW * 32; P < np; P += NW * 32) sts16(xs + xs_piece(P), ld_act16(xsrc + 8 * P));
    }
    flow_sync<NW>();
    if (tr) tr[2] = global_ns();
}

// A task's row sums added across the warp, and lane r storing output row out0 + r: qkv + bias (pre), o and
// down + the residual (pre), gate_up act(gate) * up (rows 0 .. R/2 - 1 gate, the rest their up rows).
template <int R, int kind>
__device__ __forceinline__ void flow_store_rows(float (&acc)[R], int lane, int out0, u16 pre, bool has_bias,
                                                int act_kind, u16* out) {
    constexpr int H = R / 2, UPT = kind == FS_GU ? H : R;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    }
#pragma unroll
    for (int r = 0; r < UPT; ++r) {
        if (lane == r) {
            const int n = out0 + r;
            if (kind == FS_QKV) {
                out[n] = f2h(acc[r] + (has_bias ? h2f(pre) : 0.f));
            } else if (kind == FS_GU) {
                const float gf = h2f(f2h(acc[r])), u = h2f(f2h(acc[r + H]));
                const float a = act_kind == 0 ? act_f32<0>(gf) : act_f32<1>(gf);
                out[n] = f2h(h2f(f2h(a)) * u);
            } else {
                out[n] = f2h(h2f(pre) + h2f(f2h(acc[r])));
            }
        }
    }
}

// One block's share of a linear's stage (block b: tasks [b n / nb, (b + 1) n / nb) of the stage's n, warp w of NW
// their w-th, w + NW-th, ...; a task is R weight rows, for FS_GU R / 2 gate rows and their up rows).
//   1. each warp loads its first task's weights (before the wait: they do not depend on the step)
//   2. flow_stage_input: the input, when ready, staged in shared memory (or its RMSNorm)
//   3. the warps compute their tasks from it (a later task's weights are loaded after the one before) and store
//      the rows: qkv + bias; o and down + the residual `resid`; gate_up act(gate) * up
//   4. the block adds one to done_c (release) once every warp has stored its rows
template <int R, int CPL, int G, int kind, int NW, int OPTS>
__device__ __forceinline__ void flow_stage(const StepLinear* lp, int n_units, const u16* xsrc, const u16* norm_w,
                                           float eps, const u16* resid, u16* out, const u32* wait_c,
                                           u32 wait_target, u32* done_c, u32 xs, float* red, int act_kind,
                                           unsigned long long* tr, u32* warps_done) {
    if (tr) tr[0] = global_ns();
    constexpr int H = R / 2, UPT = kind == FS_GU ? H : R;  // output rows a task
    const int warp = threadIdx.x >> 5, lane = lane_id();
    const FlowLinear l = flow_linear(lp);
    const int K = l.k, KC = K >> 5;
    const int ntask = n_units / UPT;
    const int t0 = (int)((long long)blockIdx.x * ntask / gridDim.x);
    const int t1 = (int)((long long)(blockIdx.x + 1) * ntask / gridDim.x);
    // Two tasks' weights in flight a warp: the next task's loads are issued before the current one is computed.
    // Loads are unconditional (an array assigned on only some paths would go to local memory): past its last
    // task a warp reloads the block's last one (L2 hits).
    auto load_task = [&](FlowRows<R, CPL>& b, int t) {
        const int tl = min(t, max(t1 - 1, 0));
        int rows[R];
#pragma unroll
        for (int r = 0; r < R; ++r) rows[r] = kind == FS_GU ? (r < H ? tl * H + r : l.up + tl * H + r - H) : tl * R + r;
        flow_load_rows<R, CPL, G>(b, l, rows, lane);
    };
    // DEPTH tasks' weights a warp (OPTS & 4: three, else two): the current task's and the next ones', in flight
    // during its arithmetic. OPTS & 1: all DEPTH tasks' loads issued before the wait (else the first only).
    constexpr int DEPTH = (OPTS & 4) ? 3 : 2;
    FlowRows<R, CPL> q[DEPTH];
    load_task(q[0], t0 + warp);
    if constexpr (OPTS & 1) {
#pragma unroll
        for (int d = 1; d < DEPTH; ++d) load_task(q[d], t0 + warp + d * NW);
    }
    flow_stage_input<NW>(xsrc, norm_w, eps, K, wait_c, wait_target, xs, red, warp, lane, tr);
    if constexpr (!(OPTS & 1)) {
#pragma unroll
        for (int d = 1; d < DEPTH; ++d) load_task(q[d], t0 + warp + d * NW);
    }
    for (int t = t0 + warp; t < t1; t += NW) {
        const int out0 = t * UPT;
        u16 pre = 0;  // the epilogue's residual (or bias), loaded before the arithmetic
        if (lane < UPT) {
            if (kind == FS_O || kind == FS_DOWN) pre = resid[out0 + lane];
            else if (kind == FS_QKV && l.bias) pre = l.bias[out0 + lane];
        }
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.f;
#pragma unroll
        for (int u = 0; u < CPL; ++u) {
            const int c = lane + 32 * u;
            if (c < KC) {
                u32x4 xv[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) xv[j] = lds16(xs + xs_piece(4 * c + j));
#pragma unroll
                for (int r = 0; r < R; ++r) gemv_chunk(acc[r], q[0].w[u][r], q[0].sz[u][r] & 0xFFFFu, q[0].sz[u][r] >> 16, xv);
            }
        }
        flow_store_rows<R, kind>(acc, lane, out0, pre, l.bias != nullptr, act_kind, out);
#pragma unroll
        for (int d = 0; d + 1 < DEPTH; ++d) q[d] = q[d + 1];
        load_task(q[DEPTH - 1], t + DEPTH * NW);
    }
    if (tr) tr[3] = global_ns();
    if constexpr (OPTS & 2) {
        // no block barrier: the block's last warp to finish (a ticket in shared memory, acq_rel at block scope so
        // the other warps' stores are ordered before its release) adds the block's one; the others go on to
        // the next stage's loads (its staging barrier keeps them from overwriting the input in use)
        __syncwarp();
        u32 old = 0;
        if (lane == 0) {
            asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;" : "=r"(old) : "r"(smem_addr(warps_done))
                         : "memory");
            if (old == NW - 1) {
                *(volatile u32*)warps_done = 0u;
                red_release_add(done_c, 1u);
            }
        }
    } else {
        flow_sync<NW>();
        if (threadIdx.x == 0) red_release_add(done_c, 1u);
    }
    if (tr) tr[4] = global_ns();
}

// ---------------------------------------------------------------------------------------------------
// The ring variant (VLMCTL_FLOW_OPTS bit 32): the same stages, but the weights come through a
// ring of shared-memory slots that one producer warp a block fills with bulk copies, ahead of the consumer
// warps and across the stage waits (the weights do not depend on the step), as far as the ring allows. The
// flow kernel's warps hold their next weights in registers, 32-64 KB an SM in flight, and its stages streamed at
// 1.5-2.0 TB/s on an H100; the ring holds ~190 KB an SM. Consumers compute each row as the batch-1 GEMV does
// (gemv_chunk; the CUDA cores, not session 14's tensor-core tiles, whose dependent chains could not keep up).
//
// A piece (one ring slot) is `per` consecutive units of the block's share of a linear (a unit: one row, for
// gate_up a gate row and its up row): the units' packed words [R][n][K/8], then their scale | zero << 16 words
// [R][n][kgp] (flow_step.py builds that array at load, its rows padded to 16 bytes so that every piece is two or
// four bulk copies). The ring table's field 2 is that array and field 7 its row length kgp.

struct RingLinear {
    const u32* qw;
    const u32* sz;
    const u16* bias;
    int n, k, up, kgp;
};

__device__ __forceinline__ RingLinear ring_linear(const StepLinear* lp) {
    const long long* f = (const long long*)lp;
    return RingLinear{(const u32*)ld_table(f), (const u32*)ld_table(f + 2), (const u16*)ld_table(f + 3),
                      (int)ld_table(f + 4), (int)ld_table(f + 5), (int)ld_table(f + 6), (int)ld_table(f + 7)};
}

// Units a piece of linear l holds (at least one: the host sizes the slots for the longest unit).
__device__ __forceinline__ int ring_per(const RingLinear& l, int R, int slot_bytes) {
    return max(1, slot_bytes / (R * (l.k / 2 + 4 * l.kgp)));
}

// The producer (one lane): every piece of the block's share of every linear, in the consumers' order.
template <int OPTS>
__device__ void flow_produce(const StepLinear* lins, int nlin, u32 ring, int ns, int slot_bytes, u32 full0,
                            u32 empty0) {
    u32 it = 0;
    for (int li = 0; li < nlin; ++li) {
        const RingLinear l = ring_linear(lins + li);
        const int R = (li & 3) == 2 ? 2 : 1;  // gate_up is a layer's third table row: units of two rows
        const int u0 = (int)((long long)blockIdx.x * l.n / gridDim.x);
        const int u1 = (int)((long long)(blockIdx.x + 1) * l.n / gridDim.x);
        const u32 rq = (u32)l.k / 2, rs = 4u * (u32)l.kgp;
        const int per = ring_per(l, R, slot_bytes);
        for (int a = u0; a < u1; a += per, ++it) {
            const u32 n = (u32)min(per, u1 - a), s = it % (u32)ns;
            if (it >= (u32)ns) mbar_wait(empty0 + 8 * s, ((it / ns) - 1) & 1);
            const u32 fb = full0 + 8 * s, dst = ring + s * (u32)slot_bytes;
            if (OPTS & 256) {  // measurements: nothing copied (the consumers compute on what the slot held)
                mbar_arrive(fb);
                continue;
            }
            mbar_expect_tx(fb, (u32)R * n * (rq + rs));
            for (int r = 0; r < R; ++r) {
                const long long row = (r == 0 ? a : l.up + a);
                bulk_copy(dst + (u32)r * n * rq, l.qw + row * (l.k / 8), n * rq, fb);
                bulk_copy(dst + (u32)R * n * rq + (u32)r * n * rs, l.sz + row * l.kgp, n * rs, fb);
            }
        }
    }
}

// A consumer warp's share of one linear's stage in the ring kernel: the input staged (flow_stage_input), then
// each piece as it lands: the warp's units of it (unit i of the block's share goes to warp i % NW), the slot
// handed back, and at the end the block's one added to done_c. `it` counts the pieces consumed (the producer's
// order). Inputs of K <= 4096 (CPL <= 4) are kept in registers for the whole stage; longer ones are read from the
// staged copy per unit.
template <int CPL, int G, int kind, int NW, int OPTS>
__device__ __forceinline__ void flow_ring_stage(const StepLinear* lp, const u16* xsrc, const u16* norm_w, float eps,
                                                const u16* resid, u16* out, const u32* wait_c, u32 wait_target,
                                                u32* done_c, u32 xs, float* red, int act_kind,
                                                unsigned long long* tr, u32 ring, int ns, int slot_bytes, u32 full0,
                                                u32 empty0, u32& it) {
    if (tr) tr[0] = global_ns();
    constexpr int R = kind == FS_GU ? 2 : 1;  // rows a unit
    constexpr int U = (OPTS & 64) ? 2 : 1;     // units a warp computes at once
    // the input in registers for the whole stage where it fits beside the weights (K <= 4096, few warps)
    constexpr bool XREG = CPL <= 4 && NW <= 8;
    const int warp = threadIdx.x >> 5, lane = lane_id();
    const RingLinear l = ring_linear(lp);
    const int K = l.k, KC = K >> 5;
    const int u0 = (int)((long long)blockIdx.x * l.n / gridDim.x);
    const int u1 = (int)((long long)(blockIdx.x + 1) * l.n / gridDim.x);
    const int per = ring_per(l, R, slot_bytes);
    flow_stage_input<NW>(xsrc, norm_w, eps, K, wait_c, wait_target, xs, red, warp, lane, tr);
    u32x4 xr[XREG ? CPL : 1][4];
    if constexpr (XREG) {
#pragma unroll
        for (int u = 0; u < CPL; ++u) {
            const int c = min(lane + 32 * u, KC - 1);
#pragma unroll
            for (int j = 0; j < 4; ++j) xr[u][j] = lds16(xs + xs_piece(4 * c + j));
        }
    }
    for (int a = u0; a < u1; a += per, ++it) {
        const int n = min(per, u1 - a);
        const u32 s = it % (u32)ns;
        const u32 slot = ring + s * (u32)slot_bytes;
        const u32 szs = slot + (u32)(R * n * (K / 2));
        // every warp waits for every piece, units in it or not: a warp that handed a slot back without waiting
        // could run a lap ahead and count its next arrival in the round a slower warp is still reading
        mbar_wait(full0 + 8 * s, (it / ns) & 1);
        // this warp's units of the piece, U at a time (j, j + NW, ...; one past the piece recomputes j, unstored)
        for (int j = (warp - (a - u0) % NW + NW) % NW; !(OPTS & 128) && j < n; j += U * NW) {
            int jj[U];
            u16 pre[U];
            float acc[U][R];
#pragma unroll
            for (int v = 0; v < U; ++v) {
                jj[v] = j + v * NW < n ? j + v * NW : j;
                pre[v] = 0;
                if (lane == 0) {
                    if (kind == FS_O || kind == FS_DOWN) pre[v] = resid[a + jj[v]];
                    else if (kind == FS_QKV && l.bias) pre[v] = l.bias[a + jj[v]];
                }
#pragma unroll
                for (int r = 0; r < R; ++r) acc[v][r] = 0.f;
            }
#pragma unroll
            for (int u = 0; u < CPL; ++u) {
                const int c = lane + 32 * u;
                if (c < KC) {
                    u32x4 xv[4];
#pragma unroll
                    for (int q = 0; q < 4; ++q) xv[q] = XREG ? xr[XREG ? u : 0][q] : lds16(xs + xs_piece(4 * c + q));
                    u32x4 w[U][R];
                    u32 sz[U][R];
#pragma unroll
                    for (int v = 0; v < U; ++v) {
#pragma unroll
                        for (int r = 0; r < R; ++r) {
                            w[v][r] = lds16(slot + (u32)((r * n + jj[v]) * (K / 2) + 16 * c));
                            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(sz[v][r])
                                         : "r"(szs + (u32)(4 * ((r * n + jj[v]) * l.kgp + (c * 32) / G))));
                        }
                    }
#pragma unroll
                    for (int v = 0; v < U; ++v) {
#pragma unroll
                        for (int r = 0; r < R; ++r)
                            gemv_chunk(acc[v][r], w[v][r], sz[v][r] & 0xFFFFu, sz[v][r] >> 16, xv);
                    }
                }
            }
#pragma unroll
            for (int v = 0; v < U; ++v) {
                if (v == 0 || j + v * NW < n)
                    flow_store_rows<R, kind>(acc[v], lane, a + jj[v], pre[v], l.bias != nullptr, act_kind, out);
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * s);  // (every warp, whether it had units here or not)
    }
    if (tr) tr[3] = global_ns();
    flow_sync<NW>();
    if (threadIdx.x == 0) red_release_add(done_c, 1u);
    if (tr) tr[4] = global_ns();
}

// One attention task: KV head kvh's 32-token tile `tile` (decode_step.cu's attention_phase item, for one warp),
// then the ticket: the KV head's last tile combines its query heads' partials into attn. Cached K rows are
// loaded before the wait (they do not change in this step; the new token's row is the one this step writes,
// and its lane takes the new K from shared memory). `part` is shared by the layers: a layer's partials are
// written only after its qkv stage, which follows the previous layer's down stage, which follows its o stage,
// which waited for every combine of that layer.
template <bool VPRE>
__device__ __forceinline__ void flow_attn(const StepLayer& ly, const u16* qkv, u16* attn, float* part, u32* ticket, int kvh,
                          int tile, int ntiles, int pos, int slot, int ctx, const int* bt, const float* cos_sin,
                          int n_heads, int n_kv, int block_size, int max_tiles, float scale_log2, u32 qs,
                          const u32* wait_c, u32 wait_target, int wait_key, int& known, u32* done_c, int lane) {
    const int grp = n_heads / n_kv;
    const u32 knew = qs + (u32)(grp * 256), vnew = knew + 256u;
    const int tok = tile * 32 + lane;
    const bool valid = tok < ctx;
    const bool newtile = tile == ntiles - 1;
    const int newu = ctx - 1 - tile * 32;  // the new token's lane in its tile
    const int blk = valid ? bt[tok / block_size] : 0;
    // tokens past the context read block 0's first row (never handed out) and get p = 0
    const long long row = valid ? (long long)blk * block_size + tok % block_size : 0;
    const u16* krow = ly.kc + ((size_t)row * n_kv + kvh) * 128;
    u32x4 kr[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) kr[i] = ld_cg16(krow + 8 * i);
    u32x2 vv[32];  // V rows of the tile's 32 tokens, dims 4 lane .. + 3 (the new token's comes from shared memory)
    if constexpr (VPRE) {  // before the wait (else where they are used)
#pragma unroll
        for (int u = 0; u < 32; ++u) {
            const long long ru = __shfl_sync(0xffffffffu, row, u);
            vv[u] = ld_cg8(ly.vc + ((size_t)ru * n_kv + kvh) * 128 + 4 * lane);
        }
    }
    const float* cs = cos_sin + (size_t)pos * 128;
    const float c0 = h2f(f2h(cs[lane])), c1 = h2f(f2h(cs[lane + 32]));
    const float s0 = h2f(f2h(cs[64 + lane])), s1 = h2f(f2h(cs[64 + lane + 32]));
    flow_wait(wait_c, wait_target, wait_key, known);
    stage_rotated_q(qkv, kvh, grp, lane, c0, s0, c1, s1, qs);
    if (newtile) append_new_kv(ly, qkv, kvh, n_heads, n_kv, slot, lane, c0, s0, c1, s1, knew, vnew);
    __syncwarp();
    tile_partials<VPRE>(kr, vv, ly, row, kvh, n_kv, grp, tile, valid, newtile, newu, scale_log2, qs, knew, vnew, part,
                        max_tiles, lane);
    __syncwarp();
    u32 old = 0;
    if (lane == 0) old = atom_acq_rel_add(ticket + kvh, 1u);
    old = __shfl_sync(0xffffffffu, old, 0);
    __syncwarp();  // orders the other lanes' reads below after lane 0's acquire
    if (old + 1 != (u32)ntiles) return;  // not the KV head's last tile
    // the last tile: every tile's partials of this KV head are stored (the ticket's acquire, then the warp sync)
    for (int j = 0; j < grp; ++j) {
        const int h = kvh * grp + j;
        const float* ph = part + (size_t)h * max_tiles * 132;
        // the tiles' maxima and sums a lane each (32 at a time), then their weighted outputs, 16 loads in flight
        float M = NEG_INF;
        for (int tt = lane; tt < ntiles; tt += 32) M = fmaxf(M, ld_cg_f32(ph + tt * 132 + 128));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float lsum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int t0 = 0; t0 < ntiles; t0 += 32) {
            const int tt = t0 + lane;
            float b = 0.f;
            if (tt < ntiles) {
                const float* pp = ph + tt * 132;
                b = exp2f(ld_cg_f32(pp + 128) - M);
                lsum += ld_cg_f32(pp + 129) * b;
            }
            const int n = min(32, ntiles - t0);
            for (int u0 = 0; u0 < n; u0 += 16) {
                u32x4 v[16];
#pragma unroll
                for (int u = 0; u < 16; ++u) v[u] = ld_cg16(ph + (size_t)(t0 + min(u0 + u, n - 1)) * 132 + 4 * lane);
#pragma unroll
                for (int u = 0; u < 16; ++u) {
                    const float bu = __shfl_sync(0xffffffffu, b, (u0 + u) & 31);
                    if (u0 + u < n) {
                        acc[0] += as_float(v[u].x) * bu;
                        acc[1] += as_float(v[u].y) * bu;
                        acc[2] += as_float(v[u].z) * bu;
                        acc[3] += as_float(v[u].w) * bu;
                    }
                }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
        const float inv = 1.f / lsum;
        const u32 lo = (u32)f2h(acc[0] * inv) | ((u32)f2h(acc[1] * inv) << 16);
        const u32 hi = (u32)f2h(acc[2] * inv) | ((u32)f2h(acc[3] * inv) << 16);
        *(u32x2*)(attn + (size_t)h * 128 + 4 * lane) = u32x2{lo, hi};
    }
    __syncwarp();
    if (lane == 0) red_release_add(done_c, 1u);
}

// Rows a GEMV task takes for a K whose lanes hold CPL chunks: as many as keep two tasks' weights (flow_stage's
// current and next) in ~100 of a lane's registers.
template <int CPL>
struct FlowTaskRows {
    static constexpr int value = CPL <= 4 ? 2 : 1;
};

// Where a block's linear stages get their weights: registers (flow_stage: warps_done for OPTS bit 2)
// or the ring (OPTS bit 32, flow_ring_stage: its slots, mbarriers and the pieces consumed so far).
struct FlowWeights {
    u32* warps_done;
    u32 ring, full0, empty0;
    int ns, slot_bytes;
    u32 it;
};

// One linear's stage of a layer, by the kernel's weight path.
template <int R, int CPL, int G, int kind, int NW, int OPTS>
__device__ __forceinline__ void flow_linear_stage(const StepLinear* lp, int n_units, const u16* xsrc, const u16* norm_w,
                                                  float eps, const u16* resid, u16* out, const u32* wait_c,
                                                  u32 wait_target, u32* done_c, u32 xs, float* red, int act_kind,
                                                  unsigned long long* tr, FlowWeights& fw) {
    if constexpr (OPTS & 32) {
        flow_ring_stage<CPL, G, kind, NW, OPTS>(lp, xsrc, norm_w, eps, resid, out, wait_c, wait_target, done_c, xs, red,
                                                act_kind, tr, fw.ring, fw.ns, fw.slot_bytes, fw.full0, fw.empty0,
                                                fw.it);
    } else {
        flow_stage<R, CPL, G, kind, NW, OPTS>(lp, n_units, xsrc, norm_w, eps, resid, out, wait_c, wait_target, done_c,
                                              xs, red, act_kind, tr, fw.warps_done);
    }
}

// NW warps a block (with OPTS bit 32, NW consumer warps and warp NW the ring's producer); CD / CA / CI: chunks a
// lane holds of a row of K = D (qkv, gate_up), n_heads * 128 (o) and I (down), i.e. ceil(K / 1024). Shared memory:
// the staged input (max(D, n_heads * 128, I) fp16), the warps' attention scratch (NW x (group + 2) x 256 bytes), NW
// floats and a word; then, 128-byte aligned, OPTS bit 32's ring
// (ns slots of slot_bytes, then 2 ns mbarriers: full, then empty).
template <int NW, int G, int CD, int CA, int CI, int OPTS>
__global__ void __launch_bounds__((NW + ((OPTS & 32) ? 1 : 0)) * 32, 1)
decode_flow(const StepLinear* lins, const StepLayer* layers, u16* h, u16* qkv_all, u16* attn_all, u16* hmid_all,
            u16* act_all, float* part, u32* sync, const int* pos_p, const int* slot_p, const int* ctx_p, const int* bt,
            const float* cos_sin, int n_layers, int D, int I, int n_heads, int n_kv, int block_size, int max_tiles,
            int scale_log2_bits, int eps_bits, int act_kind, int x_bytes, int slot_bytes, int ns,
            unsigned long long* trace) {
    constexpr int RQ = FlowTaskRows<CD>::value;                 // qkv
    constexpr int RG = RQ < 2 ? 2 : RQ;                         // gate_up: gate and up rows in pairs
    constexpr int RO = FlowTaskRows<CA>::value > 2 ? 2 : FlowTaskRows<CA>::value;  // o: few rows a block
    constexpr int RD = FlowTaskRows<CI>::value;                 // down
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5;
    const int grp = n_heads / n_kv;
    const u32 xs = smem_addr(smem);
    const u32 qs = xs + (u32)x_bytes + (u32)(warp * (grp + 2) * 256);  // this warp's q, new K and new V
    float* red = (float*)(smem + x_bytes + NW * (grp + 2) * 256);
    const u32 after = (xs + (u32)(x_bytes + NW * (grp + 2) * 256 + 4 * NW + 4) + 127u) & ~127u;
    FlowWeights fw;
    fw.warps_done = (u32*)(red + NW);  // OPTS & 2: the warps done with the block's current stage
    fw.ring = after;
    fw.full0 = after + (u32)(ns * slot_bytes);
    fw.empty0 = fw.full0 + 8u * (u32)ns;
    fw.ns = ns;
    fw.slot_bytes = slot_bytes;
    fw.it = 0;  // ring pieces consumed
    if (threadIdx.x == 0) {
        *fw.warps_done = 0u;
        if constexpr (OPTS & 32) {
            for (int s = 0; s < ns; ++s) {
                mbar_init(fw.full0 + 8 * s, 1);
                mbar_init(fw.empty0 + 8 * s, NW);
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
    }
    __syncthreads();
    if constexpr (OPTS & 32) {
        if (warp == NW) {
            if ((threadIdx.x & 31) == 0) flow_produce<OPTS>(lins, 4 * n_layers, fw.ring, ns, slot_bytes, fw.full0,
                                                            fw.empty0);
            return;
        }
    }
    const float scale_log2 = __int_as_float(scale_log2_bits), eps = __int_as_float(eps_bits);
    const int pos = pos_p[0], slot = slot_p[0], ctx = ctx_p[0];
    const int ntiles = (ctx + 31) >> 5;
    const int HA = n_heads * 128, NQ = (n_heads + 2 * n_kv) * 128;
    const int na = n_kv * ntiles;
    const int sync_stride = FS_SYNC + n_kv;
    const u32 nb = gridDim.x;
    const long long W = (long long)gridDim.x * NW, gw = (long long)blockIdx.x * NW + warp;
    int known = -1;  // the last attention wait this warp saw satisfied (layer)
    // measurements (benchmarks/fused_step_gpu.py's flow rows): block 0's thread 0 marks each stage's start, wait done,
    // input staged, tasks done, block done (FLOW_MARKS a layer), and the end of its warp's attention tasks
    const bool tracing = trace != nullptr && blockIdx.x == 0 && threadIdx.x == 0;
    for (int L = 0; L < n_layers; ++L) {
        unsigned long long* tl = tracing ? trace + (size_t)L * 21 : nullptr;
        u32* sy = sync + (size_t)L * sync_stride;
        const StepLinear* l4 = lins + 4 * L;
        u16* qkv = qkv_all + (size_t)L * NQ;
        u16* attn = attn_all + (size_t)L * HA;
        u16* hmid = hmid_all + (size_t)L * D;
        u16* act = act_all + (size_t)L * I;
        // qkv of the input norm of h[L], after the previous layer's down stage
        flow_linear_stage<RQ, CD, G, FS_QKV, NW, OPTS>(l4, NQ, h + (size_t)L * D, layers[L].in_norm, eps, nullptr, qkv,
                                                       L > 0 ? sync + (size_t)(L - 1) * sync_stride + FS_DOWN : nullptr,
                                                       nb, sy + FS_QKV, xs, red, act_kind, tl, fw);
        // attention: KV head tiles spread over all warps of the grid (warp gw: tiles gw, gw + W, ... of the
        // layer's list, so that each block's share differs layer to layer); a warp's own wait for qkv
        for (long long i = (gw - (long long)L * na % W + W) % W; i < na; i += W) {
            flow_attn<!(OPTS & 16)>(layers[L], qkv, attn, part, sy + FS_SYNC, (int)(i / ntiles), (int)(i % ntiles),
                                    ntiles, pos, slot, ctx, bt, cos_sin, n_heads, n_kv, block_size, max_tiles,
                                    scale_log2, qs, sy + FS_QKV, nb, L, known, sy + FS_ATT, lane_id());
        }
        if (tracing) tl[5] = global_ns();
        // o, + the residual stream h[L] -> hmid; after every KV head's combine
        flow_linear_stage<RO, CA, G, FS_O, NW, OPTS>(l4 + 1, D, attn, nullptr, eps, h + (size_t)L * D, hmid,
                                                     sy + FS_ATT, (u32)n_kv, sy + FS_O, xs, red, act_kind,
                                                     tl ? tl + 6 : nullptr, fw);
        // gate_up of the post-attention norm of hmid
        flow_linear_stage<RG, CD, G, FS_GU, NW, OPTS>(l4 + 2, I, hmid, layers[L].post_norm, eps, nullptr, act,
                                                      sy + FS_O, nb, sy + FS_GU, xs, red, act_kind,
                                                      tl ? tl + 11 : nullptr, fw);
        // down, + hmid -> h[L + 1]
        flow_linear_stage<RD, CI, G, FS_DOWN, NW, OPTS>(l4 + 3, D, act, nullptr, eps, hmid, h + (size_t)(L + 1) * D,
                                                        sy + FS_GU, nb, sy + FS_DOWN, xs, red, act_kind,
                                                        tl ? tl + 16 : nullptr, fw);
    }
}
