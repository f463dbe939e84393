// Runs vlmctl's NVRTC kernels on the CPU, for tests on machines without a GPU (tests/cuda_host.py
// explains the scheme and what it can and cannot show). Each GPU thread of a block is a fiber (ucontext);
// fibers switch only where CUDA threads synchronize (__syncthreads, warp shuffles, the emulated PDL wait),
// in a fresh random order each time, so code that leans on an order the GPU does not promise shows it.
// cp.async copies land either at once or only at the cp.async.wait that covers them (chosen at random per
// copy), and a block's shared memory starts as 0xFF bytes (NaN in fp16, bf16 and fp32).
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <deque>
#include <random>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__ __restrict
#define __constant__ static const  // read-only data of the translation unit
#define __shared__ static  // one block runs at a time, so a function's statics are its block's shared memory

struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };

using std::max;
using std::min;

namespace cuda_host {

struct Dim3 { unsigned x = 0, y = 0, z = 0; };

struct Copy {
    unsigned char* dst;
    const unsigned char* src;
    int bytes, total;  // bytes read from src; the rest of total zero-filled
};

struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    Dim3 tid;
    int warp = 0, lane = 0;
    bool done = false;
    int wait_kind = 0;  // 0 runnable, 1 block barrier, 2 warp barrier
    long wait_phase = 0;
    std::vector<Copy> open;                 // cp.async copies not yet committed
    std::deque<std::vector<Copy>> groups;   // committed groups, oldest first
};

struct State {
    ucontext_t main_ctx;
    std::vector<Fiber> fibers;
    Fiber* cur = nullptr;
    Dim3 block, grid, block_dim;
    std::mt19937_64 rng;
    std::vector<unsigned char> smem;  // the block's dynamic shared memory
    int live = 0, arrived = 0;
    long phase = 0;
    std::vector<int> warp_live, warp_arrived;
    std::vector<long> warp_phase;
    std::vector<uint64_t> shfl;  // [warp][lane]
    std::vector<uint32_t> xchg;  // [warp][lane][8]: operands of warp-wide instructions (mma, ldmatrix)
    void (*body)(const uint64_t*) = nullptr;
    const uint64_t* args = nullptr;
    // PDL emulation: the bytes the previous kernel writes hold `poison` until the block's wait
    unsigned char* guarded = nullptr;
    const unsigned char* guarded_real = nullptr;
    size_t guarded_bytes = 0;
    std::vector<std::pair<uintptr_t, uintptr_t>> buffers;  // [start, end) of each pointer argument
    std::string error;
};

inline State S;

[[noreturn]] inline void fail(const std::string& why) {
    if (S.error.empty()) S.error = why;
    // leave the fiber for good: the scheduler sees the error and stops the launch
    swapcontext(&S.cur->ctx, &S.main_ctx);
    abort();
}

[[noreturn]] inline void unemulated(const char* name) {
    fail(std::string("called ") + name + ", which tests/cuda_host.py does not emulate");
}

inline void yield() { swapcontext(&S.cur->ctx, &S.main_ctx); }

inline void release_block_if_complete() {
    if (S.arrived > 0 && S.arrived == S.live) { S.arrived = 0; ++S.phase; }
}

inline void release_warp_if_complete(int w) {
    if (S.warp_arrived[w] > 0 && S.warp_arrived[w] == S.warp_live[w]) { S.warp_arrived[w] = 0; ++S.warp_phase[w]; }
}

inline void sync_block() {
    Fiber* f = S.cur;
    f->wait_kind = 1;
    f->wait_phase = S.phase;
    ++S.arrived;
    release_block_if_complete();
    while (S.phase == f->wait_phase) yield();
    f->wait_kind = 0;
}

inline void sync_warp() {
    Fiber* f = S.cur;
    const int w = f->warp;
    f->wait_kind = 2;
    f->wait_phase = S.warp_phase[w];
    ++S.warp_arrived[w];
    release_warp_if_complete(w);
    while (S.warp_phase[w] == f->wait_phase) yield();
    f->wait_kind = 0;
}

// every lane of the warp reads lane src's v (src taken mod 32, as the hardware's index shuffle does)
template <class T>
inline T shfl_from(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
    if (mask != 0xffffffffu) fail("a shuffle with a partial mask (not emulated)");
    Fiber* f = S.cur;
    if (S.warp_live[f->warp] != 32) fail("a shuffle in a warp with exited lanes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    S.shfl[f->warp * 32 + f->lane] = bits;
    sync_warp();
    const uint64_t got = S.shfl[f->warp * 32 + (src & 31)];
    sync_warp();
    T r;
    memcpy(&r, &got, sizeof(T));
    return r;
}

template <class T>
inline T shfl_xor(unsigned mask, T v, int offset) { return shfl_from(mask, v, S.cur->lane ^ offset); }

// a read of `bytes` global bytes at p by an emulated PTX load or copy: inside one argument's buffer
inline void check_global(const void* p, int bytes, const char* what) {
    const uintptr_t a = (uintptr_t)p;
    for (const auto& b : S.buffers)
        if (a >= b.first && a + bytes <= b.second) return;
    fail(std::string(what) + " reads global memory outside every argument's buffer");
}

template <class T>
inline T load_global(const void* p, const char* what) {
    check_global(p, sizeof(T), what);
    return *static_cast<const T*>(p);
}

// a 16-byte-or-smaller read of the dynamic shared memory at byte offset `addr` (a shared-window address)
template <class T>
inline T load_shared(unsigned addr) {
    if ((size_t)addr + sizeof(T) > S.smem.size()) fail("a shared-memory read past the dynamic shared memory");
    if (addr % sizeof(T)) fail("a misaligned shared-memory read");
    T v;
    memcpy(&v, S.smem.data() + addr, sizeof(T));
    return v;
}

// ---- cp.async ----
inline void land(const Copy& c) {
    memcpy(c.dst, c.src, c.bytes);
    memset(c.dst + c.bytes, 0, c.total - c.bytes);
}

inline unsigned smem_offset(const void* p) {
    const unsigned char* b = S.smem.data();
    const unsigned char* q = static_cast<const unsigned char*>(p);
    if (q < b || q > b + S.smem.size()) fail("a shared-memory address outside the dynamic shared memory");
    return (unsigned)(q - b);
}

inline void cp_async(unsigned dst, const void* src, int bytes, int total) {
    if (bytes < 0 || bytes > total) fail("cp.async with a source size outside [0, copy size]");
    if ((size_t)dst + total > S.smem.size()) fail("cp.async past the end of the dynamic shared memory");
    if (dst % total) fail("cp.async to a misaligned shared-memory address");
    if (bytes > 0 && (uintptr_t)src % total) fail("cp.async from a misaligned global address");
    if (bytes > 0) check_global(src, bytes, "cp.async");
    Copy c{S.smem.data() + dst, static_cast<const unsigned char*>(src), bytes, total};
    if (S.rng() & 1) land(c);  // landed early
    else S.cur->open.push_back(c);
}

inline void cp_commit() {
    S.cur->groups.push_back(std::move(S.cur->open));
    S.cur->open.clear();
}

inline void cp_wait_group(int pending) {
    auto& g = S.cur->groups;
    while ((int)g.size() > pending) {
        for (const Copy& c : g.front()) land(c);
        g.pop_front();
    }
}

inline void cp_wait_all() {
    cp_commit();
    cp_wait_group(0);
}

// ---- PDL ----
inline void pdl_wait() {  // every thread of the block calls it once
    sync_block();
    if (S.cur->tid.x == 0 && S.cur->tid.y == 0 && S.cur->tid.z == 0 && S.guarded)
        memcpy(S.guarded, S.guarded_real, S.guarded_bytes);
    sync_block();
}

// ---- numbers ----
inline float f16_to_f32(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
inline uint16_t f16_round(double v) { _Float16 x = (_Float16)v; uint16_t h; memcpy(&h, &x, 2); return h; }
inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
inline uint16_t bf16_round(float f) {  // round to nearest even, as cvt.rn.bf16.f32
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

// a + b rounded to odd in double: then one more rounding to a narrower format (fp16, bf16) rounds the exact sum
inline double add_round_odd(double a, double b) {
    const double s = a + b;
    const double bb = s - a;
    const double err = (a - (s - bb)) + (b - bb);  // Knuth's TwoSum: s + err == a + b exactly
    if (err == 0) return s;
    uint64_t u;
    memcpy(&u, &s, 8);
    if (u & 1) return s;
    return nextafter(s, err > 0 ? INFINITY : -INFINITY);
}

// one fp16 lane of fma.rn.f16x2: the exact a * b + c, rounded once
inline uint16_t fma_f16(uint16_t a, uint16_t b, uint16_t c) {
    const double p = (double)f16_to_f32(a) * (double)f16_to_f32(b);  // 22 significant bits: exact
    return f16_round(add_round_odd(p, (double)f16_to_f32(c)));
}

template <class Op>
inline uint32_t lanes2(uint32_t a, uint32_t b, Op op) {
    return (uint32_t)op((uint16_t)(a & 0xffff), (uint16_t)(b & 0xffff)) |
           ((uint32_t)op((uint16_t)(a >> 16), (uint16_t)(b >> 16)) << 16);
}

inline uint32_t sub_f16x2(uint32_t a, uint32_t b) {  // sub.rn.f16x2: exact in double, rounded once
    return lanes2(a, b, [](uint16_t x, uint16_t y) { return f16_round((double)f16_to_f32(x) - f16_to_f32(y)); });
}

inline uint32_t mul_f16x2(uint32_t a, uint32_t b) {
    return lanes2(a, b, [](uint16_t x, uint16_t y) { return f16_round((double)f16_to_f32(x) * f16_to_f32(y)); });
}

inline uint32_t fma_f16x2(uint32_t a, uint32_t b, uint32_t c) {
    return (uint32_t)fma_f16(a & 0xffff, b & 0xffff, c & 0xffff) |
           ((uint32_t)fma_f16(a >> 16, b >> 16, c >> 16) << 16);
}

// a + b exactly (TwoSum), rounded to odd in float: one more rounding to bf16 then rounds the exact sum once
inline float add_round_odd_f32(double a, double b) {
    const double s = a + b, bb = s - a, err = (a - (s - bb)) + (b - bb);
    float f = (float)s;
    const double back = (double)f;
    if (back == s && err == 0) return f;  // exact
    uint32_t u;
    memcpy(&u, &f, 4);
    if (u & 1) return f;
    const double rest = (s - back) + err;  // exact - f, its sign is enough
    return nextafterf(f, rest > 0 ? INFINITY : -INFINITY);
}

inline uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {  // fma.rn.bf16x2: each lane's a * b + c rounded once
    auto one = [](uint16_t x, uint16_t y, uint16_t z) {
        const double p = (double)bf16_to_f32(x) * (double)bf16_to_f32(y);  // 16 significant bits: exact
        return bf16_round(add_round_odd_f32(p, (double)bf16_to_f32(z)));
    };
    return (uint32_t)one(a & 0xffff, b & 0xffff, c & 0xffff) | ((uint32_t)one(a >> 16, b >> 16, c >> 16) << 16);
}

// ---- warp-wide tensor-core instructions (every lane of the warp calls them together) ----
// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane i gives the address of row i % 8 of matrix i / 8; each lane
// receives in register j matrix j's row lane / 4, columns 2 (lane % 4) and 2 (lane % 4) + 1
inline void ldmatrix_x4(uint32_t (&r)[4], unsigned addr) {
    Fiber* f = S.cur;
    uint32_t* mine = &S.xchg[(f->warp * 32 + f->lane) * 8];
    mine[0] = addr;
    sync_warp();
    for (int j = 0; j < 4; ++j) {
        const unsigned row = S.xchg[(f->warp * 32 + j * 8 + f->lane / 4) * 8];
        r[j] = load_shared<uint32_t>(row + 4 * (f->lane % 4));
    }
    sync_warp();
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D = A B + C with A 16x16 (row-major fragments), B 16x8, C and
// D 16x8 in float32. Lane (g = lane / 4, t = lane % 4) holds A[g][2t..2t+1], A[g+8][2t..], A[g][2t+8..],
// A[g+8][2t+8..] in a[0..3]; B[2t..2t+1][g] in b0 and B[2t+8..2t+9][g] in b1; C[g][2t..2t+1] and
// C[g+8][2t..2t+1] in c[0..3]. The products are exact; the sum is formed in double and rounded once to float,
// where the tensor cores keep fewer bits (the tests compare with a tolerance).
inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
    Fiber* f = S.cur;
    uint32_t* mine = &S.xchg[(f->warp * 32 + f->lane) * 8];
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b0;
    mine[5] = b1;
    sync_warp();
    const uint32_t* w = &S.xchg[f->warp * 32 * 8];
    auto half = [&](uint32_t word, int e) {
        const uint16_t h = (uint16_t)(e ? word >> 16 : word & 0xffff);
        return (double)(bf16 ? bf16_to_f32(h) : f16_to_f32(h));
    };
    auto A = [&](int r, int k) {
        const int lane = (r % 8) * 4 + (k % 8) / 2, reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return half(w[lane * 8 + reg], k % 2);
    };
    auto B = [&](int k, int n) {
        const int lane = n * 4 + (k % 8) / 2;
        return half(w[lane * 8 + 4 + (k >= 8 ? 1 : 0)], k % 2);
    };
    const int g = f->lane / 4, t = f->lane % 4;
    float d[4];
    for (int e = 0; e < 4; ++e) {
        const int r = g + (e >= 2 ? 8 : 0), n = 2 * t + (e % 2);
        double sum = c[e];
        for (int k = 0; k < 16; ++k) sum += A(r, k) * B(k, n);
        d[e] = (float)sum;
    }
    sync_warp();
    for (int e = 0; e < 4; ++e) c[e] = d[e];
}

// ---- the launch ----
inline void fiber_main() {
    S.body(S.args);
    Fiber* f = S.cur;
    cp_wait_all();  // copies still in flight land; nothing reads them
    f->done = true;
    --S.live;
    --S.warp_live[f->warp];
    release_block_if_complete();  // an exited thread no longer holds a barrier back
    release_warp_if_complete(f->warp);
    swapcontext(&f->ctx, &S.main_ctx);
    abort();  // never resumed
}

inline bool runnable(const Fiber& f) {
    if (f.done) return false;
    if (f.wait_kind == 1) return S.phase != f.wait_phase;
    if (f.wait_kind == 2) return S.warp_phase[f.warp] != f.wait_phase;
    return true;
}

inline bool run_block(int threads, size_t smem_bytes) {
    S.smem.assign(smem_bytes + 16, 0xff);
    S.live = threads;
    S.arrived = 0;
    S.phase = 0;
    const int nwarps = (threads + 31) / 32;
    S.warp_live.assign(nwarps, 0);
    S.warp_arrived.assign(nwarps, 0);
    S.warp_phase.assign(nwarps, 0);
    S.shfl.assign(nwarps * 32, 0);
    S.xchg.assign(nwarps * 32 * 8, 0);
    for (int t = 0; t < threads; ++t) {
        Fiber& f = S.fibers[t];
        f.tid = Dim3{(unsigned)(t % S.block_dim.x), (unsigned)(t / S.block_dim.x % S.block_dim.y),
                     (unsigned)(t / (S.block_dim.x * S.block_dim.y))};
        f.warp = t / 32;
        f.lane = t % 32;
        f.done = false;
        f.wait_kind = 0;
        f.open.clear();
        f.groups.clear();
        ++S.warp_live[f.warp];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
    }
    if (S.guarded) memset(S.guarded, 0xff, S.guarded_bytes);
    std::vector<int> order(threads);
    for (int t = 0; t < threads; ++t) order[t] = t;
    while (S.live > 0) {
        std::shuffle(order.begin(), order.end(), S.rng);
        bool progressed = false;
        for (int t : order) {
            Fiber& f = S.fibers[t];
            if (!runnable(f)) continue;
            progressed = true;
            S.cur = &f;
            swapcontext(&S.main_ctx, &f.ctx);
            S.cur = nullptr;
            if (!S.error.empty()) return false;
        }
        if (!progressed) {
            S.error = "deadlock: every live thread waits at a barrier that the others never reach";
            return false;
        }
    }
    if (S.guarded) memcpy(S.guarded, S.guarded_real, S.guarded_bytes);
    return true;
}

}  // namespace cuda_host

#define threadIdx (cuda_host::S.cur->tid)
#define blockIdx (cuda_host::S.block)
#define gridDim (cuda_host::S.grid)
#define blockDim (cuda_host::S.block_dim)

inline void __syncthreads() { cuda_host::sync_block(); }
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int offset) { return cuda_host::shfl_xor(mask, v, offset); }
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src) { return cuda_host::shfl_from(mask, v, src); }
inline void __threadfence() {}  // one block runs at a time
inline int atomicAdd(int* p, int v) { const int o = *p; *p = o + v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned o = *p; *p = o + v; return o; }
inline int atomicExch(int* p, int v) { const int o = *p; *p = v; return o; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }

// Runs `body` (the generated wrapper that calls the kernel with its arguments) over the grid, blocks in a
// random order; `buffers`: n_buffers [start, end) pairs, the pointer arguments' bytes. Returns 0, or 1 with
// the reason in cuda_host_error().
extern "C" int cuda_host_launch(void (*body)(const uint64_t*), const uint64_t* args, unsigned gx, unsigned gy,
                                unsigned gz, unsigned bx, size_t smem_bytes, uint64_t seed, void* guarded,
                                const void* guarded_real, size_t guarded_bytes, const uint64_t* buffers,
                                int n_buffers) {
    using namespace cuda_host;
    S.error.clear();
    S.rng.seed(seed);
    S.body = body;
    S.args = args;
    S.grid = Dim3{gx, gy, gz};
    S.block_dim = Dim3{bx, 1, 1};
    S.guarded = static_cast<unsigned char*>(guarded);
    S.guarded_real = static_cast<const unsigned char*>(guarded_real);
    S.guarded_bytes = guarded_bytes;
    S.buffers.clear();
    for (int i = 0; i < n_buffers; ++i) S.buffers.emplace_back(buffers[2 * i], buffers[2 * i + 1]);
    if (S.fibers.size() < bx) {
        S.fibers.resize(bx);
        for (Fiber& f : S.fibers) f.stack.resize(1 << 18);
    }
    std::vector<Dim3> blocks;
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) blocks.push_back(Dim3{x, y, z});
    std::shuffle(blocks.begin(), blocks.end(), S.rng);
    for (const Dim3& b : blocks) {
        S.block = b;
        if (!run_block((int)bx, smem_bytes)) return 1;
    }
    return 0;
}

extern "C" const char* cuda_host_error() { return cuda_host::S.error.c_str(); }
