"""Resolve a model id to a config and build the model for a workload.

Order: a local folder with config.json; a zoo name; the Hugging Face hub (config only, unless
`pretrained`); and when the hub cannot be reached, the zoo entry the id stands for, said aloud.
Random weights are the default: kernel timings do not depend on weight values.
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UserError
from models.zoo import ZOO, zoo_name

HUB_HOST = "huggingface.co"


@dataclass
class ModelSpec:
    model_id: str
    source: str  # "zoo", "local", "hub", "zoo (hub unreachable)"
    weights: str  # "random" or "pretrained"
    config: object
    notes: list[str] = field(default_factory=list)

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def name(self) -> str:
        """What a run directory and a report title call the model: a local folder's own name,
        not the whole path that `model_id` keeps to build it again."""
        return Path(self.model_id).resolve().name if self.source == "local" else self.model_id

    def describe(self) -> dict:
        cfg = self.config
        return {
            "id": self.model_id, "name": self.name, "source": self.source,
            "weights": self.weights,
            "model_type": cfg.model_type, "notes": self.notes,
            "num_layers": getattr(cfg, "num_hidden_layers", None),
            "hidden_size": getattr(cfg, "hidden_size", None),
            "config": {k: v for k, v in cfg.to_diff_dict().items()
                       if isinstance(v, (int, float, str, bool, list, dict, type(None)))},
        }


def hub_reachable(timeout: float = 3.0) -> bool:
    """A plain TCP check: transformers retries for ~25 s before giving up on a dead network."""
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True"):
        return False
    try:
        socket.create_connection((HUB_HOST, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def zoo_config(name: str):
    from transformers import AutoConfig

    params = dict(ZOO[name])
    model_type = params.pop("model_type")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoConfig.for_model(model_type, **params, **_ids_in_vocab(model_type, params))


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _ids_in_vocab(model_type: str, params: dict) -> dict:
    """Special token ids for a shrunk vocabulary: a tiny config keeps its class's defaults
    (GPT-2's 50256), which transformers warns about on every build when the vocabulary is
    smaller. The last id of the vocabulary stands in; weights are random, so no id means
    anything."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging

    vocab = params.get("vocab_size")
    if not vocab:
        return {}
    level = logging.get_verbosity()
    logging.set_verbosity_error()  # a class's defaults may warn about themselves (Starcoder2's)
    try:
        defaults = CONFIG_MAPPING[model_type]()
    finally:
        logging.set_verbosity(level)
    return {k: vocab - 1 for k in _TOKEN_IDS if k not in params
            and isinstance(getattr(defaults, k, None), int) and getattr(defaults, k) >= vocab}


def looks_like_path(model_id: str) -> bool:
    """A local path rather than a hub id (`org/name`) or a built-in name: it starts like a
    path, has more than one slash, exists, or its first part is a local folder (`runs/typo`
    beside `runs/` is a mistyped run directory, not a hub id)."""
    path = Path(model_id)
    return (model_id.startswith(("/", "./", "../", "~", "\\")) or model_id.count("/") > 1
            or model_id in (".", "..") or path.exists()
            or (len(path.parts) > 1 and path.parent.is_dir()))


def validation_reason(e: BaseException) -> str:
    """The reason a config was refused, on one line. transformers' strict validators raise an
    error whose first line names only the validator; its cause holds the reason."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts += [x.strip() for x in str(e).splitlines()
                  if x.strip() and not any(x.strip() in p for p in parts)]
        e = e.__cause__ or e.__context__
    return " ".join(parts) or "invalid config"


def _config(load, model_id: str):
    try:
        return load()
    except (OSError, UserError):
        raise
    except Exception as e:  # noqa: BLE001 - config classes raise validator-specific errors
        raise UserError(f"invalid config for {model_id}: {validation_reason(e)}") from None


def _json_or_error(path: Path) -> None:
    """A config.json that is not JSON is the user's to fix: one line saying where."""
    import json

    try:
        json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" (line {e.lineno}, column {e.colno})" if hasattr(e, "lineno") else ""
        raise UserError(f"{path} is not valid JSON{where}: "
                        f"{getattr(e, 'msg', None) or e.reason}") from None


def resolve(model_id: str, pretrained: bool = False) -> ModelSpec:
    from transformers import AutoConfig

    path = Path(model_id)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UserError(f"{model_id} is a folder without config.json")
        _json_or_error(path / "config.json")
        cfg = _config(lambda: AutoConfig.from_pretrained(path), model_id)
        return ModelSpec(model_id, "local", "pretrained" if pretrained else "random", cfg)
    if looks_like_path(model_id):
        raise UserError(f"no such directory: {model_id}" if not path.exists() else
                        f"{model_id} is a file; pass the folder that holds config.json")
    name = zoo_name(model_id)
    if name == model_id.lower() and name in ZOO and not pretrained:
        return ModelSpec(name, "zoo", "random", zoo_config(name))
    if not hub_reachable():
        if pretrained:
            raise UserError(f"--pretrained needs the Hugging Face hub, which is unreachable "
                            f"(no network?); drop --pretrained to profile {model_id} "
                            f"with random weights")
        if name:
            return ModelSpec(name, "zoo (hub unreachable)", "random", zoo_config(name),
                             [f"hub unreachable: using the built-in config for {name}"])
        raise UserError(f"unknown model {model_id!r}: not in the built-in zoo and the Hugging "
                        f"Face hub is unreachable; a local folder with the model's config.json "
                        f"works offline; built-in: {', '.join(sorted(ZOO))}")
    try:
        cfg = AutoConfig.from_pretrained(model_id)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError/ValueError/HTTP errors
        if name:
            return ModelSpec(name, "zoo (hub error)", "random", zoo_config(name),
                             [f"hub could not give {model_id}: {str(e).splitlines()[0]}"])
        raise UserError(f"unknown model {model_id!r}: {str(e).splitlines()[0]}") from None
    return ModelSpec(model_id, "hub", "pretrained" if pretrained else "random", cfg)


def build(spec: ModelSpec, dtype, device: str):
    """Build on the target device directly: CPU-side init of a 7B model takes minutes."""
    from transformers import AutoModelForCausalLM

    if spec.weights == "pretrained":
        model = AutoModelForCausalLM.from_pretrained(spec.model_id, dtype=dtype)
        return model.to(device).eval()
    cfg = spec.config
    # Gemma-2 (its attention logit soft-capping) and a few others have no SDPA path in
    # transformers: such a model is built with its eager attention, and the notes say so
    for attention in ("sdpa", "eager"):
        if hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = attention
        try:
            return _from_config(spec, cfg, dtype, device)
        except ValueError as e:
            if attention == "eager" or "scaled_dot_product_attention" not in str(e):
                raise UserError(f"cannot build {spec.model_id}: {str(e).splitlines()[0]}") \
                    from None
        note = "no SDPA attention in transformers for this model: built with eager attention"
        if note not in spec.notes:
            spec.notes.append(note)


def parameter_count(spec: ModelSpec) -> int:
    """The model's parameters, counted on the meta device: no memory, no initialisation."""
    import torch
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(spec.config)
    return sum(p.numel() for p in model.parameters())


def _from_config(spec: ModelSpec, cfg, dtype, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except torch.OutOfMemoryError:
        raise UserError(f"out of memory building {spec.model_id} on {device}") from None
    return model.eval()
