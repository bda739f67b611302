"""A model's forward captured as a CUDA graph: prefill on a static input buffer, decode over a
static KV cache, one step captured once and replayed at successive positions.

How transformers 5.17 and 5.24 step a static cache (read from both releases' sources): the
forward of Llama, Qwen2 and their kin takes no `cache_position` any more. Each `StaticLayer`
keeps its write index on the device, `cumulative_length` (a 0-d int64 tensor), and `update`
writes the new keys and values with `index_copy_` at `arange(n) + cumulative_length`, then
adds n to it in place. When no `position_ids` are passed, the model derives them from
`cache.get_seq_length()`, which for a static layer is that same tensor, and the causal mask's
query offset (`get_query_offset`) is it too, against a key length of `max_cache_len`. For a
one-token query over a compileable cache the mask is always materialised (the sdpa `is_causal`
shortcut is refused), so the step reads no tensor value on the host and is capturable as it
stands: replaying it advances the position on the device. Two consequences:

- the cache's position is whatever `cumulative_length` says, so timing one step repeatedly
  must set it back (`rewind`); without that every call advances it, and past `max_cache_len`
  `index_copy_` indexes out of bounds (on a GPU, a device-side assert);
- slots past the position keep stale keys and values; the mask hides them.

`StaticCache`'s constructor in both releases is `(config, max_cache_len, offloading=False,
offload_only_non_sliding=True, **kwargs)`: no batch size, device or dtype (older releases
took `max_batch_size`/`batch_size`, `device`, `dtype`); the layers allocate on their first
update. `static_cache` passes only the arguments the installed signature names.

Capture follows PyTorch's recipe: warm-up calls on a side stream, then `torch.cuda.graph`, whose
private memory pool holds every intermediate; outputs are static tensors that the next replay
overwrites. Anything that reads a device value on the host inside the captured call (`.item()`,
`bool(tensor)`, `nonzero`) makes capture fail; `CaptureError.reason` then names the op.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that read a device value on the host (or size their output by one): inside capture
# they synchronise a capturing stream, which CUDA refuses
HOST_READS = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select",
              "unique", "_unique2", "repeat_interleave")


class CaptureError(RuntimeError):
    """Capture failed; `.reason` is one line naming the op or cause (e.g. "aten::nonzero
    synchronises the host inside capture")."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def capture_reason(exc: BaseException) -> str:
    """One line from whatever capture raised: the first line of the earliest error in the
    chain (torch.cuda.graph's exit raises "capture invalidated" over the op that broke it)."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    for err in reversed(seen):
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        if lines:
            return f"{type(err).__name__}: {lines[0]}"
    return type(seen[0]).__name__ if seen else "unknown error"


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.ops.append(f"aten::{name}")
        return func(*args, **(kwargs or {}))


def host_reads(fn, *, as_captured: bool = True) -> list[str]:
    """The aten ops in `fn()` that read a device value on the host, in call order (runs it
    once eagerly; on the CPU too, so a test can tell a step is capturable without a GPU).

    as_captured: `torch.cuda.is_current_stream_capturing()` answers True meanwhile, so code
    that backs off under capture does so here too (transformers' `is_tracing` skips its
    packed-sequence check and the sdpa `is_causal` shortcut, both host reads, when capturing)."""
    mode = _HostReads()
    with contextlib.ExitStack() as stack:
        if as_captured:
            stack.enter_context(mock.patch.object(torch.cuda, "is_current_stream_capturing",
                                                  lambda: True))
        stack.enter_context(torch.no_grad())
        stack.enter_context(mode)
        fn()
    return mode.ops


def _explain(exc: BaseException, fn) -> str:
    """The failing op when an eager rerun shows a host read, else the error's own line."""
    try:
        torch.cuda.synchronize()
        ops = host_reads(fn)
    except Exception:  # the rerun is a diagnosis only; the capture's error stands
        ops = []
    if ops:
        return f"{ops[0]} synchronises the host inside capture ({capture_reason(exc)})"
    return capture_reason(exc)


class _HostRead(Exception):
    pass


def capture_graph(fn, device: torch.device, warmup: int):
    """Warm `fn` up on a side stream, capture it; (graph, its output, pool bytes)."""
    if device.type != "cuda":
        raise CaptureError(f"CUDA graphs need a CUDA device; the input is on {device}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.no_grad():
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn()
            torch.cuda.current_stream(device).wait_stream(side)
            torch.cuda.synchronize(device)
        # A capture that fails inside torch.cuda.graph leaves the CUDA generator registered
        # for capture, and every later random op of the process then fails ("Offset increment
        # outside graph capture", seen on the H200): an op that reads the device from the host
        # is found here, eagerly, before any capture starts.
        ops = host_reads(fn)
        if ops:
            raise _HostRead(f"{ops[0]} synchronises the host inside capture")
        with torch.no_grad():
            # torch.cuda.graph empties the allocator's cache on entry: empty it first, so the
            # reserved memory it frees is not subtracted from the pool's
            torch.cuda.empty_cache()
            allocated = torch.cuda.memory_allocated(device)
            reserved = torch.cuda.memory_reserved(device)
            with torch.cuda.graph(graph):
                out = fn()
        torch.cuda.synchronize(device)
    except _HostRead as exc:
        raise CaptureError(str(exc)) from None
    except Exception as exc:
        del graph
        raise CaptureError(_explain(exc, fn)) from exc
    # the pool's segments are reserved, not allocated, once intermediates are freed inside it
    pool = max(torch.cuda.memory_allocated(device) - allocated,
               torch.cuda.memory_reserved(device) - reserved, 0)
    return graph, out, pool


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # the warm-up's side stream got its own cuBLAS workspace (32 MiB on the H200), cached
        # by PyTorch per stream through the allocator: give it back with the graph
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()  # hands the graph pool's segments back to the driver


def _causal_skip(original):
    """transformers' `_ignore_causal_mask_sdpa`, also answering yes under stream capture when
    the answer depends on shapes alone: no padding mask, an empty cache (q_offset 0) and as many
    keys as queries, outside any sliding window."""

    def skip(padding_mask, q_length, kv_length, q_offset=0, kv_offset=0,
             local_attention_size=None, *args, **kwargs):
        if (padding_mask is None and not args and not kwargs and q_length == kv_length
                and not isinstance(q_offset, torch.Tensor) and q_offset == 0
                and (local_attention_size is None or kv_length < local_attention_size)):
            return True
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset,
                        local_attention_size, *args, **kwargs)

    return skip


@contextlib.contextmanager
def causal_prefill_mask():
    """Within: an unpadded prefill from position 0 gets the mask eager gets (none: SDPA's
    `is_causal=True`, its flash path) under stream capture too.

    Why: under capture transformers 5.17 assumes the worst twice, since `is_tracing` counts
    stream capture with torch.export. It keeps the packed-sequence mask it derives from the
    position ids (it cannot check them on the host), and it refuses the `is_causal` shortcut;
    so a captured prefill builds an explicit [s, s] mask, and runs cuDNN's masked attention,
    several times the causal kernel's time, plus the mask's own kernels: the graph comes out
    slower than eager (benchmarks/probes/README.md, `graph_kernels.py`). Both answers
    are right for GraphedPrefill's call, which passes ids alone, so the model's position ids
    are an arange (one sequence per row) and there is no padding: shapes decide, and a graph
    is captured per shape. A no-op where transformers has no such functions."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    with contextlib.ExitStack() as stack:
        original = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
        if original is not None:
            stack.enter_context(mock.patch.object(masking_utils, "_ignore_causal_mask_sdpa",
                                                  _causal_skip(original)))
        if hasattr(masking_utils, "find_packed_sequence_indices"):
            stack.enter_context(mock.patch.object(masking_utils, "find_packed_sequence_indices",
                                                  lambda position_ids: None))
        yield


def _entered(factory):
    """`factory()`, or a context that does nothing where there is none."""
    return contextlib.nullcontext() if factory is None else factory()


class GraphedPrefill:
    """`model(ids, use_cache=False).logits` for one (batch, seq), captured once as a CUDA graph on
    a static input buffer and replayed. Warm-up on a side stream before capture (as PyTorch's
    docs say); raises CaptureError on failure (the caller falls back to eager).

    The logits a call returns are the graph's static output: the next call overwrites them
    (clone to keep them)."""

    def __init__(self, model, example_ids: torch.Tensor, *, warmup: int = 3,
                 capture_context=None):
        self.shape: tuple[int, int] = tuple(example_ids.shape)
        self._device = example_ids.device
        self._model = model
        self._ids = example_ids.clone()
        with _entered(capture_context):
            self._graph, self._logits, pool = capture_graph(self._forward, self._device,
                                                            warmup)
        self.pool_bytes: int = pool + self._ids.nbytes

    def _forward(self) -> torch.Tensor:
        with causal_prefill_mask():
            return self._model(self._ids, use_cache=False).logits

    def _load(self, ids: torch.Tensor) -> None:
        self._ids.copy_(ids)

    def matches(self, ids: torch.Tensor) -> bool:
        """Same shape, dtype and device as captured."""
        return (self._graph is not None and tuple(ids.shape) == self.shape
                and ids.dtype == self._ids.dtype and ids.device == self._device)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.matches(ids):
            raise ValueError(f"graph captured for {self.shape} {self._ids.dtype} on "
                             f"{self._device}; got {tuple(ids.shape)} {ids.dtype} on {ids.device}")
        self._load(ids)
        self._graph.replay()
        return self._logits

    def close(self) -> None:
        """Frees the graph and its pool."""
        self._graph = self._logits = self._ids = self._model = None
        self.pool_bytes = 0
        _release(self._device)


def static_len(seq: int) -> int:
    """Static cache slots for a step at position `seq`: seq + 1 rounded up to 16."""
    return -(-(seq + 1) // 16) * 16


def static_cache(config, batch: int, max_len: int, device, dtype):
    """transformers' StaticCache built with the arguments its installed constructor names."""
    from transformers import StaticCache

    offered = {"config": config, "max_cache_len": max_len, "max_batch_size": batch,
               "batch_size": batch, "device": device, "dtype": dtype}
    params = inspect.signature(StaticCache.__init__).parameters
    return StaticCache(**{k: v for k, v in offered.items() if k in params})


def cache_argument(model) -> str:
    """The forward's cache keyword: `cache`, which transformers 5.2x renamed it to (5.40 drops
    the old name), unless the forward names only `past_key_values` (a release before the
    rename)."""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params and "cache" not in params \
        else "cache"


def output_cache(out):
    """The cache a forward returned: its `cache` field where the output has one (transformers
    5.2x on; reading `past_key_values` there warns, and 5.40 drops it), else
    `past_key_values`."""
    return out.cache if "cache" in getattr(out, "__dataclass_fields__", {}) \
        else out.past_key_values


class StaticDecoder:
    """Decode over a static KV cache (transformers' StaticCache, stepped by its on-device
    position, see the module's doc), so that one decode step can be captured once and replayed
    at successive positions.
    graph=False runs the same steps eagerly (works on the CPU: this is what CPU tests check);
    graph=True captures the one-token step on first use (CUDA only; CaptureError on failure).

    Logits returned by `step` under graph=True are the graph's static output, overwritten by the
    next step. A decode loop of N tokens: `generate(ids, N)`, or `prefill` then `step` with
    each argmax.

    step_model: a module over the same weights to run the steps with (torch.compile of the
    model, say); the prefill stays eager on `model`, so the cache's lazy allocation happens
    outside any compiled region, as transformers asks.

    prefill_model: a module over the same weights to run the prefill with instead of `model`
    (the unpatched model where no kernel serves a prefill: patched forwards would only
    decline there, and a host-bound prefill pays their Python in full).

    capture_context: a context manager factory entered around each capture (warm-up and
    capture; GraphedPrefill takes it too), for launch settings a graph keeps, such as
    programmatic dependent launch (codegen/pdl.py's `enabled`)."""

    def __init__(self, model, batch: int, max_len: int, *, graph: bool, warmup: int = 3,
                 step_model=None, capture_context=None, prefill_model=None):
        param = next(model.parameters())
        self._model = model
        self._prefill_model = model if prefill_model is None else prefill_model
        self._step_model = model if step_model is None else step_model
        self._device = param.device
        self.batch, self.max_len, self.graph, self._warmup = batch, max_len, graph, warmup
        self._capture_context = capture_context
        self.cache = static_cache(model.config, batch, max_len, param.device, param.dtype)
        self._cache_arg = cache_argument(model)
        self._ids = torch.zeros(batch, 1, dtype=torch.long, device=param.device)
        # every layer's position as one element of a single tensor, so that setting it back is
        # one fill, not one per layer (lazy initialisation's `.to(device)` keeps the view)
        self._lengths = torch.zeros(len(self.cache.layers), dtype=torch.long,
                                    device=param.device)
        for i, layer in enumerate(self.cache.layers):
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length = self._lengths[i]
        self._graph = self._logits = None
        self.position: int = 0
        self.pool_bytes: int = 0
        self._filled = False
        # a left-padded batch: its 2D padding mask over every slot and each row's position,
        # static buffers a captured step reads (None for a batch without padding, whose step
        # passes neither, as the profiled step does)
        self._padded = False
        self._mask = self._pos = self._pos0 = None  # allocated once: a graph reads them
        self._prompt_len = 0
        self._captured_padded: bool | None = None
        self._logits_kw = ({"logits_to_keep": 1}
                           if "logits_to_keep" in inspect.signature(model.forward).parameters
                           else {})

    def _forward(self, ids: torch.Tensor, model=None, last_only: bool = False,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        model = self._model if model is None else model
        extra = dict(self._logits_kw) if last_only else {}
        if self._padded:
            extra["attention_mask"] = self._mask
            extra["position_ids"] = self._pos if positions is None else positions
        return model(ids, use_cache=True, **{self._cache_arg: self.cache}, **extra).logits

    def _step_forward(self) -> torch.Tensor:
        return self._forward(self._ids, self._step_model)

    def _load(self, next_ids: torch.Tensor) -> None:
        self._ids.copy_(next_ids)

    def _set_position(self, position: int) -> None:
        lengths = [getattr(layer, "cumulative_length", None) for layer in self.cache.layers]
        if not all(isinstance(t, torch.Tensor) for t in lengths):
            raise RuntimeError("this transformers' StaticLayer keeps no on-device "
                               "`cumulative_length` (5.17 to 5.24 do); cannot step it")
        base, size = self._lengths.data_ptr(), self._lengths.element_size()
        if all(t.data_ptr() == base + i * size for i, t in enumerate(lengths)):
            self._lengths.fill_(position)
        else:  # a layer replaced its counter: set each
            for t in lengths:
                t.fill_(position)
        self.position = position

    def prefill(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Eager; fills positions [0, ids.shape[1]); returns logits (of the last position
        alone with `last_only`, as transformers' generate asks for them).

        attention_mask: [batch, n], 0 on padding (a left-padded batch). Where it holds a 0,
        every later step passes the padding mask over all slots and each row's own position
        (the count of its real tokens so far), as transformers' generate derives them; a
        mask of ones is the same as none."""
        if ids.dim() != 2 or ids.shape[0] != self.batch or not 0 < ids.shape[1] <= self.max_len:
            raise ValueError(f"prefill takes [{self.batch}, n] ids with 0 < n <= {self.max_len}; "
                             f"got {list(ids.shape)}")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(ids.shape):
            raise ValueError(f"attention_mask {list(attention_mask.shape)} does not match the "
                             f"ids {list(ids.shape)}")
        if self._filled:
            self._set_position(0)
        positions = None
        self._padded = attention_mask is not None and not bool(attention_mask.all())
        if self._padded:
            n = ids.shape[1]
            mask = attention_mask.to(device=self._device, dtype=torch.long)
            if self._mask is None:
                self._mask = torch.empty(self.batch, self.max_len, dtype=torch.long,
                                         device=self._device)
                self._pos0 = torch.empty(self.batch, 1, dtype=torch.long, device=self._device)
                self._pos = torch.empty_like(self._pos0)
            # slots past the prompt: ones; the causal mask hides those not yet written
            self._mask.fill_(1)
            self._mask[:, :n] = mask
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            self._pos0.copy_(mask.sum(-1, keepdim=True))
        with torch.no_grad():
            logits = self._forward(ids, self._prefill_model, last_only=last_only,
                                   positions=positions)
        self._filled = True
        self._prompt_len = self.position = ids.shape[1]
        return logits

    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        """One token [batch, 1] at `position` (graph replay when graph=True), position += 1;
        returns logits [batch, 1, vocab]."""
        if not self._filled:
            raise ValueError("step before prefill: the static cache holds nothing yet")
        if self.position >= self.max_len:
            raise ValueError(f"position {self.position} is past the cache's {self.max_len} slots")
        if tuple(next_ids.shape) != (self.batch, 1):
            raise ValueError(f"step takes [{self.batch}, 1] ids; got {list(next_ids.shape)}")
        self._load(next_ids)
        if self._padded:  # each row's position: its real tokens so far
            torch.add(self._pos0, self.position - self._prompt_len, out=self._pos)
        if not self.graph:
            with torch.no_grad():
                logits = self._step_forward()
        else:
            if self._graph is None or self._captured_padded != self._padded:
                self._graph = self._logits = None
                self._capture_step()
                self._captured_padded = self._padded
            self._graph.replay()
            logits = self._logits
        self.position += 1
        return logits

    def _capture_step(self) -> None:
        start = self.position

        def from_start():
            # each warm-up call writes slot `start` and advances the device position: set it
            # back, so warm-up leaves the cache as it found it; the captured call is the bare
            # step (a fill_ captured with it would pin every replay to `start`)
            if not torch.cuda.is_current_stream_capturing():
                self._set_position(start)
            return self._step_forward()

        try:
            with _entered(self._capture_context):
                graph, logits, pool = capture_graph(from_start, self._device, self._warmup)
        finally:
            self._set_position(start)
        self._graph, self._logits = graph, logits
        self.pool_bytes = pool + self._ids.nbytes

    @property
    def cache_bytes(self) -> int:
        """Device memory of the static keys and values (allocated by the prefill)."""
        return sum(t.nbytes for layer in self.cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                   if isinstance(t, torch.Tensor))

    def rewind(self, position: int) -> None:
        """Later steps overwrite from `position` (for timing one step repeatedly at the same
        cache length)."""
        if not self._filled or not 0 <= position < self.max_len:
            raise ValueError(f"rewind to {position}: needs a prefilled cache and "
                             f"0 <= position < {self.max_len}")
        self._set_position(position)

    def generate(self, ids: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """Greedy loop: prefill then steps; returns the n_tokens new token ids [batch, n_tokens]
        (the first from the prefill's last logits, each later one from a step fed the one
        before, so n_tokens - 1 steps)."""
        if n_tokens < 1 or ids.shape[1] + n_tokens - 1 > self.max_len:
            raise ValueError(f"{n_tokens} new tokens after {ids.shape[1]} do not fit "
                             f"{self.max_len} cache slots")
        token = self.prefill(ids)[:, -1:].argmax(-1)
        out = [token]
        for _ in range(n_tokens - 1):
            token = self.step(token)[:, -1:].argmax(-1)
            out.append(token)
        return torch.cat(out, dim=1)

    def close(self) -> None:
        self._graph = self._logits = self._ids = self._model = self._step_model = None
        self._mask = self._pos = self._pos0 = None
        self.cache = None
        self.pool_bytes = 0
        _release(self._device)
