"""The KV-cache append as Hugging Face's DynamicLayer runs it, and the case side of the family.

`DynamicLayer.update` (transformers 5.17 to 5.24, identical as a syntax tree) appends the new
key and value states to the cached ones with one `torch.cat` each along the sequence axis
(dim -2). Layout, (batch, kv_heads, seq, head_dim): the cached part is whatever the previous
cat (or a `crop`) left, normally contiguous; the new states are transposed views of the k/v
projections, whose memory order is (batch, seq, heads, head_dim). On a prefill the cache is
what `lazy_initialization` made: `torch.tensor([])`, shape (0,), which cat skips as a legacy
empty tensor, so the "append" is a copy of the strided states into contiguous ones.

`kv_append` is those two cats, so it is bitwise the HF result (tests check it against the
real class); `dynamic_layer_update` is the body of `DynamicLayer.update` verbatim, which the
patch compares the installed code with before touching anything; likewise the two known
bodies of `lazy_initialization`.

The static layout (`layout: "static"` in the case) is `StaticLayer.update` (StaticCache, what
a captured decode step runs): the cache is a preallocated (batch, kv_heads, slots, head_dim)
buffer per keys and values, and the new states go to positions [p, p + new) with two
`index_copy_`, where p is the layer's `cumulative_length`, a 0-d int64 tensor on the device
(read on the device only, so the step stays capturable). Its inputs are (keys, values,
key_states, value_states, position); `kv_append` then returns the buffers with those rows
replaced, out of place, and the adapter runs the kernel in place (out is the buffers
themselves, `VerifyHooks.in_place`). A static case carries no position and no slot count: both are
known on the device only, and a kernel is generic over them. Its inputs put the position at
`position` of `slots` (defaults below: not at either end); edge cases vary both.
"""

from __future__ import annotations

import torch

from codegen.dtypes import element_size, random_heads, torch_dtype
from codegen.shapes import canonical
from core.family import Case, distinct


def kv_append(keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor,
              value_states: torch.Tensor, position: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """DynamicLayer's two cats; with `position` (the static layout) StaticLayer's two
    index_copy_ at arange(new) + position, out of place."""
    if position is None:
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
    index = torch.arange(key_states.shape[-2], device=keys.device) + position
    return keys.index_copy(2, index, key_states), values.index_copy(2, index, value_states)


def static_layer_update(self, key_states, value_states, *args, **kwargs):
    """transformers' StaticLayer.update (5.24, read here; 5.17 keeps the same on-device
    `cumulative_length` and `index_copy_`), statement for statement (docstring aside)."""
    # Lazy initialization
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)

    # Create a tensor to slice the static kv at the correct indices
    kv_length = key_states.shape[-2]
    cache_position = torch.arange(kv_length, device=self.device) + self.cumulative_length
    # Note that has to be performed in-place, as we have a static address that we need to keep
    self.cumulative_length.add_(kv_length)

    # Update the cache
    try:
        self.keys.index_copy_(2, cache_position, key_states)
        self.values.index_copy_(2, cache_position, value_states)
    except NotImplementedError:
        # Fallback for devices like MPS where index_copy_ might not be supported.
        self.keys[:, :, cache_position] = key_states
        self.values[:, :, cache_position] = value_states

    return self.keys, self.values


def dynamic_layer_update(self, key_states, value_states, *args, **kwargs):
    """transformers' DynamicLayer.update, statement for statement (docstring aside)."""
    # Lazy initialization
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)

    self.keys = torch.cat([self.keys, key_states], dim=-2)
    self.values = torch.cat([self.values, value_states], dim=-2)
    return self.keys, self.values


def lazy_initialization_5_17(self, key_states, value_states) -> None:
    """DynamicLayer.lazy_initialization of transformers 5.17, statement for statement."""
    self.dtype, self.device = key_states.dtype, key_states.device
    self.keys = torch.tensor([], dtype=self.dtype, device=self.device)
    self.values = torch.tensor([], dtype=self.dtype, device=self.device)
    self.is_initialized = True


def lazy_initialization_5_24(self, key_states, value_states) -> None:
    """The same in transformers 5.24: no dtype attribute; the values' own dtype."""
    self.device = key_states.device
    self.keys = torch.tensor([], dtype=key_states.dtype, device=self.device)
    self.values = torch.tensor([], dtype=value_states.dtype, device=self.device)
    self.is_initialized = True


# What each known lazy_initialization leaves on the layer besides the two empty tensors and
# is_initialized: these attributes of the new key states.
INITIALISED_FROM_KEYS = ((lazy_initialization_5_17, ("dtype", "device")),
                         (lazy_initialization_5_24, ("device",)))


STATE_LAYOUTS = ("bshd", "bhsd", "qkv")
DEFAULT_STATES = ("bshd", "bshd")


def make_case(batch: int, kv_heads: int, head_dim: int, past: int, new: int,
              dtype: str, states: tuple[str, str] = DEFAULT_STATES,
              heads: int | None = None) -> Case:
    """past: cached positions before the call (0 on a prefill); new: positions appended.
    `states`: the layouts of the new keys and values as the adapter hands them
    (STATE_LAYOUTS): "bshd", a transposed view of a (batch, seq, kv_heads, head_dim)
    projection (HF's v, and k after the rotary); "bhsd", contiguous (Phi-3's k out of its
    rotary's cat); "qkv", a transposed view of a column block of one fused
    (batch, seq, (heads + 2 kv_heads) head_dim) q/k/v projection (GPT-2's c_attn, Phi-3's v),
    which needs `heads`, the query heads. Keys present only where they differ from two
    transposed views, so those cases keep their earlier keys."""
    if past < 0 or new < 0:
        raise ValueError(f"past and new must be >= 0, got {past}, {new}")
    if len(states) != 2 or any(x not in STATE_LAYOUTS for x in states):
        raise ValueError(f"states must be two of {STATE_LAYOUTS}, got {states}")
    case = {"batch": int(batch), "kv_heads": int(kv_heads), "head_dim": int(head_dim),
            "past": int(past), "new": int(new), "dtype": dtype}
    if "qkv" in states:
        if heads is None:
            raise ValueError("fused q/k/v states need the query heads")
        case["heads"] = int(heads)
    # one name per addressing: a layout equal to an earlier one of STATE_LAYOUTS but for the
    # strides of size-1 dims (one kv head, one new token) takes that one's name
    states = tuple(next(x for x in STATE_LAYOUTS if _same(x, layout, role, case))
                   for role, layout in enumerate(states))
    if "qkv" not in states:
        case.pop("heads", None)
    if states != DEFAULT_STATES:
        case["states"] = ",".join(states)
    return case


def _strides(layout: str, role: int, case: Case) -> tuple[tuple, int]:
    """(strides, storage offset) of the new keys (role 0) or values (1) in `layout`."""
    s, d, kv = case["new"], case["head_dim"], case["kv_heads"]
    if layout == "bhsd":
        return (kv * s * d, s * d, d, 1), 0
    if layout == "bshd":
        return (s * kv * d, d, kv * d, 1), 0
    h = case["heads"]
    width = (h + 2 * kv) * d
    return (s * width, d, width, 1), (h * d, (h + kv) * d)[role]


def _shape(case: Case) -> tuple:
    return (case["batch"], case["kv_heads"], case["new"], case["head_dim"])


def _same(a: str, b: str, role: int, case: Case) -> bool:
    if "qkv" in (a, b) and "heads" not in case:
        return a == b
    (sa, oa), (sb, ob) = _strides(a, role, case), _strides(b, role, case)
    return canonical(_shape(case), sa) == canonical(_shape(case), sb) and oa == ob


def state_layout(shape, stride, offset: int, role: int, case: Case) -> str | None:
    """Which of STATE_LAYOUTS new keys (role 0) or values (1) of this geometry have, or None."""
    got = (canonical(shape, stride), offset)
    for layout in STATE_LAYOUTS:
        if layout == "qkv" and "heads" not in case:
            continue
        want, want_offset = _strides(layout, role, case)
        if (canonical(shape, want), want_offset) == got:
            return layout
    return None


def states_of(case: Case) -> tuple[str, ...]:
    if case.get("contiguous"):
        return ("bhsd", "bhsd")
    return tuple(case["states"].split(",")) if "states" in case else DEFAULT_STATES


def cropped_by(case: Case) -> int:
    """Positions beyond `past` in the buffer the cache is a view of (`cropped`: an int, or
    True for 3, as edge cases written before it counted said)."""
    extra = case.get("cropped", 0)
    return 3 if extra is True else int(extra)


STATIC = "static"


def make_static_case(batch: int, kv_heads: int, head_dim: int, new: int, dtype: str) -> Case:
    """StaticLayer.update appending `new` positions at the cache's on-device position."""
    return {"batch": int(batch), "kv_heads": int(kv_heads), "head_dim": int(head_dim),
            "new": int(new), "dtype": dtype, "layout": STATIC}


def is_static(case: Case) -> bool:
    return case.get("layout") == STATIC


def static_geometry(case: Case) -> tuple[int, int]:
    """(slots, position) of a static case's inputs: by default the write lands inside the
    buffer, with stale slots on both sides (a kernel that writes at 0 or at the end, or
    copies the whole buffer out of place, differs from the reference)."""
    slots = case.get("slots", case["new"] + 11)
    return slots, case.get("position", min(5, slots - case["new"]))


def params(case: Case) -> dict:
    """The append has no scalar params (dim -2 is the layout itself)."""
    return {}


def _past(case: Case, device, generator) -> torch.Tensor:
    """The cached part as HF holds it: `torch.tensor([])` before anything is cached; else
    contiguous, or (`cropped`) the leading positions of a longer buffer, as `crop` leaves it
    (the pipeline's decode runner crops back to `seq` after every step)."""
    dtype = torch_dtype(case["dtype"])
    if case["past"] == 0:
        return torch.tensor([], dtype=dtype, device=device)
    b, h, d, past = case["batch"], case["kv_heads"], case["head_dim"], case["past"]
    gen_device = generator.device if generator is not None else "cpu"
    extra = cropped_by(case)
    x = torch.randn((b, h, past + extra, d), generator=generator, device=gen_device)
    return x.to(device=device, dtype=dtype)[:, :, :past]


def _static_buffer(case: Case, slots: int, device, generator) -> torch.Tensor:
    """A StaticLayer's keys or values: contiguous, allocated once (stale values past the
    position: random here, so a kernel that leaves them alone is told from one that zeroes)."""
    gen_device = generator.device if generator is not None else "cpu"
    x = torch.randn((case["batch"], case["kv_heads"], slots, case["head_dim"]),
                    generator=generator, device=gen_device)
    return x.to(device=device, dtype=torch_dtype(case["dtype"]))


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(keys, values, key_states, value_states): the cache before the call and the new states
    in the case's layouts (`states_of`; contiguous where the case says `contiguous`); those in
    "qkv" are column blocks of one fused projection. Static layout: (keys, values, key_states,
    value_states, position), the buffers of `slots` positions and the 0-d int64 position on
    the device (`static_geometry`)."""
    if is_static(case):
        states = {**case, "seq": case["new"]}
        slots, position = static_geometry(case)
        keys = _static_buffer(case, slots, device, generator)
        values = _static_buffer(case, slots, device, generator)
        key_states = random_heads(states, case["kv_heads"], device, generator)
        value_states = random_heads(states, case["kv_heads"], device, generator)
        return (keys, values, key_states, value_states,
                torch.tensor(position, dtype=torch.long, device=device))
    keys = _past(case, device, generator)
    values = _past(case, device, generator)
    layouts = states_of(case)
    fused = None
    if "qkv" in layouts:
        b, s, d = case["batch"], case["new"], case["head_dim"]
        gen_device = generator.device if generator is not None else "cpu"
        fused = torch.randn((b, s, (case["heads"] + 2 * case["kv_heads"]) * d),
                            generator=generator, device=gen_device)
        fused = fused.to(device=device, dtype=torch_dtype(case["dtype"]))
    new = []
    for role, layout in enumerate(layouts):
        if layout == "qkv":
            stride, offset = _strides("qkv", role, case)
            new.append(fused.as_strided(_shape(case), stride, offset))
        else:
            states = {**case, "seq": case["new"], "contiguous": layout == "bhsd"}
            new.append(random_heads(states, case["kv_heads"], device, generator))
    return (keys, values, *new)


def make_out(case: Case, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous, as cat returns them for these layouts (static: the buffers' shape)."""
    if is_static(case):
        return torch.empty_like(inputs[0]), torch.empty_like(inputs[1])
    states = inputs[2]
    shape = (case["batch"], case["kv_heads"], case["past"] + case["new"], case["head_dim"])
    return (torch.empty(shape, dtype=states.dtype, device=states.device),
            torch.empty(shape, dtype=states.dtype, device=states.device))


def edge_cases(case: Case) -> list[Case]:
    """Variations a candidate rendered for `case` must survive: kv_heads and head_dim are baked
    into it, batch and both lengths stay free. A one-token decode step after a cached prefix;
    batch 1; a prime-length prefill from an empty cache; contiguous new states after a cached
    prefix; a cropped (strided) cache: for a decode case, the case itself with the cache a view
    of a one position longer buffer, the very layout every step after the first sees in the
    pipeline's decode runner (which crops back after each step), so the kernel dispatched for
    the case is verified on both layouts it gets. Static layout: a write at slot 0, one that
    ends at the last slot, several new positions (a prefill into the static cache), batch 3."""
    if is_static(case):
        return distinct(case, [
            {**case, "new": 1, "slots": 9, "position": 0},
            {**case, "new": 1, "slots": 9, "position": 8},
            {**case, "batch": 3, "new": 5, "slots": 12, "position": 4},
            {**case, "batch": 1, "contiguous": True},
        ])
    cropped = {**case, "cropped": 1} if case["past"] else \
        {**case, "batch": 2, "past": 6, "new": 1, "cropped": 1}
    cases = [
        {**case, "past": 13, "new": 1},
        {**case, "batch": 1},
        {**case, "batch": 3, "past": 0, "new": 7},
        {**case, "batch": 2, "past": 5, "new": 3, "contiguous": True},
        cropped,
    ]
    return distinct(case, cases)


def min_bytes(case: Case) -> int:
    """Keys and values: the cached and the new positions read once, all of them written once
    (static: the new positions only, read once and written in place)."""
    if is_static(case):
        rows = case["batch"] * case["kv_heads"] * case["new"]
        return 2 * 2 * rows * case["head_dim"] * element_size(case)
    rows = case["batch"] * case["kv_heads"] * (case["past"] + case["new"])
    return 2 * 2 * rows * case["head_dim"] * element_size(case)


def flops(case: Case) -> int:
    return 0
