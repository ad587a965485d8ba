"""Concept models as transformers ``PreTrainedModel`` classes (``AutoModelForCausalLM``, remote code).

This file is part of the ``concept`` library (``concept.hf.modeling_concept``) and is copied into
every ``concept export`` folder, where ``config.json``'s ``auto_map`` names the class of the
folder's kind, so that::

    model = AutoModelForCausalLM.from_pretrained("exports/m1", trust_remote_code=True)  # or a hub id

opens the concept model itself. The classes are thin on purpose: ``from_pretrained`` opens the
folder (or hub id) with ``concept.load`` (the same code path as the library, so the logits are
``concept.load``'s), and ``forward``, ``generate``, ``save_pretrained`` and ``push_to_hub`` call the
concept model. They need the ``concept`` library installed: it holds the families, the plugins and
the decoding the model is made of (transformers names the missing package when it is not there).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

import concept  # its public face only (concept.load, concept.generate, concept.hub): this file is copied into exports

from .configuration_concept import (
    ConceptBaselineConfig,
    ConceptConfig,
    ConceptPlannerExecutorConfig,
    ConceptStreamingConfig,
)

# what from_pretrained reads (the hub download) and what it takes from transformers' own loading arguments
HUB_ARGUMENTS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "subfolder")
IGNORED = ("trust_remote_code", "adapter_kwargs", "_from_auto", "_from_pipeline", "code_revision", "low_cpu_mem_usage",
           "use_safetensors", "attn_implementation")


@dataclass
class ConceptCausalLMOutput(ModelOutput):
    """``logits`` [B, T, V] (planner-executor: of the text it writes from its plan); ``loss`` with ``labels``;
    the streaming family's ``keep`` [B, T] (token t emitted a concept) and ``concept_ids`` [B, T] (-1 where not)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    keep: torch.BoolTensor | None = None
    concept_ids: torch.LongTensor | None = None


class ConceptForCausalLM(PreTrainedModel):
    """A concept model of any kind, opened with ``concept.load``; ``self.concept`` is that model."""

    config_class = ConceptConfig
    base_model_prefix = "concept"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: ConceptConfig, model=None):
        super().__init__(config)
        if model is None:
            raise concept.ConceptError(
                f"{type(self).__name__} wraps a saved concept model: open one with "
                f"{type(self).__name__}.from_pretrained(FOLDER_OR_HUB_ID) (a `concept export` folder); it cannot be "
                f"built from a config alone")
        self.concept = model

    # -- loading -----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, dtype=None, torch_dtype=None,
                        device_map=None, merge_lora: bool = False, **kwargs):
        """Open a ``concept export`` folder or hub id with ``concept.load`` (hub arguments: ``revision``,
        ``cache_dir``, ``token``, ``local_files_only``, ``force_download``, ``subfolder``); ``dtype`` (or
        ``torch_dtype``) ``torch.bfloat16`` runs it in bf16 as ``concept.load(..., dtype="bf16")`` does (another
        dtype casts the whole model), a device ``device_map`` (``"cpu"``, ``"cuda"``, ``"cuda:0"``) moves it, and
        ``merge_lora=True`` merges its LoRA adapters into the base weights (``concept.load``'s)."""
        hub_kwargs = {k: v for k in HUB_ARGUMENTS if (v := kwargs.pop(k, None)) is not None}
        for name in IGNORED:
            kwargs.pop(name, None)
        if model_args or kwargs:
            warnings.warn(f"{cls.__name__}.from_pretrained ignores {', '.join([*map(repr, model_args), *kwargs])}",
                          stacklevel=2)
        dtype = dtype if dtype is not None else torch_dtype
        # bf16 / fp32: concept's own precision (``concept.load``'s ``dtype``: a bf16 base under autocast, the adapters
        # and new modules fp32, as a bf16 run trained); "auto": as saved; another dtype: the whole model cast to it
        try:
            choice = None if dtype in (None, "auto") else concept.precision.dtype_choice(dtype)
        except concept.ConfigError:
            choice = None
        model = concept.load(pretrained_model_name_or_path, dtype=choice or "fp32", merge_lora=merge_lora, **hub_kwargs)
        kind = concept.hub.model_kind(model)
        kinds = cls.config_class.kinds
        if kinds and kind not in kinds:
            raise concept.ConceptError(f"{pretrained_model_name_or_path} holds a {kind} model, not one of {cls.__name__}'s "
                                       f"({', '.join(kinds)}); open it with AutoModelForCausalLM or concept.load")
        if choice is None and dtype not in (None, "auto"):
            model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        if device_map not in (None, "auto") and not isinstance(device_map, dict):
            model = model.to(device_map)
        if config is None or not isinstance(config, ConceptConfig):
            config = concept.hub.hf_config(model)
        return cls(config, model).eval()

    # -- running -----------------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, labels=None, return_dict=None, **kwargs):
        """The concept model's forward: ``labels`` (the input ids, as in transformers) give the mean
        next-token cross-entropy as ``loss``."""
        if input_ids is None:
            raise concept.ConceptError("a concept model reads token ids: pass input_ids (inputs_embeds is not supported)")
        out = self.concept(input_ids, attention_mask=attention_mask, labels=labels)
        result = ConceptCausalLMOutput(loss=out.loss, logits=out.logits, keep=getattr(out, "keep", None),
                                       concept_ids=getattr(out, "concept_ids", None))
        return result if return_dict is not False else result.to_tuple()

    def generate(self, inputs=None, attention_mask=None, **kwargs):
        """``concept.generate`` on the concept model: a prompt string (or list of them) gives the new text;
        token ids ([B, T] tensor) give the sequences as transformers' ``generate`` does (prompt, then the new
        tokens; rows that stop early are padded). Keyword arguments are ``concept.generation.GenerationSettings``
        fields (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``stop_strings``,
        ``seed`` ...) and ``streamer``."""
        inputs = kwargs.pop("input_ids", inputs)
        for name in ("pad_token_id", "use_cache", "generation_config"):  # transformers' own; concept decides these
            kwargs.pop(name, None)
        out = concept.generate(self.concept, inputs, attention_mask, **kwargs)
        return out if isinstance(out, (str, list)) else out.sequences

    def get_input_embeddings(self):
        return self.concept.backbone.get_input_embeddings()

    @property
    def tokenizer(self):
        return getattr(self.concept, "tokenizer", None)

    # -- saving ------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, force: bool = False, **kwargs):
        """Write the model as a ``concept export`` folder (``concept.hub.save_pretrained``); ``force``
        replaces a non-empty folder. transformers' saving options (shards, serialisation) do not apply."""
        return concept.hub.save_pretrained(self.concept, save_directory, force=force)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload the model as a ``concept export`` folder to the hub repo ``repo_id``
        (``concept.hub.push_to_hub``: ``private``, ``token``, ``revision``, ``commit_message``, ``dry_run``)."""
        return concept.hub.push_to_hub(self.concept, repo_id, **kwargs)


class ConceptStreamingForCausalLM(ConceptForCausalLM):
    """The streaming family; the output carries ``keep`` and ``concept_ids``."""

    config_class = ConceptStreamingConfig


class ConceptPlannerExecutorForCausalLM(ConceptForCausalLM):
    """The planner-executor family; ``logits`` are those of the text written from the plan (the whole
    row for a model trained to reconstruct it, the continuation after the context for ``--task continue``)."""

    config_class = ConceptPlannerExecutorConfig


class ConceptBaselineForCausalLM(ConceptForCausalLM):
    """The dense and pruned baselines (a pruned export's ``backbone/`` also loads with plain
    ``AutoModelForCausalLM``: its removed layers are deleted)."""

    config_class = ConceptBaselineConfig


MODEL_CLASSES = (ConceptStreamingForCausalLM, ConceptPlannerExecutorForCausalLM, ConceptBaselineForCausalLM)


def model_class(kind: str) -> type:
    """The model class of a model kind (``ConceptForCausalLM`` for a family without one of its own)."""
    return next((c for c in MODEL_CLASSES if kind in c.config_class.kinds), ConceptForCausalLM)
