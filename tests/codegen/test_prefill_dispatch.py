"""A model patched with a decode-only run's kernels pays nothing at its prefill beyond a few
Python calls per patched module: the prefill's shapes have no kernel, so each adapter must send
the call to the original code without reading a device value on the host (a synchronisation
that stalls an eager prefill until the GPU drains), without an extra aten op (a copy, a kernel)
and without its full checks once the chooser declined the signature
(`core.family.kernel_by_signature`'s `declines`). The same holds for an eager decode step
through transformers' generate (the `ours` variant of `pipeline e2e`): no extra host read.

The model: a two-layer Llama wide enough that every decode family engages (q/k/v widths the
GEMV families take unpadded). Counted on it with transformers 5.25 (python calls made by the
patched prefill beyond the unpatched one, all ten families of a decode-only run, 48 patched
forwards called): 798 while each adapter ran its full checks before its chooser's answer, 372
once they decline by signature first; MAX_EXTRA_CALLS_PER_FORWARD sits between the two."""

from __future__ import annotations

import collections
import importlib
import sys

import pytest
import torch
from family_checks import CountingChooser
from torch.utils._python_dispatch import TorchDispatchMode

from codegen.search import case_key
from core.workload import Workload
from models.graphs import StaticDecoder, host_reads

FAMILIES = ("rmsnorm", "rope", "gemv", "kv_cache", "decode_attention", "matmul_epilogue",
            "add_rmsnorm", "qkv_proj", "norm_qkv", "norm_gate_up")
BATCH, PROMPT, MAX_LEN = 2, 8, 32
# per patched forward called in the prefill, python and builtin calls beyond the unpatched
# prefill's: 7.75 measured (the instance forward's indirection, the adapter, the signature lookup
# and the trace check inside it); 16.6 when each adapter ran its full checks first
MAX_EXTRA_CALLS_PER_FORWARD = 10


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                         max_position_embeddings=512, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _decode_only(family, model, folder):
    """A chooser with kernels for the decode step's cases alone, as a run optimized for
    decode workloads gives; it counts what it served."""
    step = Workload(BATCH, MAX_LEN, "float32", "cpu", "decode")
    keys = {case_key(c) for c in family.cases_from_model(model, step)}
    assert keys, f"{family.name} has no decode case in the test model"
    served = CountingChooser(family, folder)

    def chooser(case):
        return served(case) if case_key(case) in keys else None
    chooser.served = served
    return chooser


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(unpatched, patched with every family's decode-only kernels, {family: chooser})."""
    from pipeline.patching import twin

    plain = _model()
    patched = twin(plain)
    choosers = {}
    for name in FAMILIES:
        family = importlib.import_module(f"codegen.{name}").FAMILY
        choosers[name] = _decode_only(family, patched, tmp_path_factory.mktemp(name))
        family.patch(patched, choosers[name])
    return plain, patched, choosers


IDS = torch.randint(3, 500, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))


def _warm_decoder(model) -> StaticDecoder:
    """A static-cache decoder whose prefill ran twice (the first initialises the cache's
    layers; the second is a generation's next prefill, every signature asked once)."""
    dec = StaticDecoder(model, BATCH, MAX_LEN, graph=False)
    with torch.no_grad():
        dec.prefill(IDS)
        dec.prefill(IDS)
    return dec


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _aten_ops(fn) -> list[str]:
    mode = _Ops()
    with torch.no_grad(), mode:
        fn()
    return mode.ops


def _python_calls(fn) -> collections.Counter:
    """Python and builtin calls made by fn(), by (file, function)."""
    calls = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            calls[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
        elif event == "c_call":
            calls[("builtin", getattr(arg, "__qualname__", repr(arg)))] += 1

    sys.setprofile(profile)
    try:
        with torch.no_grad():
            fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_decode_only_patch_adds_no_host_read_and_no_op_to_the_prefill(models):
    plain, patched, choosers = models
    base, ours = _warm_decoder(plain), _warm_decoder(patched)
    for c in choosers.values():
        c.served.calls = 0
    assert host_reads(lambda: ours.prefill(IDS), as_captured=False) == \
        host_reads(lambda: base.prefill(IDS), as_captured=False)
    # the whole logits: every projection, the LM head included, has prefill rows
    assert _aten_ops(lambda: ours.prefill(IDS)) == _aten_ops(lambda: base.prefill(IDS))
    assert {n: c.served.calls for n, c in choosers.items()} == dict.fromkeys(FAMILIES, 0)


def test_a_declined_prefill_costs_a_few_python_calls_per_patched_forward(models):
    plain, patched, choosers = models
    base, ours = _warm_decoder(plain), _warm_decoder(patched)
    got = _python_calls(lambda: ours.prefill(IDS))
    want = _python_calls(lambda: base.prefill(IDS))
    # every adapter's forward is an instance forward (models.patching)
    forwards = sum(n for (path, name), n in got.items()
                   if name == "forward" and path.endswith("models/patching.py"))
    assert forwards >= 2 * len(plain.model.layers) * 4  # norms, attention, projections, MLP
    extra = sum(got.values()) - sum(want.values())
    assert extra <= MAX_EXTRA_CALLS_PER_FORWARD * forwards, (
        extra, forwards, (got - want).most_common(15))


def test_the_eager_decode_step_adds_no_host_read(models):
    """transformers' generate over the patched model (the `ours` variant): the steps' kernels
    run and read no device value on the host that the unpatched model's steps do not."""
    plain, patched, choosers = models
    kwargs = {"max_new_tokens": 3, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    for model in (plain, patched):  # warm: every signature asked once
        with torch.no_grad():
            model.generate(IDS, **kwargs)
    for c in choosers.values():
        c.served.calls = 0
    ours = host_reads(lambda: patched.generate(IDS, **kwargs), as_captured=False)
    assert sum(c.served.calls for c in choosers.values()) > 0
    assert collections.Counter(ours) == collections.Counter(
        host_reads(lambda: plain.generate(IDS, **kwargs), as_captured=False))


def test_a_static_decode_step_reads_nothing_on_the_host(models):
    """The step `ours-graphs` captures, run eagerly with every family's kernel."""
    _, patched, choosers = models
    dec = _warm_decoder(patched)
    with torch.no_grad():
        dec.step(IDS[:, :1])
    dec.rewind(PROMPT)
    for c in choosers.values():
        c.served.calls = 0
    assert host_reads(lambda: dec.step(IDS[:, :1])) == []
    assert sum(c.served.calls for c in choosers.values()) > 0
