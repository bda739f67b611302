"""Compiling the CUDA C++ variants of kernel families at run time, once per source.

A CUDA candidate is still a Python candidate file (codegen/family.py): it holds the CUDA source
as a string and calls `load_extension` on import. Every candidate of one (family, case) holds
byte-identical source with one template instantiation per config of the search space, so the
whole search costs one compile; the config only picks which exported function `forward` calls.

Builds go to `$PIPELINE_CUDA_CACHE/<sha1>` (default ~/.cache/kernel-pipeline/cuda/<sha1>), keyed
on the source and on what makes a binary unusable elsewhere (torch and CUDA versions, the GPU
arch), so the search's worker processes, the verifier, integration and a resumed run import the
built module instead of compiling again.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from codegen.dtypes import torch_dtype
from core.errors import UserError

CACHE_ENV = "PIPELINE_CUDA_CACHE"
BACKENDS = ("triton", "cuda", "both")
# -O3 only: --use_fast_math (denormals flushed to zero, approximate division, __expf) is not
# shown to stay within the verifier's tolerances on its "tiny" and stress inputs; the kernels
# are memory-bound, so it would buy nothing measurable anyway.
CFLAGS = ("-O3",)
_OK = "built.ok"  # written after a successful build: the fast path imports without ninja

_loaded: dict[str, ModuleType] = {}


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "kernel-pipeline" / "cuda"


def build_key(cuda_source: str, cpp_source: str, functions: tuple[str, ...]) -> str:
    """sha1 of the sources and of what the binary depends on besides them."""
    import torch

    arch = str(torch.cuda.get_device_capability()) if torch.cuda.is_available() else "none"
    parts = [cuda_source, cpp_source, " ".join(functions), " ".join(CFLAGS), torch.__version__,
             str(torch.version.cuda), arch, os.environ.get("TORCH_CUDA_ARCH_LIST", "")]
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()


def load_extension(cuda_source: str, cpp_source: str, functions: tuple[str, ...]) -> ModuleType:
    """The compiled module exporting `functions` (declared in `cpp_source`, defined in
    `cuda_source`), built on first use and reused from the cache afterwards."""
    key = build_key(cuda_source, cpp_source, tuple(functions))
    if key in _loaded:
        return _loaded[key]
    name = f"kp_cuda_{key[:16]}"
    folder = cache_root() / key
    lib = folder / f"{name}.so"
    if not ((folder / _OK).exists() and lib.exists()):
        folder.mkdir(parents=True, exist_ok=True)
        # One build at a time per source, across processes, under a lock the OS drops when its
        # holder dies: torch's own lock file outlives a killed build (a worker that timed out,
        # ^C) and would make every later build of the source wait on it forever.
        with open(folder / "build.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            if not ((folder / _OK).exists() and lib.exists()):  # or built while we waited
                from torch.utils.cpp_extension import load_inline

                (folder / "lock").unlink(missing_ok=True)  # we hold the only live lock
                # fresh lists: load_inline inserts its implicit #includes into them
                module = load_inline(
                    name=name, cpp_sources=[cpp_source], cuda_sources=[cuda_source],
                    functions=list(functions), extra_cflags=list(CFLAGS),
                    extra_cuda_cflags=list(CFLAGS), build_directory=str(folder))
                (folder / _OK).write_text(key + "\n")
                _loaded[key] = module
                return module
    module = _loaded[key] = _import(name, lib)
    return module


def build(cuda_source: str, cpp_source: str, functions: tuple[str, ...]) -> str:
    """Compile (or find) the build without keeping the module: for builds run side by side in
    worker processes ahead of use. Returns the build folder."""
    load_extension(cuda_source, cpp_source, functions)
    return str(cache_root() / build_key(cuda_source, cpp_source, tuple(functions)))


def _import(name: str, lib: Path) -> ModuleType:
    """Import a built extension as torch's JIT loader does, without its ninja up-to-date check
    (a fraction of a second in every worker process that loads a candidate)."""
    import torch  # noqa: F401 - the extension links against libtorch, loaded by this import

    spec = importlib.util.spec_from_file_location(name, lib)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the CUDA extension {lib}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.setdefault(name, module)
    return module


def build_problem() -> str | None:
    """Why CUDA C++ variants cannot be compiled and run here, or None when they can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit found to compile them (nvcc; set CUDA_HOME)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja); torch builds extensions with it"
    return None


def resolve_backend(backend: str, device: str) -> tuple[str, str | None]:
    """(backend to generate, note for the user). CPU runs fall back to Triton (its interpreter
    runs there, CUDA C++ cannot); a GPU run that cannot compile CUDA fails before searching."""
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "triton":
        return backend, None
    if not str(device).startswith("cuda"):
        return "triton", "CUDA C++ variants need a CUDA GPU; generating Triton"
    problem = build_problem()
    if problem:
        raise UserError(f"--backend {backend} cannot build CUDA C++ variants: {problem}; "
                        f"use --backend triton")
    return backend, None


def source_text(title: str, defines: list[str], body: str, wrappers: list[str]) -> str:
    """A family's CUDA source: title comment, includes, the case's constants, helpers, kernel
    and host code, then one exported wrapper per config."""
    return "\n".join([f"// {title}", INCLUDES, *defines, "", HELPERS.strip("\n"), "",
                      body.strip("\n"), "",
                      "// One exported function per config of the search space.", *wrappers,
                      ""])


def python_tuple(names: tuple[str, ...]) -> str:
    return "(\n" + "".join(f"    {n!r},\n" for n in names) + ")"


def python_string(text: str) -> str:
    """`text` as a raw triple-quoted Python literal, readable in a rendered candidate file."""
    if "'''" in text or text.endswith("\\"):
        raise ValueError("CUDA source cannot be embedded as a raw ''' string")
    return f"r'''{text}'''"


# Storage type in CUDA and torch scalar type (checked by the host code) of each case dtype.
CUDA_TYPES = {"float32": ("float", "at::kFloat"), "float16": ("__half", "at::kHalf"),
              "bfloat16": ("__nv_bfloat16", "at::kBFloat16")}


def vec_width(width: int, dtype: str) -> int:
    """Elements per vector access: 16 bytes' worth, halved until it divides the row width, so
    every row start is aligned when the base pointer and row stride are (1: scalar only)."""
    vec = 16 // torch_dtype(dtype).itemsize
    while width % vec:
        vec //= 2
    return vec


def dtype_defines(dtype: str) -> str:
    ctype, scalar = CUDA_TYPES[dtype]
    return f"typedef {ctype} scalar_t;  // storage type of {dtype}\n#define SCALAR_TYPE {scalar}"


# Shared by the families' CUDA sources: headers (before the case's #defines, which must not
# reach into them), then fp32 conversions and vector packs.
INCLUDES = r"""#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
"""

HELPERS = r"""
// Arithmetic runs in fp32; the storage type appears only at loads and stores, and a value is
// rounded (to nearest even) only where the PyTorch reference rounds it.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// N consecutive elements moved by one vector access (16 bytes for N * sizeof(T) == 16). The
// host takes the N > 1 path only when base pointers and row strides are aligned to a Pack.
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

template <typename T, int N> inline bool pack_aligned(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % alignof(Pack<T, N>) == 0;
}
"""
