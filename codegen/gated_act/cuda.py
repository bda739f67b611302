"""CUDA C++ gated activation: out = act(gate) * up, one read of each input, one write.

The grid runs over a flat index of (row, vector) pairs, so any row count and row stride is one
launch with no idle tail per row; each thread issues all ITEMS vector loads of both inputs
before computing (memory-level parallelism), in fp32, and rounds once at the store. Phi-3's
packed gate_up is read in place: gate and up are its two column halves, COLS elements apart.

The CUDA source is specialised to the case's width, dtype, activation and layout and holds every
config of the space as a template instantiation; the rendered candidates of a case share it
byte for byte (one compile: codegen/cuda_build.py) and differ only in the function they call.
"""

from __future__ import annotations

import json
import textwrap

from codegen.cuda_build import dtype_defines, python_string, python_tuple, source_text, vec_width
from core.family import Case

THREADS = (128, 256, 512)
ITEMS = (1, 2, 4)

# Torch's CUDA formulas in fp32 (aten ActivationSiluKernel.cu / ActivationGeluKernel.cu), so the
# fused kernel differs from HF only by rounding once instead of twice in half precision.
_ACT = {
    "silu": "return g / (1.0f + expf(-g));",
    "gelu_tanh": "const float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));\n"
                 "  return 0.5f * g * (1.0f + tanhf(inner));",
}

_KERNEL = r"""
template <int THREADS, int VEC, int ITEMS>
__global__ void __launch_bounds__(THREADS)
gated_act_kernel(const scalar_t* __restrict__ gate, const scalar_t* __restrict__ up,
                 scalar_t* __restrict__ out, int64_t n_rows, int64_t gate_stride,
                 int64_t up_stride, int64_t out_stride) {
  static_assert(COLS % VEC == 0, "VEC divides the row");
  using P = Pack<scalar_t, VEC>;
  constexpr int64_t CHUNKS = COLS / VEC;  // vectors per row
  // int64: rows * row stride passes 2**31 at 65536 tokens of a wide packed gate_up
  const int64_t total = n_rows * CHUNKS;
  const int64_t first = (int64_t)blockIdx.x * (THREADS * ITEMS) + threadIdx.x;
  P g[ITEMS], u[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {  // every load in flight before any arithmetic
    const int64_t idx = first + (int64_t)i * THREADS;
    if (idx < total) {
      const int64_t row = idx / CHUNKS, c = idx - row * CHUNKS;
      g[i] = reinterpret_cast<const P*>(gate + row * gate_stride)[c];
      u[i] = reinterpret_cast<const P*>(up + row * up_stride)[c];
    }
  }
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t idx = first + (int64_t)i * THREADS;
    if (idx < total) {
      const int64_t row = idx / CHUNKS, c = idx - row * CHUNKS;
      P o;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        o.v[k] = from_float<scalar_t>(act(to_float(g[i].v[k])) * to_float(u[i].v[k]));
      reinterpret_cast<P*>(out + row * out_stride)[c] = o;
    }
  }
}

// Distance between rows of a (..., width) tensor with unit column stride whose leading dims
// merge into one row dim (what reshape(-1, width) would view without copying).
static int64_t row_stride(const at::Tensor& t, int64_t width, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() >= 1 && t.size(-1) == width && t.stride(-1) == 1 &&
              t.scalar_type() == SCALAR_TYPE, name, " must be a CUDA ", SCALAR_TYPE,
              " (..., ", width, ") tensor with unit column stride, got ", t.scalar_type(), " ",
              t.sizes(), " strides ", t.strides());
  int64_t stride = width, expected = -1;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;  // a dim of one has no meaningful stride
    TORCH_CHECK(expected < 0 || t.stride(d) == expected, name, "'s leading dims do not merge "
                "into rows: sizes ", t.sizes(), " strides ", t.strides());
    if (expected < 0) stride = t.stride(d);
    expected = t.stride(d) * t.size(d);
  }
  return stride;
}

template <int THREADS, int VEC, int ITEMS>
static void launch(const scalar_t* gate, const scalar_t* up, const at::Tensor& out,
                   int64_t gs, int64_t us) {
  const int64_t os = row_stride(out, COLS, "out");
  const int64_t rows = out.numel() / COLS;
  const int64_t blocks = (rows * (COLS / VEC) + THREADS * ITEMS - 1) / (THREADS * ITEMS);
  TORCH_CHECK(blocks <= INT32_MAX, "too many rows: ", rows);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto* op = reinterpret_cast<scalar_t*>(out.data_ptr());
  if constexpr (VEC > 1) {
    if (pack_aligned<scalar_t, VEC>(gate) && pack_aligned<scalar_t, VEC>(up) &&
        pack_aligned<scalar_t, VEC>(op) && gs % VEC == 0 && us % VEC == 0 && os % VEC == 0) {
      gated_act_kernel<THREADS, VEC, ITEMS><<<(unsigned)blocks, THREADS, 0, stream>>>(
          gate, up, op, rows, gs, us, os);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
  }
  // unaligned views (an odd row stride, an offset slice): element by element
  const int64_t scalar_blocks = (rows * COLS + THREADS * ITEMS - 1) / (THREADS * ITEMS);
  TORCH_CHECK(scalar_blocks <= INT32_MAX, "too many rows: ", rows);
  gated_act_kernel<THREADS, 1, ITEMS><<<(unsigned)scalar_blocks, THREADS, 0, stream>>>(
      gate, up, op, rows, gs, us, os);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int THREADS, int VEC, int ITEMS>
static void gated_act(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  TORCH_CHECK(gate.sizes() == out.sizes() && up.sizes() == out.sizes(),
              "gate, up and out must have one shape, got ", gate.sizes(), ", ", up.sizes(),
              " and ", out.sizes());
  TORCH_CHECK(gate.device() == out.device() && up.device() == out.device(),
              "gate, up and out must be on one device");
  const int64_t gs = row_stride(gate, COLS, "gate"), us = row_stride(up, COLS, "up");
  launch<THREADS, VEC, ITEMS>(reinterpret_cast<const scalar_t*>(gate.data_ptr()),
                              reinterpret_cast<const scalar_t*>(up.data_ptr()), out, gs, us);
}

template <int THREADS, int VEC, int ITEMS>
static void gated_act_packed(const at::Tensor& gate_up, const at::Tensor& out) {
  TORCH_CHECK(out.dim() >= 1 && gate_up.dim() == out.dim() &&
              gate_up.device() == out.device() &&
              gate_up.sizes().slice(0, out.dim() - 1) == out.sizes().slice(0, out.dim() - 1),
              "gate_up (..., ", 2 * COLS, ") and out (..., ", COLS, ") must match, got ",
              gate_up.sizes(), " and ", out.sizes());
  const int64_t gs = row_stride(gate_up, 2 * COLS, "gate_up");
  const auto* gate = reinterpret_cast<const scalar_t*>(gate_up.data_ptr());
  launch<THREADS, VEC, ITEMS>(gate, gate + COLS, out, gs, gs);  // chunk(2): two halves
}
"""

_PARAMS = {
    "separate": "(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out)",
    "packed": "(const at::Tensor& gate_up, const at::Tensor& out)",
}
_DECL = {"separate": "(const at::Tensor&, const at::Tensor&, const at::Tensor&);",
         "packed": "(const at::Tensor&, const at::Tensor&);"}
_CALL = {"separate": "gated_act<{t}, {v}, {i}>(gate, up, out);",
         "packed": "gated_act_packed<{t}, {v}, {i}>(gate_up, out);"}


def search_space(case: Case) -> list[dict]:
    """Threads per block x vectors per thread, from small tiles to large. The row count does
    not enter (a flat index covers any), so every case of one width shares one build."""
    vec = vec_width(case["cols"], case["dtype"])
    shapes = sorted(((t, i) for t in THREADS for i in ITEMS), key=lambda s: (s[0] * s[1], s[0]))
    return [{"backend": "cuda", "threads": t, "vec": vec, "items": i} for t, i in shapes]


def function_name(config: dict) -> str:
    return f"gated_act_t{config['threads']}_v{config['vec']}_i{config['items']}"


def cuda_source(case: Case) -> tuple[str, str, tuple[str, ...]]:
    """(CUDA source, C++ declarations, exported names) for every config of the case's space."""
    cols, act, layout = case["cols"], case["act"], case["layout"]
    configs = search_space(case)
    names = tuple(function_name(c) for c in configs)
    defines = [f"#define COLS {cols}", dtype_defines(case["dtype"]), "",
               f"__device__ __forceinline__ float act(float g) {{\n  {_ACT[act]}\n}}"]
    wrappers = [f"void {name}{_PARAMS[layout]} {{\n  "
                + _CALL[layout].format(t=c["threads"], v=c["vec"], i=c["items"]) + "\n}"
                for name, c in zip(names, configs)]
    source = source_text(f"out = {act}(gate) * up, {layout} layout; generated by "
                         "codegen.gated_act.cuda", defines, _KERNEL, wrappers)
    decls = "".join(f"void {name}{_DECL[layout]}\n" for name in names)
    return source, decls, names


_FORWARD = {
    "separate": '''\
        def forward(gate, up, *, out, **params) -> None:
            """gate, up, out: (..., COLS) CUDA tensors of one shape; checked in C++."""
            if params and params != BAKED_PARAMS:
                raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")
            _launch(gate, up, out)
        ''',
    "packed": '''\
        def forward(gate_up, *, out, **params) -> None:
            """gate_up: (..., 2 * COLS), Phi-3's fused projection, read in place; out:
            (..., COLS). Checked in C++."""
            if params and params != BAKED_PARAMS:
                raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")
            _launch(gate_up, out)
        ''',
}


def render(config: dict, case: Case) -> str:
    cols, act, layout = case["cols"], case["act"], case["layout"]
    source, decls, names = cuda_source(case)
    name = function_name(config)
    if name not in names:
        raise ValueError(f"config {config} is not in the compiled space of cols={cols}")
    threads, vec, items = config["threads"], config["vec"], config["items"]
    dtype, n_rows = case["dtype"], case["rows"]
    top = textwrap.dedent(f'''\
        """Gated MLP activation CUDA C++ candidate: out = {act}(gate) * up ({layout} layout).

        In fp32, rounded once to {dtype}. Specialised for cols={cols}; tuned for {n_rows} rows.
        Launch: {threads}-thread blocks, each thread {items} vector(s) of {vec} element(s) per input
        (element by element where the tensors are not aligned to them).
        CUDA_SOURCE holds every config of this case: one compile, cached by codegen.cuda_build.
        This file calls `{name}`.
        config: {json.dumps(config, sort_keys=True)}
        """

        from codegen.cuda_build import load_extension

        COLS = {cols}
        THREADS = {threads}
        VEC = {vec}
        ITEMS = {items}
        KERNEL = "{name}"
        BAKED_PARAMS = {{'act': {act!r}}}
        ''')
    bottom = "_launch = getattr(load_extension(CUDA_SOURCE, CPP_SOURCE, FUNCTIONS), KERNEL)" \
             "\n\n\n" + textwrap.dedent(_FORWARD[layout])
    return "\n".join([top, f"CUDA_SOURCE = {python_string(source)}", "",
                      f"CPP_SOURCE = {python_string(decls)}", "",
                      f"FUNCTIONS = {python_tuple(names)}", "", bottom])
