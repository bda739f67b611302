"""`KernelHandle.generate` against transformers' own `generate`, token for token, on the CPU in
float32: greedy, seeded sampling, EOS stopping, a left-padded batch (models/generation.py)."""

import pytest
import torch

from core.errors import UserError
from pipeline.api import KernelHandle, generation_cache_len
from profiling.loader import build, resolve

NEW = 12


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def model(request):
    torch.manual_seed(0)
    m = build(resolve(request.param), torch.float32, "cpu")
    # larger weights than the config's init: logits far apart, so greedy is not a run of one
    # token and sampling has more than one likely choice
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return m


def prompts(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (batch, length), generator=gen)


def both(model, ids, seed=7, **kwargs):
    """(ours, transformers') for the same call, the RNG seeded alike before each."""
    handle = KernelHandle([], model=model)
    torch.manual_seed(seed)
    ours = handle.generate(ids, max_new_tokens=NEW, **kwargs)
    torch.manual_seed(seed)
    theirs = model.generate(ids, max_new_tokens=NEW, **kwargs)
    return ours, theirs


def test_greedy_matches_transformers(model):
    ours, theirs = both(model, prompts(2, 9))
    assert ours.shape == theirs.shape == (2, 9 + NEW)
    assert torch.equal(ours, theirs)
    assert len(set(ours[0, 9:].tolist())) > 1  # not a degenerate run of one token


@pytest.mark.parametrize("kwargs", [dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9),
                                    dict(do_sample=True)])
def test_seeded_sampling_matches_transformers(model, kwargs):
    ours, theirs = both(model, prompts(3, 7), **kwargs)
    assert torch.equal(ours, theirs)
    again, _ = both(model, prompts(3, 7), seed=8, **kwargs)
    assert not torch.equal(ours, again)  # the seed matters: it is sampling


def test_eos_stops_as_transformers_does(model):
    ids = prompts(2, 6, seed=3)
    free, _ = both(model, ids, do_sample=True)
    eos = int(free[0, 6 + 2])  # row 0 meets it at its third token (or earlier)
    ours, theirs = both(model, ids, do_sample=True, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours, theirs)
    assert ours.shape[1] < 6 + NEW or (ours[:, 6:] == eos).any()
    row0 = ours[0, 6:].tolist()
    after = row0[row0.index(eos) + 1:]
    assert all(t == 0 for t in after)  # a finished row is fed the pad token


def test_left_padded_batch_matches_transformers(model):
    ids = prompts(2, 10, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # the second prompt is 6 tokens, left-padded to 10
    ids[1, :4] = 0
    for kwargs in (dict(), dict(do_sample=True, top_k=30)):
        ours, theirs = both(model, ids, attention_mask=mask, pad_token_id=0, **kwargs)
        assert torch.equal(ours, theirs), kwargs
    # the padded row is generated as if it stood alone
    alone, _ = both(model, ids[1:, 4:], pad_token_id=0)
    padded, _ = both(model, ids, attention_mask=mask, pad_token_id=0)
    assert torch.equal(padded[1, 10:], alone[0, 6:])


def test_the_static_cache_is_sized_and_kept_per_shape(model):
    handle = KernelHandle([], model=model)
    handle.generate(prompts(1, 5), max_new_tokens=4)
    first = handle._generator
    assert (first.batch, first.max_len) == (1, generation_cache_len(5, 4)) == (1, 16)
    handle.generate(prompts(1, 5, seed=9), max_new_tokens=4)
    assert handle._generator is first  # same shape: the cache (and a graph) is reused
    handle.generate(prompts(2, 5), max_new_tokens=4)
    assert handle._generator is not first and handle._generator.batch == 2
    handle.undo()
    assert handle._generator is None


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_beams=2), "beam"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(streamer=object()), "streamer"), (dict(stop_strings=["x"]), "stop_strings")])
def test_what_it_does_not_do_is_one_line(model, kwargs, words):
    kwargs.setdefault("max_new_tokens", 3)
    with pytest.raises(UserError, match=words):
        KernelHandle([], model=model).generate(prompts(1, 4), **kwargs)
