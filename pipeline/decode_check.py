"""The whole-model check of a decode workload: it decodes, as a user's `generate` does.

One token with no cache (what the check ran before) attends over one slot: a decode attention
kernel that drops the softmax scale, attends one slot past the cache's length or applies the
first sequence's mask to the whole batch is exact there. Here each prompt is prefilled and then
decoded STEPS tokens over every path a decode step takes in a model:

    dynamic         HF's DynamicCache (what the profile times; no mask reaches attention)
    static          a StaticCache, eager (models.graphs.StaticDecoder): a mask over all its
                    slots and the length on the device, stale slots past it
    static_graphed  the same step captured as a CUDA graph and replayed (on a GPU)
    padded          a left-padded batch of different lengths over the dynamic cache: a 2-D
                    attention mask and each sequence's own positions, as generate passes them
    padded_static   the same batch over a static cache

The patched model and the unpatched one run each path on the same tokens; every step's logits
(the prefill's last position, then each step's) are compared with the fp32 reference model's,
decoded over a dynamic cache on the same tokens (the same padding where padded), under the
whole-model rule (pipeline.integrate: the patched error at most ERROR_RATIO times the unpatched
model's on that path and step).
"""

from __future__ import annotations

import torch

STEPS = 3
# prompts decoded: the second shares the first's prefix (pipeline.integrate's
# shared_prefix_prompts), which is what a cache across calls needs to show
PROMPTS = 2
PATHS = ("dynamic", "static", "static_graphed", "padded", "padded_static")


def left_pads(batch: int, seq: int) -> list[int]:
    """Each sequence's left padding: none for the first, up to half the prompt for the last,
    so the sequences differ in length and in mask (one sequence: a quarter of its prompt)."""
    if batch == 1:
        return [seq // 4]
    return [round(i * (seq // 2) / (batch - 1)) for i in range(batch)]


def _static_len(seq: int) -> int:
    from models.graphs import static_len

    return static_len(seq + STEPS)


class _Padded:
    """Decode of a left-padded batch: a 2-D attention mask (0 over each sequence's padding)
    and positions counted from each sequence's first token, extended by one every step, over
    HF's dynamic cache or a static one. (models.graphs.StaticDecoder takes no mask.)"""

    def __init__(self, model, pads: list[int], static: bool, max_len: int) -> None:
        from models.graphs import cache_argument, static_cache

        param = next(model.parameters())
        self.model, self.pads = model, pads
        self.arg = cache_argument(model)
        self.cache = static_cache(model.config, len(pads), max_len, param.device,
                                  param.dtype) if static else None

    def _call(self, ids: torch.Tensor) -> torch.Tensor:
        kwargs = {self.arg: self.cache} if self.cache is not None else {}
        out = self.model(ids, attention_mask=self.mask, position_ids=self.positions,
                         use_cache=True, **kwargs)
        if self.cache is None:
            self.cache = getattr(out, "cache", None) or out.past_key_values
        return out.logits[:, -1]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        batch, seq = ids.shape
        at = torch.arange(seq, device=ids.device)
        pads = torch.tensor(self.pads, device=ids.device)[:, None]
        self.mask = (at >= pads).long()
        self.positions = (at - pads).clamp(min=0)
        return self._call(ids)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        self.positions = self.positions[:, -1:] + 1
        return self._call(ids)

    def close(self) -> None:
        self.cache = self.model = None


class _Plain:
    """Decode over HF's dynamic cache, as the profile's decode runner calls the model."""

    def __init__(self, model) -> None:
        from models.graphs import cache_argument

        self.model, self.arg, self.cache = model, cache_argument(model), None

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(ids, use_cache=True)
        self.cache = getattr(out, "cache", None) or out.past_key_values
        return out.logits[:, -1]

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=True, **{self.arg: self.cache}).logits[:, -1]

    def close(self) -> None:
        self.cache = self.model = None


class _Static:
    """models.graphs.StaticDecoder, eager or graphed, returning each step's last logits."""

    def __init__(self, model, batch: int, max_len: int, graph: bool) -> None:
        from models.graphs import StaticDecoder

        self.decoder = StaticDecoder(model, batch, max_len, graph=graph)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.prefill(ids)[:, -1]

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.step(ids)[:, -1].clone()  # a graph's output is overwritten

    def close(self) -> None:
        self.decoder.close()


def _decoder(model, path: str, batch: int, seq: int):
    if path == "dynamic":
        return _Plain(model)
    if path in ("static", "static_graphed"):
        return _Static(model, batch, _static_len(seq), graph=path == "static_graphed")
    return _Padded(model, left_pads(batch, seq), path == "padded_static", _static_len(seq))


def decode(model, path: str, prompt: torch.Tensor, tokens: list[torch.Tensor]) -> list:
    """The last logits of the prefill of `prompt`, then of each step fed `tokens`, over
    `path`; float32 copies (a graph's outputs are overwritten by the next replay)."""
    dec = _decoder(model, path, *prompt.shape)
    try:
        out = [dec.prefill(prompt).float()]
        out += [dec.step(t).float() for t in tokens]
    finally:
        dec.close()
    return out


def paths_for(device: str) -> tuple[str, ...]:
    """Every path but the graphed one off a GPU (CUDA graphs need one)."""
    return PATHS if str(device).startswith("cuda") else \
        tuple(p for p in PATHS if p != "static_graphed")


def decode_trials(model, ref_model, variant, prompts: list, device: str, judge,
                  ) -> tuple[list[dict], dict[str, str]]:
    """(trials, paths skipped with why): one trial per prompt (`integrate.Prompt`), path and
    step, judged by `judge(patched logits, unpatched logits, reference logits)` -> the
    trial's errors, limit and verdict. A graph that cannot be captured skips its path (the
    graphs stage decides what a failed capture means); any other failure is the check's."""
    from models.graphs import CaptureError

    trials, skipped = [], {}
    for prompt in prompts:
        ids = prompt.ids
        gen = torch.Generator().manual_seed(prompt.seed + 1000)
        tokens = [torch.randint(0, model.config.vocab_size, (ids.shape[0], 1),
                                generator=gen).to(device) for _ in range(STEPS)]
        refs, bases = {}, {}
        for path in paths_for(device):
            padded = path.startswith("padded")
            if padded not in refs:
                refs[padded] = decode(ref_model, "padded" if padded else "dynamic", ids, tokens)
            try:
                new = decode(variant, path, ids, tokens)
            except CaptureError as e:
                skipped[path] = e.reason
                continue
            # the unpatched side of a graph is the same step eager (what it replays)
            eager = "static" if path == "static_graphed" else path
            if eager not in bases:
                bases[eager] = decode(model, eager, ids, tokens)
            for step, (n, b, r) in enumerate(zip(new, bases[eager], refs[padded])):
                trials.append({"seed": prompt.seed, "shares_prefix": prompt.shares_prefix,
                               "path": path, "step": step, "position": ids.shape[1] + step - 1,
                               **judge(n, b, r)})
    return trials, skipped
