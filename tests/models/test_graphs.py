"""models/graphs.py: static-cache decode against the ordinary dynamic-cache model (CPU), and the
CUDA-graph capture itself against eager (GPU), including graphs built to be wrong (a stale input
buffer, a position pinned at capture) that the same equality check must reject."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from models import graphs
from models.graphs import (
    CaptureError,
    GraphedPrefill,
    StaticDecoder,
    cache_argument,
    capture_reason,
    host_reads,
    output_cache,
)
from profiling.loader import build, resolve

TINY = ["tiny-llama", "tiny-qwen2"]
PROMPT, STEPS = 8, 4


def close_to(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Max abs difference within `rel` of b's largest magnitude."""
    a, b = a.float(), b.float()
    return bool((a - b).abs().max() <= rel * b.abs().max())


def model_of(name: str, dtype=torch.float32, device: str = "cpu", layers: int | None = None):
    spec = resolve(name)
    if layers is not None:
        spec.config.num_hidden_layers = layers
    return build(spec, dtype, device)


def tokens(model, shape, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, shape, generator=gen).to(device)


def dynamic_run(model, ids, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits of the prefill and of each step through the model's default dynamic cache."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = output_cache(out)
        logits = [out.logits]
        for nxt in steps:
            logits.append(model(nxt, use_cache=True, **{cache_argument(model): cache}).logits)
    return logits


def static_run(decoder: StaticDecoder, ids, steps) -> tuple[list[torch.Tensor], list[int]]:
    logits = [decoder.prefill(ids).clone()]
    positions = [decoder.position]
    for nxt in steps:
        logits.append(decoder.step(nxt).clone())
        positions.append(decoder.position)
    return logits, positions


def all_close(got, want, rel=1e-4) -> bool:
    return all(close_to(g, w, rel) for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    return model_of(request.param)


def _steps(model, batch=2, seed=1):
    return [tokens(model, (batch, 1), seed + i) for i in range(STEPS)]


def test_static_decode_equals_the_dynamic_cache_and_positions_advance(tiny):
    ids, steps = tokens(tiny, (2, PROMPT), 0), _steps(tiny)
    want = dynamic_run(tiny, ids, steps)
    got, positions = static_run(StaticDecoder(tiny, 2, 32, graph=False), ids, steps)
    assert all_close(got, want)
    assert positions == list(range(PROMPT, PROMPT + STEPS + 1))
    assert got[-1].shape == (2, 1, tiny.config.vocab_size)


def test_rewind_then_step_reproduces_the_logits_at_that_length(tiny):
    ids, steps = tokens(tiny, (2, PROMPT), 0), _steps(tiny)
    decoder = StaticDecoder(tiny, 2, 32, graph=False)
    got, _ = static_run(decoder, ids, steps)
    for at in (PROMPT + 1, PROMPT + 3):  # the cache then holds the tokens before `at`
        decoder.rewind(at)
        again = decoder.step(steps[at - PROMPT])
        assert decoder.position == at + 1
        assert close_to(again, got[at - PROMPT + 1], 1e-6)


def test_generate_gives_the_greedy_tokens_of_the_dynamic_cache(tiny):
    ids = tokens(tiny, (2, PROMPT), 3)
    want, token = [], None
    with torch.no_grad():
        out = tiny(ids, use_cache=True)
        cache = output_cache(out)
        for _ in range(6):
            token = out.logits[:, -1:].argmax(-1)
            want.append(token)
            out = tiny(token, use_cache=True, **{cache_argument(tiny): cache})
    got = StaticDecoder(tiny, 2, 32, graph=False).generate(ids, 6)
    assert got.shape == (2, 6)
    assert torch.equal(got, torch.cat(want, dim=1))


class ForgetsToAdvance(StaticDecoder):
    """The bug the equality check must catch: every step runs at the prefill's position."""

    def step(self, next_ids):
        stale = self.position
        logits = super().step(next_ids)
        self._set_position(stale)
        return logits


def test_a_stale_cache_position_fails_the_equality_check(tiny):
    ids, steps = tokens(tiny, (2, PROMPT), 0), _steps(tiny)
    want = dynamic_run(tiny, ids, steps)
    got, positions = static_run(ForgetsToAdvance(tiny, 2, 32, graph=False), ids, steps)
    assert close_to(got[1], want[1], 1e-4)  # the first step is right: the bug shows later
    assert not all_close(got, want)
    assert positions == [PROMPT] * (STEPS + 1)


class SyncsOnHost(nn.Module):
    """A layer whose forward reads a device value on the host (`.item()`)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * (1.0 if x.abs().max().item() >= 0 else 0.0)


def test_the_decode_step_reads_nothing_on_the_host_and_a_sync_is_seen(tiny):
    decoder = StaticDecoder(tiny, 2, 32, graph=False)
    decoder.prefill(tokens(tiny, (2, PROMPT), 0))
    nxt = tokens(tiny, (2, 1), 1)
    assert host_reads(lambda: decoder.step(nxt)) == []
    syncing = model_of("tiny-llama")
    syncing.model.norm = SyncsOnHost(syncing.model.norm)
    ids = tokens(syncing, (1, 4), 0)
    # transformers' own host read (its packed-sequence check) is skipped under capture
    assert "aten::_local_scalar_dense" in host_reads(lambda: tiny(ids, use_cache=False),
                                                     as_captured=False)
    assert host_reads(lambda: tiny(ids, use_cache=False)) == []
    assert host_reads(lambda: syncing(ids, use_cache=False)) == ["aten::_local_scalar_dense"]


def test_misuse_is_a_one_line_error_before_any_index_goes_out_of_bounds():
    model = model_of("tiny-llama")
    decoder = StaticDecoder(model, 1, PROMPT + 1, graph=False)
    with pytest.raises(ValueError, match="before prefill"):
        decoder.step(tokens(model, (1, 1), 0))
    decoder.prefill(tokens(model, (1, PROMPT), 0))
    decoder.step(tokens(model, (1, 1), 1))  # the last slot
    with pytest.raises(ValueError, match="past the cache"):
        decoder.step(tokens(model, (1, 1), 2))
    decoder.rewind(PROMPT)
    with pytest.raises(ValueError, match=r"\[1, 1\] ids"):
        decoder.step(tokens(model, (2, 1), 2))
    with pytest.raises(ValueError, match="do not fit"):
        decoder.generate(tokens(model, (1, PROMPT), 0), 3)


def test_the_static_cache_gets_only_the_arguments_its_constructor_names(monkeypatch):
    import transformers

    seen = {}

    class Old:  # the pre-5 constructor
        def __init__(self, config, max_batch_size, max_cache_len, device=None, dtype=None):
            seen.update(config=config, max_batch_size=max_batch_size,
                        max_cache_len=max_cache_len, device=device, dtype=dtype)

    class New:  # 5.17 and 5.24
        def __init__(self, config, max_cache_len, offloading=False, **kwargs):
            seen.update(config=config, max_cache_len=max_cache_len, kwargs=kwargs)

    monkeypatch.setattr(transformers, "StaticCache", Old)
    graphs.static_cache("cfg", 3, 64, "cpu", torch.float16)
    assert seen == dict(config="cfg", max_batch_size=3, max_cache_len=64, device="cpu",
                        dtype=torch.float16)
    seen.clear()
    monkeypatch.setattr(transformers, "StaticCache", New)
    graphs.static_cache("cfg", 3, 64, "cpu", torch.float16)
    assert seen == dict(config="cfg", max_cache_len=64, kwargs={})


def test_capture_reason_is_one_line_from_the_error_that_started_it():
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\n"
                               "CUDA kernel errors might be asynchronously reported")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture") from None
    except RuntimeError as exc:
        assert capture_reason(exc) == "RuntimeError: CUDA error: operation failed due to a " \
                                      "previous error during capture"  # `from None` cut it
    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        except RuntimeError:
            raise RuntimeError("capture invalidated")  # noqa: B904 - as torch.cuda.graph does
    except RuntimeError as exc:
        assert capture_reason(exc) == "RuntimeError: operation not permitted when stream " \
                                      "is capturing"


def test_capture_on_the_cpu_is_refused_with_a_reason():
    model = model_of("tiny-llama")
    with pytest.raises(CaptureError) as info:
        GraphedPrefill(model, tokens(model, (1, 4), 0))
    assert "CUDA" in info.value.reason and "\n" not in info.value.reason
    decoder = StaticDecoder(model, 1, 16, graph=True)
    decoder.prefill(tokens(model, (1, 4), 0))
    with pytest.raises(CaptureError):
        decoder.step(tokens(model, (1, 1), 1))
    assert decoder.position == 4  # a failed capture leaves the position where it was


def _sdpa_masks(model, ids, monkeypatch, *, capturing: bool, context) -> tuple[list, torch.Tensor]:
    """(attn_mask is None, is_causal) per SDPA call of one prefill, and its logits."""
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, bool(kwargs.get("is_causal"))))
        return sdpa(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        with torch.no_grad(), context():
            logits = model(ids, use_cache=False).logits
    return seen, logits


@pytest.mark.parametrize("tiny", TINY)
def test_a_captured_prefill_gets_the_causal_flag_eager_gets(tiny, monkeypatch):
    """Under stream capture transformers builds an explicit mask (5.17: the packed-sequence
    mask and a refused is_causal shortcut), a slower SDPA path than eager's; GraphedPrefill's
    context gives the capture eager's call: no mask, is_causal, the same logits. A padded or
    offset query keeps transformers' own answer."""
    model = model_of(tiny)
    ids = tokens(model, (2, 8), 0)
    eager, want = _sdpa_masks(model, ids, monkeypatch, capturing=False,
                              context=contextlib.nullcontext)
    captured, got = _sdpa_masks(model, ids, monkeypatch, capturing=True,
                                context=graphs.causal_prefill_mask)
    assert eager and set(eager) == {(True, True)}
    assert captured == eager
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    skip = graphs._causal_skip(lambda *a: "delegated")
    assert skip(None, 8, 8, 0, 0, None) is True
    assert skip(torch.ones(2, 8, dtype=torch.bool), 8, 8, 0, 0, None) == "delegated"
    assert skip(None, 1, 9, torch.tensor(8), 0, None) == "delegated"
    assert skip(None, 8, 8, 0, 0, 4) == "delegated"


# ---- GPU: the capture itself ----------------------------------------------------------------

GPU_MODELS = [("tiny-llama", None), ("llama-3.2-1b", 2)]
BF16 = 1e-2  # graph replay runs eager's kernels; identical in practice, bf16 rounding at worst


@pytest.fixture(scope="module", params=GPU_MODELS, ids=lambda p: p[0])
def gpu_model(request):
    name, layers = request.param
    return model_of(name, torch.bfloat16, "cuda", layers)


def _eager(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.gpu
def test_graphed_prefill_equals_eager_on_fresh_inputs(gpu_model):
    graphed = GraphedPrefill(gpu_model, tokens(gpu_model, (2, 64), 0, "cuda"))
    try:
        assert graphed.pool_bytes > 0
        for seed in (1, 2, 3):
            ids = tokens(gpu_model, (2, 64), seed, "cuda")
            assert graphed.matches(ids)
            assert close_to(graphed(ids), _eager(gpu_model, ids), BF16)
        assert not graphed.matches(tokens(gpu_model, (2, 65), 0, "cuda"))
    finally:
        graphed.close()


@pytest.mark.gpu
def test_a_graph_that_skips_the_input_copy_fails_the_check(gpu_model, monkeypatch):
    graphed = GraphedPrefill(gpu_model, tokens(gpu_model, (1, 32), 0, "cuda"))
    monkeypatch.setattr(GraphedPrefill, "_load", lambda self, ids: None)
    try:
        ids = tokens(gpu_model, (1, 32), 5, "cuda")
        assert not close_to(graphed(ids), _eager(gpu_model, ids), BF16)
    finally:
        graphed.close()


def _decode_pair(model, cls=StaticDecoder):
    ids = tokens(model, (2, 16), 0, "cuda")
    steps = [tokens(model, (2, 1), 10 + i, "cuda") for i in range(STEPS)]
    want, _ = static_run(StaticDecoder(model, 2, 64, graph=False), ids, steps)
    graphed = cls(model, 2, 64, graph=True)
    got, positions = static_run(graphed, ids, steps)
    return got, want, positions, graphed


@pytest.mark.gpu
def test_the_graphed_decode_step_equals_eager_at_successive_positions(gpu_model):
    got, want, positions, graphed = _decode_pair(gpu_model)
    try:
        assert positions == list(range(16, 16 + STEPS + 1))
        assert all_close(got, want, BF16) and graphed.pool_bytes > 0
        graphed.rewind(17)  # replay at an earlier length reproduces that step
        assert close_to(graphed.step(tokens(gpu_model, (2, 1), 11, "cuda")), want[2], BF16)
    finally:
        graphed.close()


class PinnedPosition(StaticDecoder):
    """The capture pitfall: the position set inside the captured call, so every replay runs at
    the position of capture."""

    def _capture_step(self):
        start = self.position

        def pinned():
            self._set_position(start)
            return self._step_forward()

        self._graph, self._logits, pool = graphs.capture_graph(pinned, self._device, 2)
        self._set_position(start)
        self.pool_bytes = pool


@pytest.mark.gpu
def test_a_graph_pinned_to_one_position_fails_the_check(gpu_model):
    got, want, _, graphed = _decode_pair(gpu_model, PinnedPosition)
    try:
        assert close_to(got[1], want[1], BF16)
        assert not all_close(got, want, BF16)
    finally:
        graphed.close()


@pytest.mark.gpu
def test_a_forward_that_syncs_raises_capture_error_naming_the_op():
    model = model_of("tiny-llama", torch.bfloat16, "cuda")
    model.model.norm = SyncsOnHost(model.model.norm)
    with pytest.raises(CaptureError) as info:
        GraphedPrefill(model, tokens(model, (1, 16), 0, "cuda"))
    reason = info.value.reason
    assert "\n" not in reason and "aten::_local_scalar_dense" in reason
    # the process is still usable: eager runs after the failed capture
    assert torch.isfinite(_eager(model, tokens(model, (1, 16), 1, "cuda")).float()).all()


@pytest.mark.gpu
def test_close_gives_the_pool_back():
    model = model_of("tiny-llama", torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    ids = tokens(model, (8, 256), 0, "cuda")
    graphed = GraphedPrefill(model, ids)
    held = torch.cuda.memory_allocated() - base
    assert held >= graphed._logits.nbytes > 0
    graphed.close()
    assert torch.cuda.memory_allocated() - base < graphed_slack(ids)
    decoder = StaticDecoder(model, 2, 128, graph=True)
    decoder.prefill(tokens(model, (2, 16), 0, "cuda"))
    decoder.step(tokens(model, (2, 1), 1, "cuda"))
    assert decoder.pool_bytes > 0 and decoder.cache_bytes > 0
    decoder.close()
    assert torch.cuda.memory_allocated() - base < graphed_slack(ids)


def graphed_slack(ids) -> int:
    """What may stay allocated after close: the test's own input ids and allocator rounding."""
    return ids.nbytes + (1 << 20)


def test_setting_the_position_back_is_one_fill_for_all_layers(tiny):
    decoder = StaticDecoder(tiny, 2, 32, graph=False)
    decoder.prefill(tokens(tiny, (2, PROMPT), 0))
    assert decoder._lengths.tolist() == [PROMPT] * len(decoder.cache.layers)
    decoder.step(tokens(tiny, (2, 1), 1))
    assert decoder._lengths.tolist() == [PROMPT + 1] * len(decoder.cache.layers)
    ops = []

    class Seen(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Seen():
        decoder.rewind(3)
    assert ops == ["fill_"] and decoder._lengths.tolist() == [3] * len(decoder.cache.layers)


def test_static_runner_repeats_the_step_the_dynamic_runner_times(tiny):
    """profiling.capture.make_static_runner: every call writes position `seq` (reset rewinds),
    and its logits are the dynamic-cache runner's step, the same tokens at the same position."""
    from core.workload import Workload
    from profiling.capture import make_runner, make_static_runner

    w = Workload(2, PROMPT, "float32", "cpu", "decode")
    static, dynamic = make_static_runner(tiny, w), make_runner(tiny, w)
    with torch.no_grad():
        first = static.call().clone()
        static.reset()
        again = static.call().clone()
        static.reset()
        want = dynamic.call().logits
    assert torch.equal(first, again)
    assert close_to(first, want, 1e-4)
    with pytest.raises(ValueError, match="decode"):
        make_static_runner(tiny, Workload(2, PROMPT, "float32", "cpu", "prefill"))
