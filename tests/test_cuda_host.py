"""tests/cuda_host.py, the CPU stand-in that runs the NVRTC kernels' CUDA C++ for the tests of
w4a16_mma.cu on machines without a GPU: small kernels written here show that it
computes what CUDA computes where the code is right, and that it catches what it claims to catch: a missing
barrier, a cp.async read before its wait, a read of the previous kernel's output before the PDL wait,
threads waiting at barriers that cannot all complete, writes out of bounds, and a helper with more than one
instruction of inline PTX."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuda_host as H

pytestmark = pytest.mark.skipif(H.unavailable() is not None, reason=f"{H.unavailable()}")

SOURCE = r"""
typedef unsigned int u32;

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

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

__device__ __forceinline__ float two_instructions(float a) {
    float b;
    asm("mul.rn.f32 %0, %1, %1;" : "=f"(b) : "f"(a));
    asm("add.rn.f32 %0, %0, %1;" : "+f"(b) : "f"(a));
    return b;
}

// out[block] = sum of x[block * blockDim + t] over the block's threads: shuffles, then the warps' sums through
// shared memory. BARRIER 0 leaves out the barrier between the warps' writes and thread 0's reads.
template <int BARRIER>
__global__ void block_sum(const float* x, float* out) {
    __shared__ float warp_sums[32];
    const int t = threadIdx.x;
    float v = x[blockIdx.x * blockDim.x + t];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((t & 31) == 0) warp_sums[t >> 5] = v;
    if (BARRIER) __syncthreads();
    if (t == 0) {
        float s = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += warp_sums[w];
        out[blockIdx.x] = s;
    }
}

// out[i] = x[i] + 1, with x the previous kernel's output: read after the PDL wait (EARLY 0) or before it
template <int EARLY>
__global__ void after_wait(const float* x, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = 0.f;
    if (EARLY && i < n) v = x[i];
    pdl_wait();
    if (!EARLY && i < n) v = x[i];
    if (i < n) out[i] = v + 1.f;
}

// each thread copies its 16 bytes of x through shared memory with cp.async; WAIT 0 reads them back without
// waiting for the copy
template <int WAIT>
__global__ void staged_copy(const float* x, float* out) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int t = threadIdx.x;
    cp_async16(smem_addr(smem + 16 * t), x + 4 * t, true);
    cp_async_commit();
    if (WAIT) cp_async_wait<0>();
    for (int j = 0; j < 4; ++j) out[4 * t + j] = reinterpret_cast<const float*>(smem + 16 * t)[j];
}

__device__ __forceinline__ u32 fma_f16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__global__ void fma_pairs(const u32* a, const u32* b, const u32* c, u32* d, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) d[i] = fma_f16x2(a[i], b[i], c[i]);
}

// half a warp at the block's barrier, the other half at a shuffle that needs the whole warp
__global__ void divergent_barrier(float* out) {
    float v = 1.f;
    if (threadIdx.x < 16) __syncthreads();
    else v = __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

// out[i] = x of lane (lane * 5 + 3) mod 32 of the same warp: an index shuffle (src taken mod 32)
__global__ void lane_gather(const float* x, float* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = __shfl_sync(0xffffffffu, x[i], (int)(threadIdx.x & 31) * 5 + 3);
}

// writes one element past the end of out
__global__ void off_the_end(float* out, int n) {
    out[threadIdx.x + 1] = 2.f;
    (void)n;
}
"""


def test_block_sum_with_shuffles_and_shared_memory():
    k = H.HostKernel(SOURCE, "block_sum<1>")
    x = torch.randn(3 * 128)
    out = torch.zeros(3)
    k.launch((3,), 128, 0, [x, out], seed=1)
    assert torch.allclose(out, x.view(3, 128).sum(1), atol=1e-5)


def test_index_shuffle_reads_the_named_lane_of_its_own_warp():
    x = torch.randn(2 * 64)
    out = torch.zeros(2 * 64)
    H.HostKernel(SOURCE, "lane_gather").launch((2,), 64, 0, [x, out], seed=3)
    lanes = torch.arange(32)
    src = (lanes * 5 + 3) % 32
    expected = torch.cat([x[w * 32:(w + 1) * 32][src] for w in range(4)])
    assert torch.equal(out, expected)


def test_a_missing_barrier_shows_in_some_thread_order():
    k = H.HostKernel(SOURCE, "block_sum<0>")
    x = torch.ones(128)
    sums = []
    for seed in range(8):
        out = torch.zeros(1)
        k.launch((1,), 128, 0, [x, out], seed=seed)
        sums.append(float(out))
    assert any(s != 128.0 for s in sums), sums  # thread 0 read a warp's slot before the warp wrote it


def test_reads_of_the_previous_kernels_output_count_only_after_the_wait():
    x = torch.arange(200, dtype=torch.float32)
    out = torch.zeros(200)
    H.HostKernel(SOURCE, "after_wait<0>").launch((2,), 128, 0, [x, out, 200], guard=x)
    assert torch.equal(out, x + 1)
    H.HostKernel(SOURCE, "after_wait<1>").launch((2,), 128, 0, [x, out, 200], guard=x)
    assert torch.isnan(out).all()  # read before the wait: the guard's 0xFF bytes, a NaN


def test_a_cp_async_read_before_its_wait_shows():
    x = torch.randn(4 * 64)
    out = torch.zeros_like(x)
    k = H.HostKernel(SOURCE, "staged_copy<1>")
    k.launch((1,), 64, 16 * 64, [x, out], seed=3)
    assert torch.equal(out, x)
    H.HostKernel(SOURCE, "staged_copy<0>").launch((1,), 64, 16 * 64, [x, out], seed=3)
    assert torch.isnan(out).any() and not torch.isnan(out).all()  # some copies had not landed (shared memory 0xFF)


def test_threads_waiting_at_barriers_that_cannot_complete_deadlock():
    with pytest.raises(RuntimeError, match="deadlock"):
        H.HostKernel(SOURCE, "divergent_barrier").launch((1,), 32, 0, [torch.zeros(32)])


def test_a_write_out_of_bounds_is_caught():
    with pytest.raises(RuntimeError, match="wrote outside"):
        H.HostKernel(SOURCE, "off_the_end").launch((1,), 32, 0, [torch.zeros(32), 32])


def test_only_one_instruction_helpers_are_emulated(monkeypatch):
    monkeypatch.setitem(H.EMULATED, "two_instructions", "{ return a * a + a; }")
    with pytest.raises(ValueError, match="two_instructions: an emulated helper must wrap exactly one asm"):
        H.host_source(SOURCE)
    monkeypatch.delitem(H.EMULATED, "two_instructions")
    assert 'cuda_host::unemulated("two_instructions")' in H.host_source(SOURCE)  # fails the run if called


def test_fp16_fma_rounds_once():
    """fma.rn.f16x2 as the GPU computes it: the exact a * b + c rounded once to fp16 (products of random fp16
    numbers of moderate exponents, whose exact sums a double holds). Rounding through float32 first gives
    the other neighbour in some of these cases, so the comparison can tell the two apart."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 16
    a, b, c = ((torch.rand(2 * n, generator=g) * 4 - 2).half() for _ in range(3))
    d = torch.zeros(n, dtype=torch.int32)
    words = [t.view(torch.int32) for t in (a, b, c)]
    H.HostKernel(SOURCE, "fma_pairs").launch((n // 128,), 128, 0, [*words, d, n])
    exact = (a.double() * b.double() + c.double()).numpy()
    once = torch.from_numpy(exact.astype(np.float16))  # numpy rounds a double to fp16 directly (torch via fp32)
    assert torch.equal(d.view(torch.float16), once)
    assert not torch.equal(torch.from_numpy(exact).float().half(), once)  # rounding twice differs somewhere
