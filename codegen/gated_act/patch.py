"""Patching the fused gated activation into a model: per MLP instance, reversible.

An MLP qualifies when its class name ends in "MLP", it has the HF projections (gate_proj,
up_proj, down_proj, act_fn; or Phi-3's gate_up_proj, down_proj, activation_fn), its activation
is SiLU or tanh-GELU, and its class's `forward` is, statement for statement, the code of
`LlamaMLP.forward` or `Phi3MLP.forward` (compared as syntax trees, docstrings aside). The last
check keeps a lookalike MLP with extra terms (a scale, dropout) on its own code instead of
silently changing what it computes.

The replacement forward is set on the instance (never the class: a class-level patch leaks into
every model built later in the process) and asks `forward_by_case(case)` once per input
signature (shape, dtype; core.family.kernel_by_signature), so a kernel accepted for one workload
only runs on that workload's shapes.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from codegen.dtypes import dtype_name
from codegen.gated_act.reference import make_case, params
from core.family import Case, kernel_by_signature
from models.patching import code_shape, needs_graph, set_instance_forwards

MLP_CLASS = re.compile(r"MLP$")
# The one [gate; up] GEMM (`GateUp`) runs only on calls of at most this many tokens: up to
# 1024 tokens it beats the two GEMMs on every measured shape (a launch fewer, a wider GEMM),
# and from 2048-4096 tokens cuBLAS runs the wider product in another kernel that loses on the
# wider models (benchmarks/probes/README.md, `gate_up_gemm.py`). Above the cut the MLP runs
# HF's own two GEMMs, so the patch never slows the GEMMs it does not replace.
GATE_UP_MAX_TOKENS = 1024
_SILU_CLASSES = ("SiLUActivation",)
_GELU_TANH_CLASSES = ("GELUTanh", "PytorchGELUTanh")


@dataclass(frozen=True)
class GatedMLP:
    path: str
    module: nn.Module
    act: str  # "silu" or "gelu_tanh"
    layout: str  # "separate" (gate_proj, up_proj) or "packed" (gate_up_proj)
    cols: int  # intermediate size


def activation_kind(act: nn.Module) -> str | None:
    name = type(act).__name__
    if isinstance(act, nn.SiLU) or name in _SILU_CLASSES:
        return "silu"
    if name in _GELU_TANH_CLASSES or (isinstance(act, nn.GELU) and act.approximate == "tanh"):
        return "gelu_tanh"
    return None


@cache
def _known_forwards() -> dict[str, str]:
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    return {"separate": code_shape(LlamaMLP.forward), "packed": code_shape(Phi3MLP.forward)}


@cache
def _class_form(cls: type) -> str | None:
    try:
        shape = code_shape(cls.forward)
    except (OSError, TypeError):  # no source (compiled or built-in forward)
        return None
    return next((layout for layout, known in _known_forwards().items() if known == shape), None)


def find_gated_mlps(model: nn.Module) -> list[GatedMLP]:
    found = []
    for path, module in model.named_modules():
        if not MLP_CLASS.search(type(module).__name__):
            continue
        layout = _class_form(type(module))
        if layout == "separate":
            act_module, cols = module.act_fn, module.gate_proj.out_features
        elif layout == "packed":
            act_module, cols = module.activation_fn, module.gate_up_proj.out_features // 2
        else:
            continue
        act = activation_kind(act_module)
        if act is not None:
            found.append(GatedMLP(path, module, act, layout, cols))
    return found


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """Every MLP of a model sees tokens x intermediate; prefill has batch x seq tokens, a decode
    step one per sequence (`workload.tokens`)."""
    cases = []
    lead = (workload.batch, workload.tokens // workload.batch)
    for mlp in find_gated_mlps(model):
        case = make_case(workload.tokens, mlp.cols, workload.dtype, mlp.act, mlp.layout,
                         lead=lead, operands=_operands(mlp, workload.tokens))
        if case not in cases:
            cases.append(case)
    return cases


def _operands(mlp: GatedMLP, tokens: int) -> str | None:
    """What the separate-layout adapter hands the kernel on a call of `tokens` tokens: the
    column halves of the fused [gate; up] product where the projections fuse (`GateUp`, up to
    GATE_UP_MAX_TOKENS), else two tensors."""
    if mlp.layout != "separate":
        return None
    fuse = tokens <= GATE_UP_MAX_TOKENS and GateUp.fusable(mlp.module.gate_proj,
                                                           mlp.module.up_proj)
    return "halves" if fuse else "separate"


def _resolver(mlp: GatedMLP, forward_by_case: Callable) -> Callable:
    """(input shape, dtype, operands) -> (kernel or None, its params), once per signature. The
    case records the layout this call hands the kernel, so a kernel runs only on the layout it
    was verified for (the unfused fallback of a fusable MLP is a case of its own)."""

    def case_of(shape: torch.Size, dtype: torch.dtype, operands: str | None = None) -> Case:
        return make_case(shape.numel() // shape[-1], mlp.cols, dtype_name(dtype), mlp.act,
                         mlp.layout, lead=tuple(shape[:-1]), operands=operands)

    return kernel_by_signature(forward_by_case, case_of, params)


class _FusedWeights:
    """One [gate; up] buffer for a pair of weight Parameters, shared by every patch over those
    same Parameters. Twins (`pipeline.patching.twin`) share Parameters, and the integrate and
    graphs stages patch two twins at once: a second buffer would re-point the Parameters again,
    so the first twin's MLPs would find their fusion gone and run two GEMMs (its timing then
    not what the user's patched model runs). The storage the Parameters had before the first
    patch is given back, so capture CUDA graphs of any twin after patching the others."""

    def __init__(self, gate: nn.Parameter, up: nn.Parameter):
        self.weight = torch.cat([gate.detach(), up.detach()])
        rows = gate.shape[0]
        gate.data, up.data = self.weight[:rows], self.weight[rows:]
        self.key = (id(gate), id(up))
        self.params = weakref.ref(gate), weakref.ref(up)
        self.ptrs = (gate.data_ptr(), up.data_ptr())
        self.users = 0

    def holds(self, gate: nn.Parameter, up: nn.Parameter) -> bool:
        """Still these Parameters' storage (nobody gave them new storage meanwhile)."""
        return (self.params[0]() is gate and self.params[1]() is up
                and (gate.data_ptr(), up.data_ptr()) == self.ptrs)

    def release(self) -> None:
        """One user fewer; the last gives each Parameter its own storage back."""
        self.users -= 1
        if self.users:
            return
        if _FUSED.get(self.key) is self:
            del _FUSED[self.key]
        for ref, ptr in zip(self.params, self.ptrs):
            param = ref()
            if param is not None and param.data_ptr() == ptr:  # still a view of the buffer
                param.data = param.data.clone()
        self.weight = None


# (id(gate.weight), id(up.weight)) -> their live buffer (checked with `holds`: ids are reused)
_FUSED: dict[tuple[int, int], _FusedWeights] = {}


class GateUp:
    """gate_proj and up_proj of one MLP as one [gate; up] weight, so the patched MLP runs one
    GEMM where HF runs two: one linear fewer for the host to dispatch per layer (what decides
    a launch-bound pass, where this family otherwise costs more host time than the two aten
    ops it replaces) and a wider GEMM at batch 1. The kernel reads the two column halves of
    the product in place.

    No second copy of the weights: while patched, the two parameters (same objects, same
    values) hold views of the fused buffer (`_FusedWeights`, one per pair of Parameters however
    many patches use it); `split()` gives each its own storage back once the last patch over
    them is undone. A parameter given new storage meanwhile (`.to()`, reassignment), or a hook
    on either projection, shows as `intact() == False`, and the MLP runs its two projections
    again."""

    def __init__(self, gate: nn.Linear, up: nn.Linear):
        self.gate, self.up = gate, up
        key = (id(gate.weight), id(up.weight))
        fused = _FUSED.get(key)
        if fused is None or not fused.holds(gate.weight, up.weight):
            fused = _FUSED[key] = _FusedWeights(gate.weight, up.weight)
        fused.users += 1
        self._fused = fused

    @property
    def weight(self) -> torch.Tensor | None:
        return self._fused.weight if self._fused is not None else None

    @staticmethod
    def fusable(gate, up) -> bool:
        return (type(gate) is nn.Linear and type(up) is nn.Linear and gate.bias is None
                and up.bias is None and gate.in_features == up.in_features
                and gate.weight.dtype == up.weight.dtype
                and gate.weight.device == up.weight.device)

    def intact(self) -> bool:
        """Still fused, and nobody hooks the projections (a user's hook, or accelerate's that
        brings offloaded weights in, must see its module called)."""
        g, u = self.gate, self.up
        return (self._fused is not None and self._fused.holds(g.weight, u.weight)
                and not (g._forward_hooks or g._forward_pre_hooks or u._forward_hooks
                         or u._forward_pre_hooks))

    def split(self) -> None:
        if self._fused is not None:
            self._fused.release()
            self._fused = None


def _separate_forward(mlp: GatedMLP, forward_by_case: Callable, fused: GateUp | None):
    m = mlp.module
    resolve = _resolver(mlp, forward_by_case)
    cols = mlp.cols

    def forward(x):
        if (fused is not None and x.numel() <= GATE_UP_MAX_TOKENS * x.shape[-1]
                and fused.intact() and not needs_graph(x, m.gate_proj.weight)):
            kernel, kw = resolve(x.shape, x.dtype, "halves")
            if kernel is not None:
                gate_up = torch.nn.functional.linear(x, fused.weight)
                hidden = torch.empty((*x.shape[:-1], cols), dtype=gate_up.dtype,
                                     device=gate_up.device)
                kernel(gate_up[..., :cols], gate_up[..., cols:], out=hidden, **kw)
                return m.down_proj(hidden)
        gate = m.gate_proj(x)
        up = m.up_proj(x)
        kernel, kw = (None, None) if needs_graph(gate, up) else resolve(gate.shape, gate.dtype,
                                                                        "separate")
        if kernel is None:
            return m.down_proj(m.act_fn(gate) * up)
        hidden = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        kernel(gate, up, out=hidden, **kw)
        return m.down_proj(hidden)

    forward.returns_down_proj = "always"  # add_rmsnorm folds the residual add into it
    return forward


def _packed_forward(mlp: GatedMLP, forward_by_case: Callable) -> Callable:
    m = mlp.module
    resolve = _resolver(mlp, forward_by_case)

    def forward(hidden_states):
        gate_up = m.gate_up_proj(hidden_states)
        kernel, kw = (None, None) if needs_graph(gate_up) else resolve(gate_up.shape,
                                                                        gate_up.dtype)
        if kernel is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return m.down_proj(up * m.activation_fn(gate))
        hidden = torch.empty((*gate_up.shape[:-1], mlp.cols), dtype=gate_up.dtype,
                             device=gate_up.device)
        kernel(gate_up, out=hidden, **kw)
        return m.down_proj(hidden)

    forward.returns_down_proj = "always"
    return forward


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]):
    """Patch every qualifying MLP; separate gate/up projections are fused (`GateUp`). The undo
    restores the forwards and gives the projections their own weights back."""
    forwards, fusions = [], []
    for mlp in find_gated_mlps(model):
        if mlp.layout == "packed":
            forwards.append((mlp.module, _packed_forward(mlp, forward_by_case)))
            continue
        m = mlp.module
        fused = None
        if GateUp.fusable(m.gate_proj, m.up_proj):
            try:
                fused = GateUp(m.gate_proj, m.up_proj)
            except torch.OutOfMemoryError:  # no room for one layer's [gate; up]: run both
                fused = None
        fusions += [fused] if fused else []
        forwards.append((m, _separate_forward(mlp, forward_by_case, fused)))
    undo_forwards = set_instance_forwards(forwards)

    def undo() -> None:
        undo_forwards()
        for fused in fusions:
            fused.split()

    return undo
