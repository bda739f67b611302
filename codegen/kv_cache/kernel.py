"""Triton KV-cache append: both cats of one DynamicLayer.update in one launch.

HF runs two `torch.cat`s per layer and call. On a prefill the cache is empty, so each cat is a
copy of a transposed view (batch, kv_heads, seq, head_dim) whose memory order is (batch, seq,
heads, head_dim); aten's cat walks that input by its strides at about a third of the copy
bandwidth on an H200 (28 us per cat for Llama-3.2-1B at batch 8 x 1024, where moving those
bytes takes about 5 us), and the two cats are two launches.

Here the grid enumerates blocks of BLOCK_R output rows (a row is one (batch, head, position)
vector of head_dim elements), first the blocks of the new keys, then those of the new values,
on one axis. Each row comes from the cached part (position < past) or from the new states, so
a program selects one source pointer per row and does a single masked load of [BLOCK_R,
BLOCK_D]; rows are addressed through each tensor's own strides, so nothing is made
contiguous first and a cropped (strided) cache needs no copy. The innermost stride is 1 for
every tensor HF hands over, and Triton specialises an int argument equal to 1 into a
constant: the head_dim axis is then contiguous and, with row strides divisible by 16 bytes
(Triton's other specialisation), loads and stores vectorise to 16 bytes. The values are moved
as they are, bit for bit: no arithmetic, so the result is exact in every dtype, also under the
CPU interpreter.
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from codegen.dtypes import element_size
from core.family import Case
from core.source import kernel_source

ROW_BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128)
WARPS = (1, 2, 4, 8)
# bytes each thread moves per tile: at least one 16-byte vector, at most 8 of them in flight
THREAD_BYTES = (16, 128)


@triton.jit
def _kv_copy_rows(past_ptr, new_ptr, out_ptr, rows, n_rows, total, past_len,
                  p_sb, p_sh, p_st, p_sd, n_sb, n_sh, n_st, n_sd, o_sb, o_sh, o_st, o_sd,
                  KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    # rows enumerate the output in (batch, head, position) order; the index arithmetic stays
    # in int32 (cheap divisions), the offsets go to int64: batch * stride passes 2**31 for
    # long caches of wide models
    t = rows % total
    bh = rows // total
    b = (bh // KV_HEADS).to(tl.int64)
    h = (bh % KV_HEADS).to(tl.int64)
    t = t.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < HEAD_DIM)
    cached = (t < past_len)[:, None]
    past_rows = past_ptr + (b * p_sb + h * p_sh + t * p_st)[:, None] + cols * p_sd
    new_rows = new_ptr + (b * n_sb + h * n_sh + (t - past_len) * n_st)[:, None] + cols * n_sd
    x = tl.load(tl.where(cached, past_rows, new_rows), mask=mask)
    tl.store(out_ptr + (b * o_sb + h * o_sh + t * o_st)[:, None] + cols * o_sd, x, mask=mask)


@triton.jit
def _kv_append_kernel(pk_ptr, pv_ptr, nk_ptr, nv_ptr, ok_ptr, ov_ptr, n_rows, total, past_len,
                      pk_sb, pk_sh, pk_st, pk_sd, pv_sb, pv_sh, pv_st, pv_sd,
                      nk_sb, nk_sh, nk_st, nk_sd, nv_sb, nv_sh, nv_st, nv_sd,
                      ok_sb, ok_sh, ok_st, ok_sd, ov_sb, ov_sh, ov_st, ov_sd,
                      KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    blocks = tl.cdiv(n_rows, BLOCK_R)
    block = tl.program_id(0)
    if block < blocks:
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        _kv_copy_rows(pk_ptr, nk_ptr, ok_ptr, rows, n_rows, total, past_len,
                      pk_sb, pk_sh, pk_st, pk_sd, nk_sb, nk_sh, nk_st, nk_sd,
                      ok_sb, ok_sh, ok_st, ok_sd, KV_HEADS, HEAD_DIM, BLOCK_D)
    else:
        rows = (block - blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        _kv_copy_rows(pv_ptr, nv_ptr, ov_ptr, rows, n_rows, total, past_len,
                      pv_sb, pv_sh, pv_st, pv_sd, nv_sb, nv_sh, nv_st, nv_sd,
                      ov_sb, ov_sh, ov_st, ov_sd, KV_HEADS, HEAD_DIM, BLOCK_D)


@triton.jit
def _kv_static_rows(past_ptr, new_ptr, out_ptr, rows, n_rows, slots, new_len, position,
                    p_sb, p_sh, p_st, p_sd, n_sb, n_sh, n_st, n_sd, o_sb, o_sh, o_st, o_sd,
                    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    WRITE_ALL: tl.constexpr):
    # in place (WRITE_ALL false) rows enumerate (batch, head, j < new): row j goes to slot
    # position + j; out of place they enumerate every (batch, head, slot), each copied from
    # the new states where it is one of theirs and from the buffer elsewhere
    if WRITE_ALL:
        t = rows % slots
        bh = rows // slots
    else:
        t = rows % new_len + position
        bh = rows // new_len
    b = (bh // KV_HEADS).to(tl.int64)
    h = (bh % KV_HEADS).to(tl.int64)
    j = (t - position).to(tl.int64)
    t = t.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    # a position past the buffer writes nothing (index_copy_ would raise: no host check here,
    # the position lives on the device)
    mask = ((rows < n_rows) & (t < slots))[:, None] & (cols < HEAD_DIM)
    fresh = ((t >= position) & (j < new_len))[:, None]
    past_rows = past_ptr + (b * p_sb + h * p_sh + t * p_st)[:, None] + cols * p_sd
    new_rows = new_ptr + (b * n_sb + h * n_sh + j * n_st)[:, None] + cols * n_sd
    x = tl.load(tl.where(fresh, new_rows, past_rows), mask=mask)
    tl.store(out_ptr + (b * o_sb + h * o_sh + t * o_st)[:, None] + cols * o_sd, x, mask=mask)


@triton.jit
def _kv_static_kernel(pk_ptr, pv_ptr, nk_ptr, nv_ptr, ok_ptr, ov_ptr, pos_ptr, ticket_ptr,
                      n_rows, slots, new_len, pk_sb, pk_sh, pk_st, pk_sd, pv_sb, pv_sh, pv_st,
                      pv_sd, nk_sb, nk_sh, nk_st, nk_sd, nv_sb, nv_sh, nv_st, nv_sd,
                      ok_sb, ok_sh, ok_st, ok_sd, ov_sb, ov_sh, ov_st, ov_sd,
                      KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr, WRITE_ALL: tl.constexpr, ADVANCE: tl.constexpr,
                      PDL: tl.constexpr = False):
    # StaticLayer.update's two index_copy_ in one launch: keys' row blocks, then values'; the
    # position is read here, on the device, so a captured step replays at whatever
    # cumulative_length holds then
    if PDL:  # codegen/pdl.py: position, ticket, new states and cache are all the step's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    position64 = tl.load(pos_ptr)
    position = position64.to(tl.int32)
    if ADVANCE:
        # cumulative_length += new in this launch too (HF's add_ is one more kernel per layer
        # and step): every program takes a ticket after its read of the position (acq_rel
        # orders that read first); the last one to take one has seen every read done, writes
        # the new position and resets the ticket for the next launch
        taken = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        if taken == tl.num_programs(0) - 1:
            tl.store(pos_ptr, position64 + new_len)
            tl.store(ticket_ptr, 0)
    blocks = tl.cdiv(n_rows, BLOCK_R)
    block = tl.program_id(0)
    if block < blocks:
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        _kv_static_rows(pk_ptr, nk_ptr, ok_ptr, rows, n_rows, slots, new_len, position,
                        pk_sb, pk_sh, pk_st, pk_sd, nk_sb, nk_sh, nk_st, nk_sd,
                        ok_sb, ok_sh, ok_st, ok_sd, KV_HEADS, HEAD_DIM, BLOCK_D, WRITE_ALL)
    else:
        rows = (block - blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        _kv_static_rows(pv_ptr, nv_ptr, ov_ptr, rows, n_rows, slots, new_len, position,
                        pv_sb, pv_sh, pv_st, pv_sd, nv_sb, nv_sh, nv_st, nv_sd,
                        ov_sb, ov_sh, ov_st, ov_sd, KV_HEADS, HEAD_DIM, BLOCK_D, WRITE_ALL)


def search_space(case: Case) -> list[dict]:
    """Rows per program x warps, each thread moving 16 to 128 bytes of a tile (at most four
    row blocks per warp count, so at most 16 configs). A decode step copies the whole cache,
    so it has as many rows as a prefill of that length; only tiny calls cut the row blocks
    (no block of more than twice the rows there are)."""
    block_d = triton.next_power_of_2(case["head_dim"])
    # static: the in-place write moves the new rows only (a decode step: batch x kv_heads)
    span = case["new"] if case.get("layout") == "static" else case["past"] + case["new"]
    rows = case["batch"] * case["kv_heads"] * span
    low, high = THREAD_BYTES
    configs = []
    for block_r in ROW_BLOCKS:
        if block_r > 1 and block_r >= 2 * rows:
            continue
        for warps in WARPS:
            per_thread = block_r * block_d * element_size(case) // (32 * warps)
            if low <= per_thread <= high:
                configs.append({"BLOCK_R": block_r, "num_warps": warps})
    return configs or [{"BLOCK_R": 1, "num_warps": 1}]


_FORWARD = '''\
def _check_params(params):
    if params and params != BAKED_PARAMS:
        raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")


def _cached_length(cache, batch):
    """Positions in the cached part: 0 for lazy_initialization's torch.tensor([]) (shape
    (0,), which cat skips), else its seq axis."""
    if cache.dim() == 1 and cache.numel() == 0:
        return 0
    if cache.dim() != 4 or cache.shape[:2] != (batch, KV_HEADS) or cache.shape[3] != HEAD_DIM:
        raise ValueError(f"cache {tuple(cache.shape)} does not fit batch={batch}, "
                         f"kv_heads={KV_HEADS}, head_dim={HEAD_DIM}")
    return cache.shape[2]


def forward(keys, values, key_states, value_states, *, out, **params) -> None:
    """keys, values: the cache, (batch, KV_HEADS, past, HEAD_DIM) or HF's empty (0,);
    key_states, value_states (batch, KV_HEADS, new, HEAD_DIM); any strides, one dtype.
    out = (new_keys, new_values), (batch, KV_HEADS, past + new, HEAD_DIM)."""
    if params:
        _check_params(params)
    new_keys, new_values = out
    shape = key_states.shape  # a torch.Size: compared with tuples as it is, no copies
    batch, new = shape[0], shape[2]
    past = _cached_length(keys, batch)
    want = (batch, KV_HEADS, past + new, HEAD_DIM)
    if (shape != (batch, KV_HEADS, new, HEAD_DIM) or value_states.shape != shape
            or _cached_length(values, batch) != past or new_keys.shape != want
            or new_values.shape != want):
        raise ValueError(f"shapes cache {tuple(keys.shape)}/{tuple(values.shape)}, states "
                         f"{tuple(key_states.shape)}/{tuple(value_states.shape)}, out "
                         f"{tuple(new_keys.shape)} do not fit kv_heads={KV_HEADS}, "
                         f"head_dim={HEAD_DIM}")
    # the kernel copies bits; cat promotes mixed dtypes, even with an empty cache
    dtype = key_states.dtype
    if not (keys.dtype is dtype and values.dtype is dtype and value_states.dtype is dtype
            and new_keys.dtype is dtype and new_values.dtype is dtype):
        raise ValueError("cache, states and outputs must share one dtype")
    n_rows = batch * KV_HEADS * (past + new)
    if n_rows == 0:
        return
    if past == 0:  # nothing cached: no row reads these, any valid 4-d tensor stands in
        keys, values = key_states, value_states
    grid = (2 * cdiv(n_rows, BLOCK_R),)
    _launch(grid, keys, values, key_states, value_states, new_keys, new_values, n_rows,
            past + new, past, *keys.stride(), *values.stride(), *key_states.stride(),
            *value_states.stride(), *new_keys.stride(), *new_values.stride())


_launch = launcher(_kv_append_kernel, KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_R=BLOCK_R,
                   BLOCK_D=BLOCK_D, num_warps=NUM_WARPS)
'''


_STATIC_FORWARD = '''\
def _check_params(params):
    if params and params != BAKED_PARAMS:
        raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")


def _same_buffer(a, b):
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def forward(keys, values, key_states, value_states, position, *, out, ticket=None,
            **params) -> None:
    """StaticLayer.update's writes: keys, values (batch, KV_HEADS, slots, HEAD_DIM), the static
    buffers; key_states, value_states (batch, KV_HEADS, new, HEAD_DIM), any strides;
    position: 0-d int64 on the device, read there only (capturable). out = (new_keys,
    new_values) of the buffers' shape: the buffers themselves (in place, the adapter's way:
    only the new rows are written) or other tensors (every row written). ticket: a zeroed
    1-element int32 tensor kept per cache layer: with it (in place only) the launch also
    advances `position` by new, as StaticLayer.update's add_ does."""
    if params:
        _check_params(params)
    new_keys, new_values = out
    shape = key_states.shape
    batch, new = shape[0], shape[2]
    slots = keys.shape[2] if keys.dim() == 4 else -1
    want = (batch, KV_HEADS, slots, HEAD_DIM)
    if (shape != (batch, KV_HEADS, new, HEAD_DIM) or value_states.shape != shape
            or keys.shape != want or values.shape != want or new_keys.shape != want
            or new_values.shape != want or position.numel() != 1
            or position.dtype is not torch.int64 or position.device != keys.device):
        raise ValueError(f"shapes buffers {tuple(keys.shape)}/{tuple(values.shape)}, states "
                         f"{tuple(key_states.shape)}/{tuple(value_states.shape)}, out "
                         f"{tuple(new_keys.shape)}, position {tuple(position.shape)} "
                         f"{position.dtype} do not fit kv_heads={KV_HEADS}, "
                         f"head_dim={HEAD_DIM}")
    dtype = key_states.dtype
    if not (keys.dtype is dtype and values.dtype is dtype and value_states.dtype is dtype
            and new_keys.dtype is dtype and new_values.dtype is dtype):
        raise ValueError("buffers, states and outputs must share one dtype")
    in_place = _same_buffer(new_keys, keys) and _same_buffer(new_values, values)
    n_rows = batch * KV_HEADS * (new if in_place else slots)
    if n_rows == 0:
        return
    if ticket is not None and not (in_place and ticket.dtype is torch.int32
                                   and ticket.device == keys.device and ticket.numel() == 1):
        raise ValueError("ticket: a 1-element int32 tensor on the buffers' device, in place only")
    if not in_place:
        launch, block = _launch_all, ALL_BLOCK_R
    else:
        launch, block = (_launch_new, BLOCK_R) if ticket is None else (_launch_advance, BLOCK_R)
    launch((2 * cdiv(n_rows, block),), keys, values, key_states, value_states, new_keys,
           new_values, position, position if ticket is None else ticket, n_rows, slots, new,
           *keys.stride(), *values.stride(),
           *key_states.stride(), *value_states.stride(), *new_keys.stride(),
           *new_values.stride())


_launch_new = launcher(_kv_static_kernel, KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM,
                       BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, WRITE_ALL=False, ADVANCE=False,
                       num_warps=NUM_WARPS)
_launch_advance = launcher(_kv_static_kernel, KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM,
                           BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, WRITE_ALL=False, ADVANCE=True,
                           num_warps=NUM_WARPS)
# the out-of-place copy of every slot (the verifier's way, never the model's) takes wider
# blocks: the tuned BLOCK_R fits a decode step's few new rows, not the whole buffer
ALL_BLOCK_R = max(BLOCK_R, 32)
_launch_all = launcher(_kv_static_kernel, KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM,
                       BLOCK_R=ALL_BLOCK_R, BLOCK_D=BLOCK_D, WRITE_ALL=True, ADVANCE=False,
                       num_warps=NUM_WARPS)
'''


def render(config: dict, case: Case) -> str:
    kv_heads, d = case["kv_heads"], case["head_dim"]
    block_r, warps = config["BLOCK_R"], config["num_warps"]
    block_d = triton.next_power_of_2(d)
    static = case.get("layout") == "static"
    if static:
        what = ("StaticLayer.update's two index_copy_ in one launch",
                "Writes the new rows into the static (batch, kv_heads, slots, head_dim) keys and\n"
                "        values at the on-device position, bit for bit (in place).",
                f"{case['new']} new positions of {case['dtype']} at any position.")
    else:
        what = ("DynamicLayer.update's two cats in one launch",
                "Copies the cached rows and the new ones into contiguous\n"
                "        (batch, kv_heads, past + new, head_dim) keys and values, bit for bit.",
                f"{case['past']} cached + {case['new']} new positions of {case['dtype']}.")
    header = textwrap.dedent(f'''\
        """KV-cache append candidate: {what[0]}.

        Generated by codegen.kv_cache.kernel.render. {what[1]}
        Specialised for kv_heads={kv_heads}, head_dim={d}; tuned for batch {case["batch"]},
        {what[2]}
        Launch: one program per {block_r} output rows of keys or of values, {warps} warps.
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import triton
        import triton.language as tl

        from codegen.launch import cdiv, launcher

        KV_HEADS = {kv_heads}
        HEAD_DIM = {d}
        BLOCK_D = {block_d}
        BLOCK_R = {block_r}
        NUM_WARPS = {warps}
        BAKED_PARAMS = {{}}
        ''')
    if static:
        header = header.replace("import triton\n", "import torch\nimport triton\n", 1)
        return "\n\n".join([header, kernel_source(_kv_static_rows),
                            kernel_source(_kv_static_kernel), _STATIC_FORWARD])
    return "\n\n".join([header, kernel_source(_kv_copy_rows), kernel_source(_kv_append_kernel),
                        _FORWARD])
