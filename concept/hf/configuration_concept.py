"""The ``config.json`` of an exported concept model, as a transformers ``PretrainedConfig``.

This file is part of the ``concept`` library (``concept.hf.configuration_concept``) and is copied
into every ``concept export`` folder, where ``config.json``'s ``auto_map`` names the class of the
folder's kind. It needs transformers only. The model itself is described by the folder's
``concept.json`` (its build plan); this config holds what Hugging Face tools read: the kind of
model, the library version that wrote it and the backbone's sizes.
"""
from transformers import PretrainedConfig


class ConceptConfig(PretrainedConfig):
    """Any concept model (a family without a class of its own below)."""

    model_type = "concept"
    kinds = ()  # the model kinds (a family's name, or dense / pruned) this class describes; () = any

    def __init__(self, concept_kind=None, concept_version=None, vocab_size=None, hidden_size=None,
                 num_hidden_layers=None, max_position_embeddings=None, **kwargs):
        self.concept_kind = concept_kind or (self.kinds[0] if self.kinds else None)
        self.concept_version = concept_version  # the concept library that wrote the folder
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers  # the exported backbone's (a pruned one's kept layers)
        self.max_position_embeddings = max_position_embeddings
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class ConceptStreamingConfig(ConceptConfig):
    """The streaming family: online concept compression (shallow / middle / deep stacks)."""

    model_type = "concept_streaming"
    kinds = ("streaming",)


class ConceptPlannerExecutorConfig(ConceptConfig):
    """The planner-executor family: the LLM plans typed concepts, then writes text from the plan alone."""

    model_type = "concept_planner_executor"
    kinds = ("planner-executor",)


class ConceptBaselineConfig(ConceptConfig):
    """The dense and pruned baselines: the backbone (with LoRA), a pruned one without its removed layers."""

    model_type = "concept_baseline"
    kinds = ("dense", "pruned")


CONFIG_CLASSES = (ConceptStreamingConfig, ConceptPlannerExecutorConfig, ConceptBaselineConfig)


def config_class(kind: str) -> type:
    """The config class of a model kind (``ConceptConfig`` for a family without one of its own)."""
    return next((c for c in CONFIG_CLASSES if kind in c.kinds), ConceptConfig)
