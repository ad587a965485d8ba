"""What a backbone plugin provides, and uniform access to a HF decoder's parts.

A backbone plugin class has a ``Config`` dataclass and two classmethods:

* ``describe(config) -> BackboneInfo`` — cheap (reads metadata, loads no weights); used to
  validate the split before anything heavy happens.
* ``load(config) -> LoadedBackbone`` — the Hugging Face causal LM (Llama / Qwen2 / Mistral
  style: ``model.model.layers``, ``embed_tokens``, ``norm``, ``rotary_emb``, ``lm_head``)
  and its tokenizer, if it has one.
"""
from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from .errors import BackboneError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3")


@dataclass
class BackboneInfo:
    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    pretrained: bool  # False: random init, weights are saved with the run


@dataclass
class LoadedBackbone:
    model: nn.Module  # a transformers *ForCausalLM
    tokenizer: Any | None
    info: BackboneInfo


def info_from_hf_config(cfg: Any, name: str, pretrained: bool) -> BackboneInfo:
    arch = getattr(cfg, "model_type", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise BackboneError(
            f"backbone '{name}' has architecture '{arch}'; supported decoder architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return BackboneInfo(
        name=name,
        architecture=arch,
        num_layers=int(cfg.num_hidden_layers),
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
        max_positions=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        pretrained=pretrained,
    )


def read_folder_config(folder: Path) -> dict:
    """Read ``config.json`` of a local HF folder with a clear error when it is missing or corrupt."""
    path = folder / "config.json"
    if not folder.is_dir():
        raise BackboneError(f"backbone folder {folder} does not exist")
    if not path.is_file():
        raise BackboneError(f"backbone folder {folder} has no config.json; is it a Hugging Face model folder?")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BackboneError(f"backbone folder {folder}: config.json is unreadable ({exc}); re-download or re-convert it") from exc


# -- parts of a loaded decoder ---------------------------------------------------------------

def decoder(model: nn.Module) -> nn.Module:
    """The inner decoder (``LlamaModel`` etc.) of a ``*ForCausalLM``."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise BackboneError(f"{type(model).__name__} has no .model.layers; not a supported decoder-only LM")
    return inner


def layers(model: nn.Module) -> nn.ModuleList:
    return decoder(model).layers


def run_layers(layers, x, position_ids, attention_plan, rotary_emb, checkpointing=False, cache=None, run=None,
               cos_sin=None):
    """Call the backbone's own decoder layers, unchanged, with one attention plan and RoPE table
    (and a KV cache the layers update, when decoding). ``run``: what calls each layer (default
    :func:`run_layer`). ``cos_sin``: the RoPE table of ``position_ids`` for ``x``'s dtype when the caller
    built it already (:func:`rope_tables`); None: built here. (``--compile layers`` loops over the layers
    itself, each through :func:`run_layer_rope` compiled: ``concept.compiled.CompiledStacks``.)"""
    cos_sin = rotary_emb(x, position_ids) if cos_sin is None else cos_sin
    run = run or run_layer
    for layer in layers:
        x = run(layer, x, position_ids, attention_plan, cos_sin, checkpointing, cache)
    return x


def run_layer_rope(layer, x, position_ids, attention_plan, rotary_emb, checkpointing=False, cache=None):
    """:func:`run_layer` with the RoPE table of ``position_ids`` built first, from ``rotary_emb``: what
    ``--compile layers`` compiles, so the table is computed inside each layer's graph (a few fused elementwise
    kernels of [B, L, head_dim] per layer) instead of eagerly between the graphs (8 aten ops per stack)."""
    return run_layer(layer, x, position_ids, attention_plan, rotary_emb(x, position_ids), checkpointing, cache)


def rope_tables(rotary_emb, x, position_ids: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The RoPE tables (cos, sin) of several position id tensors ([B, n_i] each) for inputs like ``x``, built in one
    call of the backbone's ``rotary_emb`` over their concatenation and split after: the same values as one call
    each (a table is elementwise in the positions). A rotary embedding whose frequencies follow the longest
    position (transformers' ``dynamic`` / ``longrope`` types) is called once for each."""
    kind = str(getattr(rotary_emb, "rope_type", "default"))
    if "dynamic" in kind or "longrope" in kind:
        return [rotary_emb(x, p) for p in position_ids]
    cos, sin = rotary_emb(x, torch.cat(position_ids, dim=1))
    sizes = [p.shape[1] for p in position_ids]
    return list(zip(cos.split(sizes, 1), sin.split(sizes, 1)))


def run_layer(layer, x, position_ids, attention_plan, cos_sin, checkpointing=False, cache=None):
    """One decoder layer of :func:`run_layers`."""
    kwargs = dict(attention_mask=attention_plan, position_ids=position_ids, position_embeddings=cos_sin)
    if cache is not None:
        kwargs[cache_keyword(type(layer))] = cache
    if checkpointing:
        return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, **kwargs)
    return layer(x, **kwargs)


@functools.lru_cache(maxsize=None)
def cache_keyword(layer_class) -> str:
    """The KV-cache argument of a decoder layer: ``cache`` (transformers >= 5.x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(layer_class.forward).parameters else "past_key_values"
