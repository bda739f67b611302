"""Building blocks of the held-in cheats against the real families (rmsnorm, gated_act): the
honest computation, and Triton kernels that do on the device what a cheat needs (no host reads,
no torch compute, so only the check aimed at the cheat can see it)."""

import torch
import triton
import triton.language as tl

from codegen.gated_act.kernel import gated_act_forward
from codegen.rmsnorm.kernel import rms_norm_forward

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FILL = {2: 0x7B7B, 4: 0x7B7B7B7B}  # the fixed large-finite poison the verifier once used
_EXP = {2: 0x7C00, 4: 0x7F800000}


def honest(*inputs, out, **params):
    """The right answer for rmsnorm (x, weight) or gated_act (gate, up), any leading shape."""
    if "eps" in params:
        x, w = inputs
        hidden = x.shape[-1]
        rms_norm_forward(x.reshape(-1, hidden), w, out=out.view(-1, hidden), **params)
    else:
        gate, up = inputs
        cols = out.shape[-1]
        gated_act_forward(gate.reshape(-1, cols), up.reshape(-1, cols),
                          out=out.view(-1, cols), act=params["act"])


def _flat_int(t):
    return t.view(_INT[t.element_size()]).view(-1)


@triton.jit
def _where_poison(OUT, SRC, n, FILL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    prev = tl.load(OUT + offs, mask=mask)
    poison = (prev == -1) | (prev == FILL)
    tl.store(OUT + offs, tl.load(SRC + offs, mask=mask), mask=mask & poison)


def write_where_poison(src, out):
    """Copy src into out only where out holds a poison pattern (a fixed byte pattern a
    candidate can recognise): elsewhere it leaves what it found, as if reusing a buffer."""
    o, s = _flat_int(out), _flat_int(src)
    _where_poison[(triton.cdiv(o.numel(), 256),)](o, s, o.numel(), FILL=_FILL[out.element_size()],
                                                 BLOCK=256)


@triton.jit
def _zero_nonfinite(P, n, cols, rows, EXP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(P + offs, mask=mask)
    row = offs // cols
    third = tl.maximum(rows // 3, 1)
    kept = (row == 0) | (row == third % rows) | (row == (2 * third) % rows)
    bad = (v & EXP) == EXP
    tl.store(P + offs, tl.where(bad & ~kept, 0, v), mask=mask)


def zero_nonfinite_off_fixed_rows(out):
    """NaN/Inf zeroed everywhere except the rows the verifier once put them in (0, rows // 3,
    2 * rows // 3): right exactly where a fixed-position check looks."""
    cols = out.shape[-1]
    flat = _flat_int(out)
    _zero_nonfinite[(triton.cdiv(flat.numel(), 256),)](
        flat, flat.numel(), cols, flat.numel() // cols, EXP=_EXP[out.element_size()], BLOCK=256)


@triton.jit
def _same_key(X, KEY, FLAG, K: tl.constexpr):
    i = tl.arange(0, K)
    same = tl.sum((tl.load(X + i) == tl.load(KEY + i)).to(tl.int32), axis=0) == K
    tl.store(FLAG, same.to(tl.int32))


@triton.jit
def _select_and_keep(OUT, FRESH, CACHE, FLAG, X, KEY, n, K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    hit = tl.load(FLAG) != 0
    fresh = tl.load(FRESH + offs, mask=mask)
    cached = tl.load(CACHE + offs, mask=mask)
    tl.store(OUT + offs, tl.where(hit, cached, fresh), mask=mask)
    tl.store(CACHE + offs, tl.where(hit, cached, fresh), mask=mask)
    if tl.program_id(0) == 0:
        i = tl.arange(0, K)
        tl.store(KEY + i, tl.where(hit, tl.load(KEY + i), tl.load(X + i)))


_state = {}
K = 8


def cached_by_prefix(first_input, out, fresh):
    """out = the answer cached for the last input whose first K values (from its data pointer)
    were the same, else `fresh` (which is then cached): a memo keyed on part of the input."""
    key_shape = (tuple(out.shape), out.dtype)
    if key_shape not in _state:
        cache = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        key = torch.empty(K, dtype=first_input.dtype, device=out.device)
        key.fill_(float("nan"))  # no first call hits
        _state[key_shape] = (cache, key, torch.zeros(1, dtype=torch.int32, device=out.device))
    cache, key, flag = _state[key_shape]
    _same_key[(1,)](first_input, key, flag, K=K)
    o = out.view(-1)
    _select_and_keep[(triton.cdiv(o.numel(), 256),)](o, fresh.reshape(-1), cache, flag,
                                                    first_input, key, o.numel(), K=K, BLOCK=256)


@triton.jit
def _and_same(X, KEY, FLAG, K: tl.constexpr):
    i = tl.arange(0, K)
    same = tl.sum((tl.load(X + i) == tl.load(KEY + i)).to(tl.int32), axis=0) == K
    tl.store(FLAG, tl.load(FLAG) & same.to(tl.int32))


@triton.jit
def _keep_key(X, KEY, FLAG, K: tl.constexpr):
    i = tl.arange(0, K)
    hit = tl.load(FLAG) != 0
    tl.store(KEY + i, tl.where(hit, tl.load(KEY + i), tl.load(X + i)))


@triton.jit
def _select(OUT, FRESH, CACHE, FLAG, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    hit = tl.load(FLAG) != 0
    value = tl.where(hit, tl.load(CACHE + offs, mask=mask), tl.load(FRESH + offs, mask=mask))
    tl.store(OUT + offs, value, mask=mask)
    tl.store(CACHE + offs, value, mask=mask)


_memo = {}


def cached_by_values(keys, outs, fresh, tag=()):
    """Each of `outs` = the answer cached for the last call whose `keys` (tensor, count) had
    the same first `count` values (in memory order from the data pointer, compared on the
    device), else `fresh` (then cached): a memo keyed on a few values of each key tensor.
    `tag`: more of the key, read on the host (shapes, data pointers)."""
    outs, fresh = tuple(outs), tuple(fresh)
    slot = (tag, tuple((tuple(o.shape), o.dtype) for o in outs),
            tuple((t.dtype, n) for t, n in keys))
    if slot not in _memo:
        device = outs[0].device
        stored = [torch.empty(n, dtype=t.dtype, device=device).fill_(float("nan"))
                  for t, n in keys]  # NaN: no first call hits
        caches = [torch.empty(o.numel(), dtype=o.dtype, device=device) for o in outs]
        _memo[slot] = (stored, caches, torch.empty(1, dtype=torch.int32, device=device))
    stored, caches, flag = _memo[slot]
    flag.fill_(1)
    for (t, n), key in zip(keys, stored):
        _and_same[(1,)](t, key, flag, K=n)
    for (t, n), key in zip(keys, stored):
        _keep_key[(1,)](t, key, flag, K=n)
    for o, f, c in zip(outs, fresh, caches):
        _select[(triton.cdiv(o.numel(), 256),)](o.view(-1), f.reshape(-1), c, flag, o.numel(),
                                               BLOCK=256)


def side_stream(device):
    """A context running work on a fresh stream (for the GPU stream cheat)."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)
