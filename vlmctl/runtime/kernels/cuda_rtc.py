"""CUDA C++ kernels compiled at run time: NVRTC to a cubin for the GPU in use, loaded and launched
through the CUDA driver API (ctypes), on torch's current stream (so CUDA-graph capture records them).

Why not a compiled extension: vlmctl stays `pip install`-able without nvcc; NVRTC ships with torch's
CUDA wheels (and as `nvidia-cuda-nvrtc`), compiles without a GPU, and takes about a second per kernel.
Cubins are cached on disk per (source, kernel, architecture, NVRTC version) under
$VLMCTL_CACHE_DIR or ~/.cache/vlmctl/cubin, so a process compiles each kernel once per machine.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import sys
import threading
from pathlib import Path

_LOCK = threading.Lock()
_NVRTC = None
_AVAILABLE: bool | None = None
_CUDA = None
_MODULES: dict = {}  # (cubin digest, device index) -> CUmodule handle


class RtcError(RuntimeError):
    """NVRTC or the CUDA driver refused: the message carries the compiler log or the driver's error name;
    `code` the driver's CUresult (None for NVRTC)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


# CUresult of a cooperative launch whose blocks cannot all be resident at once (fewer SMs than the grid
# needs: e.g. an MPS client limited to a share of them)
COOPERATIVE_LAUNCH_TOO_LARGE = 720


def nvrtc_library() -> ctypes.CDLL:
    """libnvrtc: the one torch's CUDA build loaded (found by soname), else an `nvidia-*` wheel's copy."""
    global _NVRTC
    if _NVRTC is not None:
        return _NVRTC
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for base in sys.path:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*")), reverse=True)
    errors = []
    for name in names:
        if "builtins" in os.path.basename(name):
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _NVRTC = lib
        return lib
    raise RtcError("NVRTC (libnvrtc) was not found: it comes with torch's CUDA wheels or `pip install "
                   "nvidia-cuda-nvrtc`")


def nvrtc_version() -> tuple[int, int]:
    lib = nvrtc_library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _check_nvrtc(lib, res: int, what: str) -> None:
    if res != 0:
        raise RtcError(f"NVRTC {what}: {lib.nvrtcGetErrorString(res).decode()}")


def compile_cubin(source: str, name_expressions: list[str], arch: str, options: tuple = ()) -> tuple[bytes, dict]:
    """Compile `source` for `arch` (e.g. "sm_90") and return (cubin, {name expression: lowered name}).
    Raises RtcError with NVRTC's log if it does not compile."""
    return _compile(source, name_expressions, arch, options, "CUBIN")


def compile_ptx(source: str, name_expressions: list[str], arch: str, options: tuple = ()) -> tuple[str, dict]:
    """As `compile_cubin`, but the PTX (for reading what a kernel does where: tests of the PDL contract)."""
    ptx, lowered = _compile(source, name_expressions, arch, options, "PTX")
    return ptx.rstrip(b"\0").decode(), lowered


def _compile(source: str, name_expressions: list[str], arch: str, options: tuple, output: str) -> tuple[bytes, dict]:
    lib = nvrtc_library()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"vlmctl.cu", 0, None, None),
                 "create")
    try:
        for expr in name_expressions:
            _check_nvrtc(lib, lib.nvrtcAddNameExpression(prog, expr.encode()), "name expression")
        opts = [f"--gpu-architecture={arch}", "-std=c++17", *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        res = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if res != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RtcError(f"NVRTC could not compile for {arch}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib, getattr(lib, f"nvrtcGet{output}Size")(prog, ctypes.byref(size)), f"{output} size")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, getattr(lib, f"nvrtcGet{output}")(prog, cubin), output)
        lowered = {}
        for expr in name_expressions:
            name = ctypes.c_char_p()
            _check_nvrtc(lib, lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(name)), "lowered name")
            lowered[expr] = name.value.decode()
        return cubin.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cache_dir() -> Path:
    return Path(os.environ.get("VLMCTL_CACHE_DIR") or Path.home() / ".cache" / "vlmctl") / "cubin"


def cached_cubin(source: str, name_expression: str, arch: str) -> tuple[bytes, str]:
    """compile_cubin for one kernel, through the on-disk cache (written atomically; unwritable is fine)."""
    key = hashlib.sha256("\0".join([source, name_expression, arch, "%d.%d" % nvrtc_version()]).encode()).hexdigest()
    path = cache_dir() / f"{key[:32]}.cubin"
    try:
        blob = path.read_bytes()
        name, cubin = blob.split(b"\0", 1)
        return cubin, name.decode()
    except (OSError, ValueError):
        pass
    cubin, lowered = compile_cubin(source, [name_expression], arch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(lowered[name_expression].encode() + b"\0" + cubin)
        os.replace(tmp, path)
    except OSError:
        pass
    return cubin, lowered[name_expression]


def precompile(source: str, name_expressions, arch: str, workers: int = 16) -> int:
    """Fill the on-disk cache for these kernels, several NVRTC compilations at a time (NVRTC runs
    outside the GIL), so that a sweep over many template instances does not compile them one by one;
    returns how many distinct kernels there were."""
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(set(name_expressions))
    with ThreadPoolExecutor(max(1, workers)) as ex:
        list(ex.map(lambda e: cached_cubin(source, e, arch), names))
    return len(names)


def _driver() -> ctypes.CDLL:
    global _CUDA
    if _CUDA is None:
        _CUDA = ctypes.CDLL("libcuda.so.1")
        _CUDA.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return _CUDA


def _check_cuda(res: int, what: str) -> None:
    if res != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(res, ctypes.byref(name))
        raise RtcError(f"CUDA driver {what}: {(name.value or b'?').decode()} ({res})", code=res)


# CUtensorMapDataType / CUtensorMapSwizzle values (cuda.h) for `tensor_map_2d`
TMAP_UINT16, TMAP_UINT32 = 1, 2
TMAP_SWIZZLE_NONE, TMAP_SWIZZLE_64B, TMAP_SWIZZLE_128B = 0, 2, 3


@functools.lru_cache(maxsize=1024)  # a pure function of its arguments; eager launches then encode each map once
def tensor_map_2d(ptr: int, dtype: int, cols: int, rows: int, row_bytes: int, box_cols: int, box_rows: int,
                  swizzle: int) -> bytes:
    """A CUtensorMap (128 bytes, a kernel parameter) for the TMA: a row-major [rows, cols] tensor of `dtype`
    elements at device address ptr, rows row_bytes apart, copied in boxes of box_rows x box_cols; elements
    outside the tensor read as zero. L2 promotion 128 bytes, no interleave."""
    buf = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    _check_cuda(_driver().cuTensorMapEncodeTiled(buf, ctypes.c_int(dtype), ctypes.c_uint32(2), ctypes.c_void_p(ptr),
                                                  dims, strides, box, elem, ctypes.c_int(0), ctypes.c_int(swizzle),
                                                  ctypes.c_int(2), ctypes.c_int(0)),
                f"tensor map of [{rows}, {cols}] in boxes of [{box_rows}, {box_cols}]")
    return bytes(buf)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (cuda.h), for cuLaunchKernelEx
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_COOPERATIVE = 2  # CU_LAUNCH_ATTRIBUTE_COOPERATIVE
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def _flag_attribute(attr_id: int) -> _LaunchAttribute:
    a = _LaunchAttribute()
    a.id = attr_id
    a.value[0] = 1  # the union's first int: programmaticStreamSerializationAllowed / cooperative
    return a


def _pdl_attribute() -> _LaunchAttribute:
    return _flag_attribute(_PROGRAMMATIC_STREAM_SERIALIZATION)


class Kernel:
    """One loaded kernel function; `launch` puts it on torch's current stream of `device`."""

    _MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _PDL = _pdl_attribute()
    _COOPERATIVE = _flag_attribute(_COOPERATIVE)

    def __init__(self, func: ctypes.c_void_p, name: str):
        self.func = func
        self.name = name
        self._smem_limit = 0  # raised (once per size) for any dynamic size: static shared memory counts against 48 KB too

    def launch(self, grid, block, shared_mem: int, args: list, device, pdl: bool = False,
               cooperative: bool = False) -> None:
        """pdl: launch with programmatic dependent launch (sm_90+; `kernels/pdl.py` has the contract the
        kernel must keep: nothing but weights read before its griddepcontrol.wait). cooperative: all blocks
        resident at once, or the launch fails (for kernels whose blocks wait for each other)."""
        import torch

        if pdl and cooperative:
            raise ValueError(f"{self.name}: one launch attribute at a time (PDL or cooperative)")
        if shared_mem > self._smem_limit:
            _check_cuda(_driver().cuFuncSetAttribute(self.func, self._MAX_DYNAMIC_SHARED, shared_mem),
                        f"shared memory of {self.name} to {shared_mem} bytes")
            self._smem_limit = shared_mem
        holders = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, int):
                holders.append(ctypes.c_int(a))
            elif isinstance(a, float):
                holders.append(ctypes.c_float(a))
            elif a is None:
                holders.append(ctypes.c_void_p(0))
            elif isinstance(a, bytes):  # a by-value struct parameter, e.g. a tensor map
                holders.append((ctypes.c_ubyte * len(a)).from_buffer_copy(a))
            else:
                raise TypeError(f"kernel argument of type {type(a).__name__}")
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        stream = torch.cuda.current_stream(device).cuda_stream
        if pdl or cooperative:
            attr = self._PDL if pdl else self._COOPERATIVE
            cfg = _LaunchConfig(*grid, *block, shared_mem, ctypes.c_void_p(stream), ctypes.pointer(attr), 1)
            _check_cuda(_driver().cuLaunchKernelEx(ctypes.byref(cfg), self.func, params, None),
                        f"launch of {self.name} ({'PDL' if pdl else 'cooperative'})")
            return
        _check_cuda(_driver().cuLaunchKernel(self.func, *grid, *block, shared_mem, ctypes.c_void_p(stream),
                                             params, None), f"launch of {self.name}")


_KERNELS: dict = {}


def load_kernel(source: str, name_expression: str, device, arch_suffix: str = "") -> Kernel:
    """Compile (or take from the caches) and load `name_expression` of `source` on a CUDA device.
    arch_suffix "a" compiles for the architecture-specific target (sm_90a: warpgroup MMA)."""
    import torch

    device = torch.device(device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    # called on every launch: str hashes are cached on the object, so this key costs no pass over the source
    key = (hash(source), len(source), name_expression, idx, arch_suffix)
    k = _KERNELS.get(key)
    if k is not None:
        return k
    with _LOCK:
        major, minor = torch.cuda.get_device_capability(idx)
        cubin, lowered = cached_cubin(source, name_expression, f"sm_{major}{minor}{arch_suffix}")
        with torch.cuda.device(idx):
            torch.cuda.current_stream()  # makes torch's primary context current on this thread
            module = ctypes.c_void_p()
            _check_cuda(_driver().cuModuleLoadData(ctypes.byref(module), cubin), "module load")
            func = ctypes.c_void_p()
            _check_cuda(_driver().cuModuleGetFunction(ctypes.byref(func), module, lowered.encode()),
                        f"function {lowered}")
        _MODULES[key] = module
        k = _KERNELS[key] = Kernel(func, name_expression)
        return k


def available() -> bool:
    """Whether kernels can be compiled here (NVRTC found); a GPU is needed only to load and run them.
    Remembered after the first answer: kernel selection asks on every call."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            nvrtc_library()
            _AVAILABLE = True
        except RtcError:
            _AVAILABLE = False
    return _AVAILABLE


__all__ = ["Kernel", "RtcError", "available", "cache_dir", "cached_cubin", "compile_cubin", "compile_ptx",
           "load_kernel", "nvrtc_library", "nvrtc_version", "precompile"]
