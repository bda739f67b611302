"""The direct launcher of generated candidates: same results as the JIT on every call, a new
compiled kernel for each Triton specialisation (tensor alignment, scalar values), and the JIT
alone under the CPU interpreter."""

from __future__ import annotations

import pytest
import torch
from family_checks import DEVICE, assert_close, load_rendered, poison

from codegen.rmsnorm import FAMILY as RMSNORM
from codegen.rope import FAMILY as ROPE

TOL = {"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}



def _launch_of(forward):
    return forward.__globals__["_launch"]


def _rmsnorm_case(rows, dtype):
    return {"rows": rows, "hidden": 96, "dtype": dtype, "eps": 1e-6, "offset": 0.0,
            "cast_first": True}


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.gpu)])
def test_repeated_calls_match_the_reference(dtype, tmp_path):
    """The first call compiles through the JIT, later ones launch directly (on a GPU): each
    must write the right answer, including a call on a tensor that is not 16-byte aligned."""
    case = _rmsnorm_case(5, dtype)
    forward = load_rendered(RMSNORM, RMSNORM.search_space(case)[0], case, tmp_path)
    params = RMSNORM.params(case)
    gen = torch.Generator(DEVICE).manual_seed(0)
    for _ in range(3):
        x, w = RMSNORM.make_inputs(case, DEVICE, gen)
        out = RMSNORM.make_out(case, (x, w))
        poison((out,))
        forward(x, w, out=out, **params)
        assert_close(out, RMSNORM.reference(x, w, **params), TOL[dtype])
    # an input starting one element into a buffer: another alignment, so another kernel
    big, w = RMSNORM.make_inputs(_rmsnorm_case(6, dtype), DEVICE, gen)
    x = big.view(-1)[1:1 + 5 * 96].view(5, 96)
    out = torch.empty_like(x)
    forward(x, w, out=out, **params)
    assert_close(out, RMSNORM.reference(x, w, **params), TOL[dtype])
    compiled = getattr(_launch_of(forward), "compiled", None)
    if DEVICE == "cuda":
        assert compiled is not None and len(compiled) == 2
    else:
        assert compiled is None  # the interpreter has no compiled kernel to keep


@pytest.mark.gpu
def test_rope_direct_launch_on_hf_strided_views(tmp_path):
    case = {"batch": 2, "seq": 7, "heads": 4, "kv_heads": 2, "head_dim": 32, "rot_dim": 32,
            "cos_batch": 1, "dtype": "bfloat16"}
    space = ROPE.search_space(case)
    forward = load_rendered(ROPE, space[len(space) // 2], case, tmp_path)
    gen = torch.Generator(DEVICE).manual_seed(1)
    for _ in range(3):
        q, k, cos, sin = ROPE.make_inputs(case, DEVICE, gen)
        out = ROPE.make_out(case, (q, k))
        poison(out)
        forward(q, k, cos, sin, out=out)
        assert_close(out, ROPE.reference(q, k, cos, sin), TOL["bfloat16"])
    assert len(_launch_of(forward).compiled) == 1


def test_spec_key_separates_what_triton_compiles_differently():
    """Same key only where Triton would reuse its compiled kernel: tensors by dtype and
    alignment (passed on as addresses), integers by their specialisation class, not value."""
    from codegen.launch import spec_key

    buf = torch.zeros(64)
    key, values = spec_key((buf, 7, 32, 1, 2.5))
    assert values == [buf.data_ptr(), 7, 32, 1, 2.5]
    assert spec_key((buf, 9, 48, 1, 2.5))[0] == key  # other odd / 16-divisible ints: same
    assert spec_key((buf[1:], 7, 32, 1, 2.5))[0] != key  # 4 bytes in: not 16-byte aligned
    assert spec_key((buf.half(), 7, 32, 1, 2.5))[0] != key
    for other in ((buf, 1, 32, 1, 2.5), (buf, 7, 33, 1, 2.5), (buf, 7, 32, 2, 2.5),
                  (buf, 7, 2**31, 1, 2.5), (buf, 7, 32, 1, 3.5)):
        assert spec_key(other)[0] != key, other


def test_empty_hook_chains_are_not_passed_to_the_launcher():
    """Triton keeps its launch hooks in chains that are never None; an empty one is passed on
    as None (no Python call per launch, no launch metadata), a chain with a hook as itself."""
    pytest.importorskip("triton.knobs")
    from triton import knobs

    from codegen.launch import launch_hooks

    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "calls"):
        pytest.skip("this Triton keeps a plain hook, not a chain")
    assert not chain.calls and launch_hooks()[0] is None

    def hook(metadata):
        return None

    chain.add(hook)
    try:
        assert launch_hooks()[0] is chain
    finally:
        chain.remove(hook)
    assert launch_hooks()[0] is None


def test_the_c_launch_shortcut_only_takes_a_launcher_it_knows():
    """Triton 3.6's launcher object: (grid, stream, function, *args). Any other shape (a newer
    Triton's signature, profiling scratch, scratch of unknown size) keeps `k.run`."""
    from codegen.launch import _c_launch

    calls = []

    class Launcher36:
        launch_cooperative_grid, launch_pdl = False, True
        global_scratch_size, profile_scratch_size = 0, 0

        def __init__(self):
            self.launch = lambda *a: calls.append(a)

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            raise AssertionError("the shortcut goes around this")

    class Kernel:
        run = Launcher36()

    go = _c_launch(Kernel())
    go(4, 1, 1, "stream", "fn", "packed", None, None, None, 11, 22)
    assert calls == [(4, 1, 1, "stream", "fn", False, True, None, None, "packed", None, None,
                      None, 11, 22)]

    class ProfileScratch(Launcher36):
        profile_scratch_size = 64

    class ScratchOfUnknownSize(Launcher36):  # no num_ctas: the buffer size is not known
        global_scratch_size, global_scratch_align = 128, 128

    class Launcher39(Launcher36):
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata,
                     launch_metadata, launch_enter_hook, launch_exit_hook, *args):
            raise AssertionError

    for launcher_cls in (ProfileScratch, ScratchOfUnknownSize, Launcher39):
        class K:
            run = launcher_cls()
        assert _c_launch(K()) is None


def test_global_scratch_is_one_buffer_per_stream_kept_and_grown(monkeypatch):
    """The TMA GEMM's descriptors live in global scratch: Triton's `k.run` allocates it per
    launch (programs x CTAs x bytes per program); the shortcut keeps one buffer per stream,
    grows it when a launch needs more, and hands a graph capture to `k.run`."""
    import torch

    from codegen import launch as ln

    made, calls, via_run = [], [], []
    monkeypatch.setattr(ln, "_torch_alloc",
                        lambda n, align, stream: made.append(n) or torch.empty(n, dtype=torch.int8))
    capturing = [False]
    monkeypatch.setattr(ln, "_capturing", lambda: capturing[0])

    class Launcher36:
        launch_cooperative_grid, launch_pdl = False, False
        global_scratch_size, global_scratch_align, profile_scratch_size = 128, 128, 0
        num_ctas = 2

        def __init__(self):
            self.launch = lambda *a: calls.append(a)

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            via_run.append((gridX, stream))

    class Kernel:
        run = Launcher36()

    go = ln._c_launch(Kernel())
    go(4, 1, 1, "s0", "fn", "packed", None, None, None, 11)
    go(3, 1, 1, "s0", "fn", "packed", None, None, None, 11)  # fits: reused
    go(4, 1, 1, "s1", "fn", "packed", None, None, None, 11)  # another stream: its own
    go(8, 1, 1, "s0", "fn", "packed", None, None, None, 11)  # more programs: grown
    assert made == [4 * 2 * 128, 4 * 2 * 128, 8 * 2 * 128]
    scratch = [c[7] for c in calls]
    assert scratch[0] is scratch[1] and scratch[2] is not scratch[0]
    assert scratch[3].numel() == 8 * 2 * 128 and go.buffers["s0"] is scratch[3]
    assert all(c[8] is None and c[9] == "packed" and c[-1] == 11 for c in calls)
    capturing[0] = True
    go(4, 1, 1, "s0", "fn", "packed", None, None, None, 11)
    assert via_run == [(4, "s0")] and len(calls) == 4

    class AlignedWider(Launcher36):
        global_scratch_align = 1024  # more than the caching allocator promises

    class K:
        run = AlignedWider()
    assert ln._c_launch(K()) is None


def test_ensure_allocator_sets_one_per_thread_and_keeps_a_users():
    """Triton keeps its allocator in a context variable: a thread that never set one has none,
    so the TMA kernel's forward calls ensure_allocator before every launch. One already set
    (the user's) is left alone."""
    import threading

    import triton
    from triton.runtime import _allocation

    from codegen.launch import ensure_allocator

    seen = {}

    def in_thread():
        seen["before"] = _allocation._allocator.get()
        ensure_allocator()
        seen["after"] = _allocation._allocator.get()
        mine = lambda size, alignment, stream: None  # noqa: E731 - a user's allocator
        triton.set_allocator(mine)
        ensure_allocator()
        seen["kept"] = _allocation._allocator.get() is mine or getattr(
            _allocation._allocator.get(), "fn", None) is mine

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert isinstance(seen["before"], _allocation.NullAllocator)
    assert not isinstance(seen["after"], _allocation.NullAllocator)
    assert seen["kept"]


def test_repeat_calls_launch_by_exact_key_and_anything_else_goes_through_spec_key(monkeypatch):
    """After a kernel is compiled, calls with the same scalars, dtypes, device kind and address
    alignment launch it without `spec_key`; another alignment or scalar value, a CPU tensor or
    a non-tensor where a tensor was each miss that key and are decided as before."""
    from codegen import launch as ln

    jit, launched, keyed, full = [], [], [], []

    class Compiled:
        packed_metadata, function = "packed", "fn"

        def __init__(self, n):
            self.n = n
            self.run = lambda *a: full.append(a) or launched.append((self.n, a[9:]))

    class Kernel:
        device_caches = {}

        @staticmethod
        def fn(x_ptr, n, BLOCK):
            pass

        def __getitem__(self, grid):
            return lambda *args, **kw: jit.append(args) or Compiled(len(jit))

    class Tensor:
        dtype = "bf16"

        def __init__(self, ptr, is_cuda=True):
            self.ptr, self.is_cuda = ptr, is_cuda

        def data_ptr(self):
            return self.ptr

    real_spec_key = ln.spec_key
    monkeypatch.setattr(ln, "spec_key", lambda args: keyed.append(1) or real_spec_key(args))
    monkeypatch.setattr(ln, "_direct_parts", lambda: (lambda: 0, lambda device: "stream"))
    monkeypatch.setattr(ln, "_c_launch", lambda k: None)
    monkeypatch.setattr(ln, "launch_hooks", lambda: (None, None))
    go = ln.launcher(Kernel(), BLOCK=4)
    go((2,), Tensor(256), 5)  # compiles
    go((2,), Tensor(512), 7)  # the same specialisation: found through spec_key, filed exactly
    go((2,), Tensor(512), 7)  # exact
    go((2,), Tensor(1024), 7)  # exact
    assert len(jit) == 1 and len(keyed) == 2
    assert launched == [(1, (512, 7, 4)), (1, (512, 7, 4)), (1, (1024, 7, 4))]
    # grid, stream, function, metadata, no hooks, then the values: as Triton's k.run takes them
    assert full[0] == full[1] == (2, 1, 1, "stream", "fn", "packed", None, None, None, 512, 7, 4)
    go((2,), Tensor(520), 7)  # 8 bytes in: Triton compiles another kernel
    go((2,), Tensor(512), 9)  # same class as 7, another value: found through spec_key
    go((2,), Tensor(512), 9)  # and filed: exact
    go((2,), Tensor(512, is_cuda=False), 7)
    assert len(jit) == 3 and len(keyed) == 5
    assert launched[-2:] == [(1, (512, 9, 4)), (1, (512, 9, 4))]
    go((2,), 3, 7)  # not a tensor where one was: the JIT decides (here: compiles)
    assert len(jit) == 4 and len(launched) == 5
