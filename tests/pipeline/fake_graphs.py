"""Fakes of models.graphs with its interface, for CPU tests: the "graph" runs the model eagerly
on its static input buffer (what a correct replay computes); `Stale*` variants read a stale
input or position, as a wrong capture would; `Failing*` raise a CaptureError."""

from __future__ import annotations

import types

import torch

from models.graphs import cache_argument, output_cache


class CaptureError(RuntimeError):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def capture_reason(exc) -> str:
    return getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"


def _capture(context) -> bool:
    """Enter the capture context as the real capture does; whether it turned something on."""
    if context is None:
        return False
    with context() as on:
        return bool(on)


class GraphedPrefill:
    def __init__(self, model, example_ids, *, warmup=3, capture_context=None):
        self.pdl = _capture(capture_context)
        self.model, self.shape = model, tuple(example_ids.shape)
        self.static = example_ids.clone()
        with torch.no_grad():
            self.out = model(self.static, use_cache=False).logits.clone()
        self.pool_bytes = self.out.numel() * self.out.element_size()
        self.closed = False

    def matches(self, ids) -> bool:
        return tuple(ids.shape) == self.shape and ids.dtype == self.static.dtype

    def __call__(self, ids):
        self.static.copy_(ids)
        with torch.no_grad():
            self.out.copy_(self.model(self.static, use_cache=False).logits)
        return self.out

    def close(self):
        self.closed = True


class StalePrefill(GraphedPrefill):
    """Replays what it captured: ignores the input copied into its buffer."""

    def __call__(self, ids):
        return self.out


class FailingPrefill(GraphedPrefill):
    def __init__(self, model, example_ids, *, warmup=3, capture_context=None):
        raise CaptureError("aten::nonzero synchronises the host during capture")


class ThirdFails(GraphedPrefill):
    """Captures the first two graphs (the kept set's, the unpatched one) and fails the third
    (the integrable set's, captured last)."""

    made = 0

    def __init__(self, model, example_ids, *, warmup=3, capture_context=None):
        type(self).made += 1
        if type(self).made == 3:
            raise CaptureError("aten::item synchronises the host during capture")
        super().__init__(model, example_ids, warmup=warmup, capture_context=capture_context)


class StaticDecoder:
    """Eager decode over a dynamic cache cropped on rewind: positions as a static one."""

    def __init__(self, model, batch, max_len, *, graph: bool, capture_context=None,
                 prefill_model=None):
        self.pdl = _capture(capture_context)
        self.model, self.batch, self.max_len, self.graph = model, batch, max_len, graph
        self.prefill_model = model if prefill_model is None else prefill_model
        self.position, self.pool_bytes, self.cache, self.closed = 0, 4096 if graph else 0, \
            None, False

    def prefill(self, ids):
        with torch.no_grad():
            out = self.prefill_model(ids, use_cache=True)
        self.cache = output_cache(out)
        self.position = ids.shape[1]
        return out.logits

    def step(self, next_ids):
        if self.position >= self.max_len:
            raise ValueError("static cache full")
        with torch.no_grad():
            out = self.model(next_ids, use_cache=True, **{cache_argument(self.model): self.cache})
        self.position += 1
        return out.logits[:, -1:]

    def rewind(self, position):
        extra = self.cache.get_seq_length() - position
        if extra > 0:
            self.cache.crop(-extra)
        self.position = position

    def generate(self, ids, n_tokens):
        logits = self.prefill(ids)[:, -1:]
        new = []
        for _ in range(n_tokens):
            nxt = logits.argmax(-1)
            new.append(nxt)
            logits = self.step(nxt)
        return torch.cat(new, dim=1)

    def close(self):
        self.closed = True


class StaleDecoder(StaticDecoder):
    """A graphed step that always writes and reads at the prompt's position."""

    def prefill(self, ids):
        self.start = ids.shape[1]
        return super().prefill(ids)

    def step(self, next_ids):
        if self.graph:
            StaticDecoder.rewind(self, self.start)
        return super().step(next_ids)


def module(prefill=GraphedPrefill, decoder=StaticDecoder) -> types.ModuleType:
    m = types.ModuleType("models.graphs")
    m.CaptureError, m.capture_reason = CaptureError, capture_reason
    m.GraphedPrefill, m.StaticDecoder = prefill, decoder
    m.cache_argument, m.output_cache = cache_argument, output_cache  # the profile's runner
    return m
