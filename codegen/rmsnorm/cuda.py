"""CUDA C++ RMSNorm: each row held in registers by a group of threads, read once, written once.

A block of THREADS_PER_ROW * ROWS_PER_BLOCK threads normalises ROWS_PER_BLOCK rows; each thread
keeps its VEC-element vectors of the row in fp32 registers between the sum of squares (warp
shuffles, then shared memory across the warps of a row) and the scaled store. Narrow rows use
fewer threads per row and more rows per block so that no warp idles.

The CUDA source is specialised to the case's width, dtype and form and holds every config of the
width's space as a template instantiation; the rendered candidates of a case share it
byte for byte (one compile: codegen/cuda_build.py) and differ only in the function they call.
"""

from __future__ import annotations

import json
import textwrap

from codegen.cuda_build import dtype_defines, python_string, python_tuple, source_text, vec_width
from codegen.rmsnorm.reference import params
from codegen.search import spread
from core.family import Case

THREADS_PER_ROW = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ROWS_PER_BLOCK = (1, 2, 4, 8, 16, 32)
# fp32 values of a row one thread holds: more spills registers (the row is read only once).
MAX_PER_THREAD = 32
MAX_CONFIGS = 12

_KERNEL = r"""
template <int TPR, int ROWS, int VEC, typename w_t>
__global__ void __launch_bounds__(TPR * ROWS)
rms_norm_kernel(const scalar_t* __restrict__ x, const w_t* __restrict__ w,
                scalar_t* __restrict__ out, int64_t n_rows, int64_t x_stride,
                int64_t out_stride, float eps) {
  // whole warps: the shuffles below name all 32 lanes
  static_assert(HIDDEN % VEC == 0 && (TPR * ROWS) % 32 == 0, "launch shape");
  constexpr int CHUNKS = HIDDEN / VEC;                // vectors per row
  constexpr int ITEMS = (CHUNKS + TPR - 1) / TPR;     // vectors per thread
  using P = Pack<scalar_t, VEC>;
  using PW = Pack<w_t, VEC>;
  const int lane = threadIdx.x % TPR;
  const int sub = threadIdx.x / TPR;
  // int64: row * stride passes 2**31 at a few million tokens of a wide model
  const int64_t row = (int64_t)blockIdx.x * ROWS + sub;
  const bool live = row < n_rows;  // dead rows still take part in the block's reduction

  float v[ITEMS][VEC];
  float sumsq = 0.0f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = lane + i * TPR;  // consecutive lanes, consecutive vectors: coalesced
    if (live && c < CHUNKS) {
      const P p = reinterpret_cast<const P*>(x + row * x_stride)[c];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        v[i][k] = to_float(p.v[k]);
        sumsq += v[i][k] * v[i][k];
      }
    }
  }
  // the row's TPR threads are aligned lanes of one warp, or whole warps of the block
#pragma unroll
  for (int o = (TPR < 32 ? TPR : 32) / 2; o > 0; o /= 2)
    sumsq += __shfl_xor_sync(0xffffffffu, sumsq, o);
  if constexpr (TPR > 32) {
    constexpr int WARPS = TPR / 32;
    __shared__ float partial[ROWS][WARPS];
    if (lane % 32 == 0) partial[sub][lane / 32] = sumsq;
    __syncthreads();
    sumsq = 0.0f;
#pragma unroll
    for (int k = 0; k < WARPS; ++k) sumsq += partial[sub][k];
  }
  const float rstd = rsqrtf(sumsq / (float)HIDDEN + eps);

#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = lane + i * TPR;
    if (live && c < CHUNKS) {
      const PW wp = reinterpret_cast<const PW*>(w)[c];
      P o;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float n = v[i][k] * rstd;
#if CAST_FIRST
        o.v[k] = from_float<scalar_t>(SCALE(wp.v[k]) * to_float(from_float<scalar_t>(n)));
#else
        o.v[k] = from_float<scalar_t>(n * SCALE(wp.v[k]));
#endif
      }
      reinterpret_cast<P*>(out + row * out_stride)[c] = o;
    }
  }
}

template <int TPR, int ROWS, int VEC, typename w_t>
static void launch(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out, float eps,
                   dim3 grid, cudaStream_t stream) {
  const auto* xp = reinterpret_cast<const scalar_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const w_t*>(w.data_ptr());
  auto* op = reinterpret_cast<scalar_t*>(out.data_ptr());
  const int64_t rows = x.size(0), xs = x.stride(0), os = out.stride(0);
  if constexpr (VEC > 1) {
    if (pack_aligned<scalar_t, VEC>(xp) && pack_aligned<scalar_t, VEC>(op) &&
        pack_aligned<w_t, VEC>(wp) && xs % VEC == 0 && os % VEC == 0) {
      rms_norm_kernel<TPR, ROWS, VEC, w_t><<<grid, TPR * ROWS, 0, stream>>>(
          xp, wp, op, rows, xs, os, eps);
      return;
    }
  }
  // unaligned views (an odd row stride, an offset slice): the same shape, element by element
  rms_norm_kernel<TPR, ROWS, 1, w_t><<<grid, TPR * ROWS, 0, stream>>>(
      xp, wp, op, rows, xs, os, eps);
}

template <int TPR, int ROWS, int VEC>
static void rms_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out,
                     double eps) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.size(1) == HIDDEN && x.stride(1) == 1 &&
              x.scalar_type() == SCALAR_TYPE,
              "x must be a CUDA ", SCALAR_TYPE, " (rows, ", HIDDEN, ") tensor with unit "
              "column stride, got ", x.scalar_type(), " ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(out.device() == x.device() && out.sizes() == x.sizes() && out.stride(1) == 1 &&
              out.scalar_type() == SCALAR_TYPE, "out must be like x, got ", out.scalar_type(),
              " ", out.sizes(), " strides ", out.strides());
  TORCH_CHECK(w.device() == x.device() && w.numel() == HIDDEN && w.is_contiguous(),
              "weight must be a contiguous (", HIDDEN, ",) tensor on x's device");
  const int64_t blocks = (x.size(0) + ROWS - 1) / ROWS;
  TORCH_CHECK(blocks <= INT32_MAX, "too many rows: ", x.size(0));
  if (blocks == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid((unsigned)blocks);
  if (w.scalar_type() == SCALAR_TYPE) {
    launch<TPR, ROWS, VEC, scalar_t>(x, w, out, (float)eps, grid, stream);
#if WEIGHT_FP32
  } else if (w.scalar_type() == at::kFloat) {  // Gemma form: an fp32 weight is allowed
    launch<TPR, ROWS, VEC, float>(x, w, out, (float)eps, grid, stream);
#endif
  } else {
    TORCH_CHECK(false, "unsupported weight dtype ", w.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""

_PARAMS = "(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out, double eps)"
_DECL = "(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);"


def full_space(hidden: int, dtype: str) -> list[dict]:
    """Every launch shape compiled for this width and dtype, independent of the row count, so
    all cases of one width share one build. Threads per row are kept where each holds at most
    MAX_PER_THREAD values and at least half of them have work; blocks are 64 to 512 threads
    (1024 when one row takes them all); listed from small blocks to large."""
    vec = vec_width(hidden, dtype)
    chunks = hidden // vec
    shapes = []
    for tpr in THREADS_PER_ROW:
        items = -(-chunks // tpr)
        if items * vec > MAX_PER_THREAD or 2 * chunks < tpr * items:
            continue
        shapes += [(tpr, rows) for rows in ROWS_PER_BLOCK
                   if 64 <= tpr * rows <= max(512, tpr)]
    if not shapes:
        # very wide rows (registers spill) or very narrow ones: one block per row, or one warp
        # of narrow rows
        tpr = 1024 if chunks > 1024 else 32
        shapes = [(tpr, 1)]
    shapes.sort(key=lambda s: (s[0] * s[1], s[0]))
    configs = [{"backend": "cuda", "threads_per_row": tpr, "rows_per_block": rows, "vec": vec}
               for tpr, rows in shapes]
    return spread(configs, MAX_CONFIGS)


def search_space(case: Case) -> list[dict]:
    """The compiled shapes that fit the case's row count (a block of more rows than the case
    has would idle); the smallest one when none does."""
    configs = full_space(case["hidden"], case["dtype"])
    fitting = [c for c in configs if c["rows_per_block"] <= case["rows"]]
    return fitting or [min(configs, key=lambda c: c["rows_per_block"])]


def function_name(config: dict) -> str:
    return (f"rms_norm_tpr{config['threads_per_row']}_r{config['rows_per_block']}"
            f"_v{config['vec']}")


def _scale_expr(offset: float, cast_first: bool) -> str:
    """The weight factor in fp32, rounded where the reference rounds it: Llama adds the offset
    in the weight's dtype (`offset + weight`), Gemma in fp32 (`offset + weight.float()`)."""
    if offset == 0.0:
        return "(to_float(w))"
    if cast_first:
        return f"(to_float(from_float<w_t>({offset!r}f + to_float(w))))"
    return f"({offset!r}f + to_float(w))"


def cuda_source(case: Case) -> tuple[str, str, tuple[str, ...]]:
    """(CUDA source, C++ declarations, exported names) for every config of the case's width."""
    hidden, dtype = case["hidden"], case["dtype"]
    baked = params(case)
    offset, cast_first = baked["offset"], baked["cast_first"]
    form = "Llama: round the normalised row, then times weight" if cast_first else \
        "Gemma: times (offset + weight) in fp32, then round"
    configs = full_space(hidden, dtype)
    names = tuple(function_name(c) for c in configs)
    defines = [f"#define HIDDEN {hidden}", dtype_defines(dtype),
               f"#define CAST_FIRST {int(cast_first)}",
               f"#define SCALE(w) {_scale_expr(offset, cast_first)}",
               # Gemma multiplies by weight.float(): an fp32 weight beside half activations
               f"#define WEIGHT_FP32 {int(not cast_first and dtype != 'float32')}"]
    wrappers = [f"void {name}{_PARAMS} {{\n  rms_norm<{c['threads_per_row']}, "
                f"{c['rows_per_block']}, {c['vec']}>(x, w, out, eps);\n}}"
                for name, c in zip(names, configs)]
    source = source_text(f"RMSNorm, {form}; generated by codegen.rmsnorm.cuda", defines,
                         _KERNEL, wrappers)
    decls = "".join(f"void {name}{_DECL}\n" for name in names)
    return source, decls, names


def render(config: dict, case: Case) -> str:
    hidden, dtype = case["hidden"], case["dtype"]
    baked = params(case)
    source, decls, names = cuda_source(case)
    name = function_name(config)
    if name not in names:
        raise ValueError(f"config {config} is not in the compiled space of hidden={hidden}")
    tpr, rows, vec = config["threads_per_row"], config["rows_per_block"], config["vec"]
    per_thread = -(-hidden // (tpr * vec)) * vec
    eps, n_rows = baked["eps"], case["rows"]
    form = "Llama (cast, then weight)" if baked["cast_first"] else "Gemma (weight, then cast)"
    top = textwrap.dedent(f'''\
        """RMSNorm CUDA C++ candidate, {form} form, offset {baked["offset"]}.

        Specialised for hidden={hidden}, dtype={dtype}, eps={eps!r}; tuned for {n_rows} rows.
        Launch: {tpr} threads per row x {rows} rows per block ({tpr * rows} threads), {vec}-element
        vectors (element by element where the tensors are not aligned to them), up to
        {per_thread} values of a row per thread, in registers.
        CUDA_SOURCE holds every config of this width: one compile, cached by codegen.cuda_build.
        This file calls `{name}`.
        config: {json.dumps(config, sort_keys=True)}
        """

        from codegen.cuda_build import load_extension

        HIDDEN = {hidden}
        THREADS_PER_ROW = {tpr}
        ROWS_PER_BLOCK = {rows}
        THREADS = {tpr * rows}
        VEC = {vec}
        KERNEL = "{name}"
        EPS = {baked["eps"]!r}
        BAKED_PARAMS = {baked!r}
        ''')
    bottom = textwrap.dedent('''\
        _launch = getattr(load_extension(CUDA_SOURCE, CPP_SOURCE, FUNCTIONS), KERNEL)


        def forward(x, weight, *, out, **params):
            """x, out: (rows, HIDDEN) CUDA tensors with unit column stride; weight: (HIDDEN,).
            Shapes, dtypes and devices are checked in C++: no Python work per call but this."""
            if params and params != BAKED_PARAMS:
                raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")
            _launch(x, weight, out, EPS)
        ''')
    return "\n".join([top, f"CUDA_SOURCE = {python_string(source)}", "",
                      f"CPP_SOURCE = {python_string(decls)}", "",
                      f"FUNCTIONS = {python_tuple(names)}", "", bottom])
