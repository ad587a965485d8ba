"""The interfaces the model orchestration calls. Plugins implement them (duck-typed).

Every component class has a ``Config`` dataclass (see ``concept.config``) and is built by
``concept.builder`` as ``cls(config, ctx)`` where ``ctx`` is a :class:`BuildContext`.

Length policy (``nn.Module``)
    ``uses_null_class: bool`` — the concept head has K+1 classes (NULL last).
    ``decide(h, head_logits, valid, reset=None) -> keep``: batched decision for whole sequences [B, T].
    ``init_state(batch_size, device)`` / ``step(h_t, head_logits_t, state) -> (keep_t, state)``:
    the step-wise decision used in decoding; must agree exactly with ``decide``.
    Optional: ``decide_with_state`` (batched decision + final state, used after a prefill),
    ``keep_logit`` / ``boundary_prob`` / ``null_bias`` (ratio control), ``gate`` (a soft
    boundary for a straight-through path), ``needs_predictor`` (bind the backbone's LM head).

Sampler (``nn.Module``)
    ``forward(logits) -> probs``: soft (possibly perturbed) class probabilities; the hard
    decision is ``probs.argmax(-1)``. ``straight_through: bool`` selects
    ``e = e_hard + (e_soft - stopgrad(e_soft))`` (True) or hard only without gradient (False).
    Optional: ``hard = False`` (the input is the soft mixture), ``mix(e, h)`` (latent feedback),
    ``learning_rate`` (its own learning rate).

Vocabulary (``nn.Module``)
    ``size`` (K), ``logits(h) -> [.., K (+1)]``, ``embed_hard(ids)``, ``embed_soft(probs_k)``.

Position scheme (``nn.Module``)
    ``text_positions(pos)``, ``concept_positions(pos, rank, stack)`` with stack in
    {"middle", "deep"}, ``add_text_type(x)``, ``add_concept_type(x)``.

Attention backend (plain object)
    ``plan(layout) -> callable(query, key, value, scaling) -> out [B, L, H, hd]`` for the
    deep stack's packed layout (see ``concept.packing``). ``supports_backward: bool``.

Model family (:class:`Family`, a plain object; ``concept.families``)
    How a build config becomes a model and what training, evaluation, decoding and inspection
    do with it; the core asks the family and never names one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


def accumulation_dtype(dtype):
    """The dtype to compute softmaxes, norms and losses in: float32 for half precision (bf16 / fp16), the
    input's own for float32 and float64 (an fp64 model stays exact to ~1e-16, as its tests check)."""
    import torch

    return torch.promote_types(dtype, torch.float32)


def upcast(x):
    """``x`` in :func:`accumulation_dtype` (a no-op for float32 and float64)."""
    return x.to(accumulation_dtype(x.dtype))


def rms_normalize(h):
    """``h / rms(h)`` over the last dim (statistics in at least float32, result in h's dtype): what heads
    that should depend on a state's direction, not its norm, read (ConceptHead, codebook, threshold score)."""
    import torch

    return h * torch.rsqrt(upcast(h).pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)


@dataclass
class BuildContext:
    hidden_size: int
    vocab_size: int
    num_layers: int
    split: tuple[int, int, int]
    concept_vocab_size: int = 0  # K, filled once the vocabulary is built
    uses_null_class: bool = True
    num_types: int = 1  # concept types (the planner-executor family has one per plan type)


@dataclass
class InspectRequest:
    """What ``concept inspect`` asks a family about a loaded run: the run's records and the operating point of
    its ideal-FLOPs estimate."""

    record: dict  # concept.json
    train: dict | None  # train.json (None: not trained)
    ratio: float  # concepts per token
    seq_len: int  # tokens


class Family(Protocol):
    """A model family, registered in the ``concept.families`` entry-point group (docs/plugins.md, §1 "Kinds
    and entry-point groups"; docs/architecture.md, §0 "Code map"). The registry instantiates the class with
    no arguments.

    ``section``: the name of its build-config section (``--set SECTION.KEY=VALUE``; saved in
    ``concept.json`` as ``"SECTION": {...}``), or None when it has no options of its own.
    ``defaults``: component names it builds with unless the user chose others (``--family NAME``),
    e.g. ``{"position_scheme": "per-type"}``. ``checks_components``: whether the components'
    ``check_compatible`` vetoes apply to its builds (they describe the streaming forward). ``stacks``:
    whether its model has shallow / middle / deep stacks and a concept ratio (a FLOP-matched pruned baseline
    exists). ``training``: the option dataclass (``concept.options.FamilyOptions``) of the training options
    only it reads, or None; they join ``TrainConfig`` as flat flags and other kinds of run refuse them.
    ``build_options`` (optional): the option dataclass of the ``concept build`` flags only it reads (with a
    ``validate()`` and an ``inputs()``: the data they name), or None; a build of another family refuses them,
    and ``finish_build`` receives them after the model is built.
    ``decodes``: what ``concept generate`` can show of its decoding: ``concepts`` (marks where concepts were
    emitted, ``--show-concepts``), ``mtp`` (multi-token decoding, ``--mtp``), ``plan`` (``--show-plan``).
    """

    name: str
    section: str | None
    defaults: dict[str, str]
    checks_components: bool
    stacks: bool
    training: type | None
    decodes: tuple[str, ...]

    # -- building ------------------------------------------------------------------------------
    def settings(self, options: dict, components: dict) -> tuple[Any, list[str]]:
        """Parse and check its section's ``options`` against the resolved components: (settings, problems)."""

    def build(self, plan, loaded) -> Any:
        """Wire the model (an ``nn.Module`` with ``family``, ``plan``, ``backbone``, ``new_modules()``,
        ``new_state_dict()``, and a forward returning ``logits`` and ``loss``) from a resolved plan and a
        loaded backbone."""

    def finish_build(self, model, options, given: set, say) -> dict:
        """Only with ``build_options``: finish a freshly built model with them (e.g. the streaming family's
        calibration) before it is saved; ``given``: the options the user set; ``say(label, text)``: status
        for people. Returns what ``concept build --json`` adds to its output."""

    def structure(self, plan) -> dict[str, Any]:
        """Optional: what ``concept build`` (and its ``--dry-run``) shows of a resolved plan beyond the backbone,
        the parameters and the components: named sections of JSON data, drawn as ``inspect``'s are (e.g. the
        streaming family's ``stacks``). Without it: its section's settings (``{section: settings}``), or
        nothing for a family without a section (``concept.families.structure``)."""

    def describe(self, model) -> str:
        """One sentence for people (the model card, ``concept build``): what this model is."""

    def inspect(self, model, request: InspectRequest) -> dict[str, Any]:
        """What ``concept inspect`` shows beyond the backbone, parameters and components: named sections of
        JSON data (a dict of rows is drawn as a table titled by its name; the CLI draws some by name, e.g.
        ``stacks``, ``planner``, ``flops``, ``calibration``). ``components``: the slots it uses, when not all."""

    # -- training ------------------------------------------------------------------------------
    def check_training(self, config, plan, device, dist) -> list[str]:
        """Problems of a ``TrainConfig`` for this family (all at once; empty: fine)."""

    def prepare(self, model, train: dict) -> None:
        """Set what a run's train.json (``train``: a ``TrainConfig`` as a dict) says the model was trained for
        onto a freshly built or loaded model (e.g. a task)."""

    def objectives(self, config, model, step, notes: list) -> list:
        """The objectives and controllers a ``TrainConfig`` asks for (``concept.objectives``), in a fixed
        order; ``step()`` is the step about to be trained; ``notes`` collects what the user should read."""

    def plots(self, name: str, rows: list[dict], out) -> None:
        """Write the family's own plots of a run's metrics rows into the run folder ``out``."""

    # -- decoding and evaluation ---------------------------------------------------------------
    def decoder(self, model):
        """The step-wise decoder ``concept.generation`` drives (``prefill`` / ``step``)."""

    def step_diagnostics(self, model, out, batch) -> dict[str, float]:
        """Cheap statistics of a training micro-batch, logged every ``--log-every`` steps."""

    def evaluate(self, model, batches, bucket: int, controls: bool, seed: int) -> dict | None:
        """Held-out evaluation: the core's NLL (``concept.diagnostics.evaluate_tokens``, which takes what the family
        adds per batch) or the family's own; None: the core's alone."""

    def score(self, model, context, context_valid, continuation, continuation_valid):
        """Logits [B, Tx, V] whose position k predicts continuation token k given the context (right-padded id
        rows with their masks; ``concept.scoring``, what lm-eval asks), or None: the core's one causal forward
        over context + continuation."""
