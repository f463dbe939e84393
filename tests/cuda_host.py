"""Run vlmctl's NVRTC kernels (CUDA C++ compiled at run time, `runtime/kernels/*.cu`) on the CPU, so that a
kernel written on a machine without a GPU is tested before it first runs on one.

How: the kernel source is preprocessed as NVRTC sees it (`__CUDA_ARCH__` 900). The kernels keep their
inline PTX in helpers of one instruction each; those helpers' bodies are replaced by host emulations
(`EMULATED` below, built on tests/cuda_host.h), and any other function that holds inline PTX (the
tensor-core kernels) by a body that fails the run if it is called. g++ compiles the result with a wrapper
for one template instance. A launch runs the grid's blocks one at a time in a random order, each block's
threads as fibers that switch where CUDA threads synchronize, in a random order (tests/cuda_host.h).
cp.async copies land at once or only at the wait that covers them, at random, and shared memory starts
as 0xFF bytes. The bytes that the previous kernel writes (`launch(guard=...)`) hold 0xFF (NaN in fp16
and bf16) in each block until its PDL wait. Emulated PTX loads and copies must read inside a pointer
argument; every pointer argument lies between 0xFF guard bytes that must be unchanged afterwards. The
launch runs in a forked child, so a stray access fails the test, not the test process.

What it shows: the kernel's own C++ against a reference: indexing, the work split over blocks, warps
and lanes, shared-memory layout and the reuse of ring slots, barriers, shuffle partners, the order of
explicit roundings, and reads of the previous kernel's output only after the wait. What it cannot show:
that the PTX in the helpers does what their emulations do (the GPU tests check that), the memory model
between blocks (they run one after another), registers, speed.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import mmap
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

HERE = Path(__file__).resolve().parent
GUARD = 256  # guard bytes on either side of every pointer argument (keeps 16-byte alignment)

# Host bodies of the one-instruction PTX helpers, by name (the helper keeps its signature from the source).
EMULATED = {
    "pdl_release": "{}",
    "pdl_wait": "{ cuda_host::pdl_wait(); }",
    "smem_addr": "{ return cuda_host::smem_offset(p); }",
    "cp_async16": "{ cuda_host::cp_async(dst, src, valid ? 16 : 0, 16); }",
    "cp_async16_s": "{ cuda_host::cp_async(dst, src, valid ? 16 : 0, 16); }",
    "cp_async_commit": "{ cuda_host::cp_commit(); }",
    "cp_async_wait": "{ cuda_host::cp_wait_group(N); }",
    "half_to_float": "{ return cuda_host::f16_to_f32(h); }",
    "f32_to_f16": "{ return cuda_host::f16_round(f); }",
    "ld_stream16": '{ return cuda_host::load_global<u32x4>(p, "ld.global.nc"); }',
    "ld_act16": '{ return cuda_host::load_global<u32x4>(p, "ld.global"); }',
    "sub_f16x2": "{ return cuda_host::sub_f16x2(a, b); }",
    "mul_f16x2": "{ return cuda_host::mul_f16x2(a, b); }",
    "fma_f16x2": "{ return cuda_host::fma_f16x2(a, b, c); }",
    "unpack_half2": "{ lo = (u16)(h & 0xffff); hi = (u16)(h >> 16); }",
    "as_float": "{ return __uint_as_float(u); }",
    "ld_shared_v4": "{ const uint4 v = cuda_host::load_shared<uint4>(addr); a = v.x; b = v.y; c = v.z; d = v.w; }",
    "ldmatrix_x4_s": "{ cuda_host::ldmatrix_x4(a, addr); }",
    "mma16816": "{ cuda_host::mma_m16n8k16(c, a, b0, b1, false); }",
    "mma16816_bf16": "{ cuda_host::mma_m16n8k16(c, a, b0, b1, true); }",
    "bf16_bits": "{ return cuda_host::bf16_round(f); }",
    "fma_bf16x2": "{ return cuda_host::fma_bf16x2(a, b, c); }",
    "pack_half2": "{ return (u32)cuda_host::f16_round(lo) | ((u32)cuda_host::f16_round(hi) << 16); }",
    "pack_bf16x2": "{ return (u32)cuda_host::bf16_round(lo) | ((u32)cuda_host::bf16_round(hi) << 16); }",
    "fence_gpu": "{}",  # one block runs at a time
    "take_ticket": "{ return atomicAdd(ticket, 1); }",
    "load_cg_f2": '{ return cuda_host::load_global<f32x2>(p, "ld.global.cg"); }',
}

_CFLAGS = ["-std=c++20", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing",
           "-Wno-unknown-pragmas", "-Wno-attributes"]


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


_AVAILABLE: list[str | None] = []


def unavailable() -> str | None:
    """Why kernels cannot run on the host here, or None (a C++20 compiler with _Float16 and ucontext)."""
    if not _AVAILABLE:
        cxx = compiler()
        why = None
        if cxx is None:
            why = "no C++ compiler (g++) on PATH"
        else:
            probe = '#include "cuda_host.h"\nint probe() { return (int)cuda_host::f16_to_f32(0x3c00); }\n'
            with tempfile.TemporaryDirectory() as d:
                src = Path(d, "probe.cpp")
                src.write_text(probe)
                r = subprocess.run([cxx, *_CFLAGS, f"-I{HERE}", "-o", str(Path(d, "p.so")), str(src)],
                                   check=False, capture_output=True, text=True)
                if r.returncode:
                    why = f"{cxx} cannot build tests/cuda_host.h: {r.stderr.strip().splitlines()[-1:]}"
        _AVAILABLE.append(why)
    return _AVAILABLE[0]


# ---- the source, as the host compiler gets it ----

def preprocess(source: str) -> str:
    r = subprocess.run([compiler(), "-E", "-P", "-x", "c++", "-std=c++17", "-D__CUDA_ARCH__=900", "-"],
                       input=source, check=False, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"preprocessing failed: {r.stderr}")
    return r.stdout


def _skip_string(text: str, i: int) -> int:
    q = text[i]
    i += 1
    while text[i] != q:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _match(text: str, i: int, open_: str = "{", close: str = "}") -> int:
    """Index just past the bracket that closes the one at text[i]."""
    depth = 0
    while True:
        c = text[i]
        if c in "\"'":
            i = _skip_string(text, i)
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1


@dataclass
class Function:
    name: str
    header: str  # from the template line to the parameter list's end
    start: int   # of the body's "{"
    end: int     # past its "}"
    is_kernel: bool


def _strip_balanced(text: str, word: str, open_: str, close: str) -> str:
    while True:
        m = re.search(rf"\b{word}\s*\{open_}", text)
        if not m:
            return text
        j = _match(text, m.end() - 1, open_, close)
        text = text[:m.start()] + text[j:]


def functions(text: str) -> list[Function]:
    """The function definitions at namespace scope of preprocessed C++."""
    out = []
    i, last = 0, 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = _skip_string(text, i)
        elif c in ";}":
            i += 1
            last = i
        elif c == "#":  # a pragma line
            i = text.index("\n", i) + 1
            last = i
        elif c == "{":
            end = _match(text, i)
            header = text[last:i].strip()
            bare = _strip_balanced(_strip_balanced(header, "template", "<", ">"), "__launch_bounds__", "(", ")")
            m = re.search(r"(\w+)\s*\(", bare)
            if m and not re.match(r"(struct|union|class|namespace|enum)\b", bare):
                out.append(Function(m.group(1), header, i, end, "__global__" in bare))
            i = end
            last = i
        else:
            i += 1
    return out


def host_source(source: str) -> str:
    """`source` preprocessed, its dynamic shared memory mapped to the emulated block's, its PTX helpers emulated
    and every other function with inline PTX made to fail the run if called."""
    return _host_text(preprocess(source))


def _host_text(text: str) -> str:
    text = re.sub(r"extern\s+__shared__\s+__align__\(\d+\)\s+([\w ]+?)\s+(\w+)\[\];",
                  r"\1* \2 = reinterpret_cast<\1*>(cuda_host::S.smem.data());", text)
    pieces, pos = [], 0
    for f in functions(text):
        body = text[f.start:f.end]
        n_asm = len(re.findall(r"\basm\b", body))
        if f.name in EMULATED:
            if n_asm != 1:
                raise ValueError(f"{f.name}: an emulated helper must wrap exactly one asm statement ({n_asm} here)")
            new = EMULATED[f.name]
        elif n_asm:
            new = f'{{ cuda_host::unemulated("{f.name}"); }}'
        else:
            continue
        pieces += [text[pos:f.start], new]
        pos = f.end
    pieces.append(text[pos:])
    return "".join(pieces)


def kernel_params(text: str, kernel: str) -> list[tuple[str, str]]:
    """(type, name) of each parameter of the __global__ function `kernel` in preprocessed text."""
    for f in functions(text):
        if f.name == kernel and f.is_kernel:
            bare = _strip_balanced(_strip_balanced(f.header, "template", "<", ">"), "__launch_bounds__", "(", ")")
            m = re.search(rf"\b{kernel}\s*\(", bare)
            params = bare[m.end():bare.rindex(")")]
            out = []
            for p in params.split(","):
                p = p.replace("__restrict__", " ").strip()
                name = re.search(r"(\w+)\s*$", p).group(1)
                out.append((p[:-len(name)].strip(), name))
            return out
    raise KeyError(f"no __global__ function {kernel}")


# ---- build and launch ----

class HostKernel:
    """One template instance of a kernel, compiled for the host."""

    _dir: ClassVar[list[str]] = []  # one temporary directory per test process for the built libraries

    def __init__(self, source: str, instance: str):
        self.instance = instance
        kernel = instance.split("<")[0].strip()
        text = preprocess(source)
        self.params = kernel_params(text, kernel)
        key = hashlib.sha1((source + instance + (HERE / "cuda_host.h").read_text()).encode()).hexdigest()[:16]
        if not HostKernel._dir:
            HostKernel._dir.append(tempfile.mkdtemp(prefix="vlmctl-cuda-host-"))
            atexit.register(shutil.rmtree, HostKernel._dir[0], True)  # the loaded libraries may go once we exit
        lib = Path(HostKernel._dir[0], f"{key}.so")
        if not lib.exists():
            args = []
            for i, (typ, _) in enumerate(self.params):
                if "*" in typ:
                    args.append(f"({typ})(uintptr_t)a[{i}]")
                elif typ == "float":
                    args.append(f"__uint_as_float((unsigned)a[{i}])")
                else:
                    args.append(f"({typ})(int64_t)a[{i}]")
            unit = (f'#include "cuda_host.h"\n{_host_text(text)}\n'
                    f"static void vh_body(const uint64_t* a) {{ {instance}({', '.join(args)}); }}\n"
                    'extern "C" int vh_run(const uint64_t* a, unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
                    "size_t smem, uint64_t seed, void* g, const void* gr, size_t gb, const uint64_t* bufs, "
                    "int nbufs) {\n"
                    "    return cuda_host_launch(vh_body, a, gx, gy, gz, bx, smem, seed, g, gr, gb, bufs, nbufs);\n}\n")
            src = lib.with_suffix(".cpp")
            src.write_text(unit)
            r = subprocess.run([compiler(), *_CFLAGS, f"-I{HERE}", "-o", str(lib) + ".tmp", str(src)],
                               check=False, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"g++ could not build {instance} for the host:\n{r.stderr[-6000:]}")
            os.replace(str(lib) + ".tmp", lib)
        self.lib = str(lib)

    def launch(self, grid: tuple, threads: int, shared_mem: int, args: list, seed: int = 0,
               guard: torch.Tensor | None = None) -> None:
        """Run the kernel over `grid` (1-3 ints) with `threads` threads a block. `args` as the kernel's parameters:
        CPU tensors (contiguous; distinct tensors must not share memory, the same tensor may come twice) or None
        for pointers, ints, floats. `guard`: one of the tensor arguments, the previous kernel's output: each block
        finds it 0xFF until its PDL wait. Tensors are written back."""
        if len(args) != len(self.params):
            raise TypeError(f"{self.instance} takes {len(self.params)} arguments, got {len(args)}")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        tensors = list({id(a): a for a in args if isinstance(a, torch.Tensor)}.values())
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("host kernels take contiguous CPU tensors")
        # each distinct tensor in a shared mapping (the child's writes come back), between guard bytes
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total + GUARD)
            total += GUARD + -(-n // GUARD) * GUARD + GUARD
        mem = mmap.mmap(-1, max(total, 1))
        buf = torch.frombuffer(mem, dtype=torch.uint8)
        buf.fill_(0xFF)
        for t, o, n in zip(tensors, offsets, sizes):
            buf[o:o + n].copy_(t.reshape(-1).view(torch.uint8))
        base = buf.data_ptr()
        where = {id(t): base + o for t, o in zip(tensors, offsets)}
        words = []
        for a, (typ, name) in zip(args, self.params):
            if isinstance(a, torch.Tensor):
                words.append(where[id(a)])
            elif a is None:
                words.append(0)
            elif typ == "float":
                words.append(struct.unpack("<I", struct.pack("<f", float(a)))[0])
            else:
                words.append(int(a) & 0xFFFFFFFFFFFFFFFF)
        g_ptr, g_real, g_bytes = 0, None, 0
        if guard is not None:
            g_ptr, g_bytes = where[id(guard)], guard.numel() * guard.element_size()
            g_real = guard.reshape(-1).view(torch.uint8).clone()  # the bytes the wait makes visible
        ranges = [v for o, n in zip(offsets, sizes) for v in (base + o, base + o + n)]
        err = _in_child(lambda: self._run(words, grid, threads, shared_mem, seed, g_ptr, g_real, g_bytes, ranges))
        if err:
            raise RuntimeError(f"{self.instance} on the host: {err}")
        for t, o, n in zip(tensors, offsets, sizes):
            lo, hi = buf[o - GUARD:o], buf[o + n:o + -(-n // GUARD) * GUARD + GUARD]
            if not (bool((lo == 0xFF).all()) and bool((hi == 0xFF).all())):
                raise RuntimeError(f"{self.instance} wrote outside a {tuple(t.shape)} {t.dtype} argument")
            t.reshape(-1).view(torch.uint8).copy_(buf[o:o + n])
        del buf
        mem.close()

    def _run(self, words, grid, threads, shared_mem, seed, g_ptr, g_real, g_bytes, ranges) -> str:
        lib = ctypes.CDLL(self.lib)
        lib.vh_run.restype = ctypes.c_int
        lib.vh_run.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                               ctypes.c_uint, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
        lib.cuda_host_error.restype = ctypes.c_char_p
        arr = (ctypes.c_uint64 * max(len(words), 1))(*words)
        real = g_real.data_ptr() if g_real is not None else None
        bufs = (ctypes.c_uint64 * max(len(ranges), 1))(*ranges)
        if lib.vh_run(arr, grid[0], grid[1], grid[2], threads, shared_mem, seed, g_ptr or None, real, g_bytes, bufs,
                      len(ranges) // 2):
            return lib.cuda_host_error().decode()
        return ""


class HostRTC:
    """Stands in for `vlmctl.runtime.kernels.cuda_rtc` where a launcher calls `cuda_rtc.load_kernel(...).launch(...)`
    (monkeypatch `load_kernel` with this object's): the launcher's own argument list, grid and shared-memory
    size then drive the host kernel. `guard`: the index of the argument the previous kernel writes (its
    bytes hold 0xFF in each block until the PDL wait); `seed`: the block, thread and copy orders."""

    def __init__(self, guard: int | None = 0, seed: int = 0):
        self.guard, self.seed = guard, seed
        self.launched: list[str] = []

    def load_kernel(self, source: str, name_expression: str, device, arch_suffix: str = ""):
        key = (hashlib.sha1(source.encode()).hexdigest(), name_expression)
        if key not in _KERNELS:
            _KERNELS[key] = HostKernel(source, name_expression)
        return _Launch(self, _KERNELS[key])


_KERNELS: dict = {}


class _Launch:
    def __init__(self, rtc: HostRTC, kernel: HostKernel):
        self.rtc, self.kernel = rtc, kernel

    def launch(self, grid, block, shared_mem: int, args: list, device, pdl: bool = False,
               cooperative: bool = False) -> None:
        if tuple(block)[1:] != (1, 1) or cooperative:
            raise ValueError("host kernels take one-dimensional blocks and plain launches")
        self.rtc.launched.append(self.kernel.instance)
        guard = args[self.rtc.guard] if self.rtc.guard is not None else None
        self.kernel.launch(grid, block[0], shared_mem, args, seed=self.rtc.seed, guard=guard)


def _in_child(fn) -> str:
    """fn() in a forked child: its message ("" for success), or why the child died."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            msg = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode() or b"")
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"the kernel crashed the host process (signal {os.WTERMSIG(status)}): an access out of bounds?"
    return b"".join(chunks).decode()
