"""`generate` over a static KV cache with transformers' semantics, so that each decode step can
be one CUDA graph replay (`models.graphs.StaticDecoder`).

What transformers decides, transformers decides here too: the generation config is prepared by
the model's own `_prepare_generation_config` (the model's `generation_config`, then the call's
arguments, then its global defaults, such as `top_k=50` when sampling), the special tokens by
`_prepare_special_tokens` (a missing pad token falls back to the first EOS), and the logits
processors and warpers (temperature, top-k, top-p, repetition penalty, ...) are the list its
`_get_logits_processor` builds. The loop then does what its `_sample` does per step: the last
position's logits copied to float32, the processors over the sequence so far, argmax or one
`torch.multinomial` draw from the softmax, finished rows fed the pad token, stop once every row
has met an EOS or the length is reached. So on the CPU in float32 greedy and seeded sampling
give transformers' tokens (`tests/models/test_generation.py`).

What differs is only where the host waits. transformers reads `unfinished.max() == 0` on the
host after every step, which stalls the host until the GPU has caught up; here that flag is
kept on the device and read every `CHECK_EVERY` steps, so the host queues the next replay while
the GPU runs the current one, and the steps run past the last EOS (at most CHECK_EVERY - 1) are
cut from the output. With no EOS the loop never reads the device.

Not supported (`GenerationError`, one line): beam search, assisted and contrastive decoding,
several sequences per prompt, `stop_strings`, `max_time`, streamers and dict outputs; for
those, call the model's own `generate`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

CHECK_EVERY = 8
SUPPORTED_MODES = ("greedy_search", "sample")
REFUSED = ("streamer", "assistant_model", "stopping_criteria", "logits_processor",
           "prefix_allowed_tokens_fn", "synced_gpus", "negative_prompt_ids", "tokenizer")


class GenerationError(ValueError):
    """A generation option this loop does not implement, or a request that cannot run."""


@dataclass
class Plan:
    """One call's prepared generation: its transformers config, processors and stop tokens."""

    config: object  # transformers.GenerationConfig, prepared
    processors: object  # transformers.LogitsProcessorList
    new_tokens: int
    sample: bool
    eos: torch.Tensor | None
    pad: torch.Tensor | None


def _call(fn, **kwargs):
    """`fn` with the keyword arguments its installed signature names (private transformers
    methods gain and lose parameters between releases)."""
    names = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in names})


def plan(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
         **kwargs) -> Plan:
    """Prepare a call `generate(input_ids, attention_mask=..., **kwargs)` as transformers would;
    GenerationError for what this loop does not do."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise GenerationError(f"input_ids must be [batch, prompt length >= 1], got "
                              f"{list(input_ids.shape)}")
    refused = sorted(k for k in kwargs if k in REFUSED and kwargs[k] is not None)
    if refused:
        raise GenerationError(f"generate here does not take {', '.join(refused)}; use the "
                              "model's own generate for that")
    try:
        prepared = model._prepare_generation_config(None, **kwargs)
    except ValueError as e:  # transformers' own validation: its message, on one line
        raise GenerationError(" ".join(str(e).split())) from None
    config, rest = prepared if isinstance(prepared, tuple) else (prepared, {})
    rest = {k: v for k, v in rest.items() if v is not None}
    if rest:
        raise GenerationError(f"unknown generation argument(s) {', '.join(sorted(rest))}")
    mode = str(getattr(config.get_generation_mode(), "value", config.get_generation_mode()))
    if mode not in SUPPORTED_MODES:
        raise GenerationError(f"generation mode {mode} is not supported here (greedy and "
                              "sampling are); use the model's own generate")
    for name, off in (("num_return_sequences", 1), ("max_time", None), ("stop_strings", None),
                      ("return_dict_in_generate", False)):
        if getattr(config, name, off) not in (off, None) and getattr(config, name) != off:
            raise GenerationError(f"{name}={getattr(config, name)!r} is not supported here; "
                                  "use the model's own generate")
    length = input_ids.shape[1]
    new = config.max_new_tokens if config.max_new_tokens is not None \
        else config.max_length - length
    if new is None or new < 1:
        raise GenerationError(f"nothing to generate: max_new_tokens={config.max_new_tokens}, "
                              f"max_length={config.max_length}, prompt of {length}")
    _call(model._prepare_special_tokens, generation_config=config,
          kwargs_has_attention_mask=attention_mask is not None, device=input_ids.device,
          batch_size=input_ids.shape[0])
    from transformers import LogitsProcessorList

    processors = _call(model._get_logits_processor, generation_config=config,
                       input_ids_seq_length=length, encoder_input_ids=input_ids,
                       prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(),
                       device=input_ids.device, model_kwargs={"attention_mask": attention_mask})
    eos = getattr(config, "_eos_token_tensor", None)
    pad = getattr(config, "_pad_token_tensor", None)
    return Plan(config, processors, int(new), mode == "sample",
                None if eos is None else eos.to(input_ids.device),
                None if pad is None else pad.to(input_ids.device))


def decode(decoder, plan: Plan, input_ids: torch.Tensor,
           attention_mask: torch.Tensor | None = None,
           on_token: Callable[[int], None] | None = None) -> torch.Tensor:
    """The prompt followed by the generated tokens, [batch, prompt + generated], as
    transformers' generate returns them. `decoder`: a StaticDecoder of this batch with room for
    prompt + new tokens. `on_token(i)` runs after token i is chosen (enqueued, not waited
    for): where a benchmark records its clock."""
    batch, length = input_ids.shape
    n = plan.new_tokens
    if decoder.max_len < length + n - 1:
        raise GenerationError(f"the static cache holds {decoder.max_len} positions; "
                              f"{length} + {n} tokens need {length + n - 1}")
    device = input_ids.device
    seq = torch.empty(batch, length + n, dtype=torch.long, device=device)
    seq[:, :length] = input_ids
    eos, pad = plan.eos, plan.pad
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    with torch.no_grad():
        logits = decoder.prefill(input_ids, attention_mask=attention_mask, last_only=True)
        made = n
        for i in range(n):
            scores = plan.processors(seq[:, :length + i],
                                     logits[:, -1].to(copy=True, dtype=torch.float32))
            if plan.sample:
                token = torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)
            else:
                token = torch.argmax(scores, dim=-1)
            if eos is not None:
                token = token * unfinished + pad * (1 - unfinished)
                unfinished = unfinished & ~torch.isin(token, eos)
                done[i] = unfinished.max() == 0
            seq[:, length + i] = token
            if on_token is not None:
                on_token(i)
            if i + 1 == n:
                break
            if eos is not None and (i + 1) % CHECK_EVERY == 0 and bool(done[i]):
                made = i + 1
                break
            logits = decoder.step(token[:, None])
    if eos is not None:
        finished = torch.nonzero(done[:made]).flatten()
        if finished.numel():
            made = int(finished[0]) + 1
    return seq[:, :length + made]
