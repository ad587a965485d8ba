"""The contract of each plugin kind, as base classes (docs/plugins.md, §2 "What each kind's class must provide").

A component derives from its kind's base (the registry checks it at lookup: ``concept.registry``), and from a
capability mixin for each optional capability it has. The core asks ``isinstance(policy, RatioControlled)``,
not ``hasattr(policy, "null_bias")``. The torch-module kinds (length policy, sampler, vocabulary, position
scheme, tail fusion) are also ``torch.nn.Module`` subclasses: ``class MyPolicy(LengthPolicy, nn.Module)``.

Standard library only: the family modules (imported by ``concept train --help``) derive from :class:`Family`,
so this module imports no torch. The bases define no ``__init__``; ``nn.Module``'s runs as usual.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from .errors import ConfigError


class Pluggable:
    """What every plugin class but a family may have: the members its kind requires (checked at lookup), and
    working defaults for the checks a build and ``plugins list --check`` ask of it."""

    required: tuple[str, ...] = ()  # the members a plugin of the kind must define (checked at lookup)

    @classmethod
    def check_compatible(cls, config, components) -> list[str]:
        """Problems of this plugin with the others of a build (``components``: slot -> resolved), or []."""
        return []

    @staticmethod
    def unavailable_reason() -> str:
        """Why it cannot run here (``plugins list --check`` shows it as ``limited: ...``), or ""."""
        return ""


class Component(Pluggable):
    """What every component (of every kind but the family and the backbone) may have; each default is a
    working no-op.

    ``Config``: its options dataclass (none: it takes no options, ``concept.config.NoOptions``).
    ``learning_rate``: the learning rate of its parameters (None: the trainer's ``--lr-new``)."""

    learning_rate: float | None = None

    def init_from_backbone(self, token_embedding) -> None:
        """Called once after construction with the backbone's token-embedding weight (e.g. to match its scale)."""


# -- length policies -------------------------------------------------------------------------------

class LengthPolicy(Component):
    """Where concepts are emitted. ``decide(h, head_logits, valid, reset=None) -> keep [B, T] bool`` for whole
    sequences; ``init_state(batch_size, device)`` and ``step(h_t, head_logits_t, state) -> (keep_t, state)``
    for decoding, agreeing exactly with ``decide``.

    ``uses_null_class``: the concept head has K+1 classes, NULL last. ``reads_hidden``: its decision reads the
    shallow state ``h`` (calibration keeps it). ``learned_placement``: ``keep`` thresholds a trainable per-token
    score (``--placement``). ``emit``: concept slots per emitting token. ``max_boundary_rate``: the most
    boundaries per real token the rule emits whatever the text (a rule that bounds its own rate, e.g. one every
    ``every`` tokens: the static budget ``max_ratio=auto`` takes, ``concept.streaming.budget``); None: no such
    bound."""

    required = ("decide", "init_state", "step")
    uses_null_class: bool = True
    reads_hidden: bool = False
    learned_placement: bool = False
    emit: int = 1
    max_boundary_rate: float | None = None

    def decide(self, h, head_logits, valid, reset=None):
        raise NotImplementedError

    def init_state(self, batch_size: int, device):
        raise NotImplementedError

    def step(self, h_t, head_logits_t, state):
        raise NotImplementedError


class DecidesWithState:
    """A length policy whose batched decision also returns the state after the last token
    (``decide_with_state(h, head_logits, valid, reset=None) -> (keep, state)``): decoding starts from it after a
    prefill instead of replaying ``step`` over the prompt."""

    def decide_with_state(self, h, head_logits, valid, reset=None):
        raise NotImplementedError


class RatioControlled:
    """A length policy whose concepts-per-token ratio a bias sets: a ``null_bias`` buffer and
    ``keep_logit(head_logits, h)`` (log-odds the bias shifts). The ratio controller and the build's calibration
    move the bias (``concept.streaming.ratio``). Optional: ``bias_for_ratio(head_logits, h, valid, target)``, where
    the ratio is not P(keep logit >= bias). Its ``decide`` and ``decide_with_state`` (and ``bias_for_ratio``) take
    ``keep_logit=``: that score already computed (the model computes it once per forward), the same answer as
    without it."""

    bias_for_ratio = None  # (a method where the policy has one)

    def keep_logit(self, head_logits, h=None):
        raise NotImplementedError

    def keep_logit_given(self, keep_logit, head_logits, h=None):
        """``keep_logit`` where the forward already computed it, else ``keep_logit(head_logits, h)`` computed here."""
        return self.keep_logit(head_logits, h) if keep_logit is None else keep_logit


class DifferentiableBoundary:
    """A length policy with ``boundary_prob(head_logits, h, keep_logit=None)``: the differentiable keep probability
    the ratio loss reads (``--ratio-control loss``); ``keep_logit``: the policy's keep score (``RatioControlled``)
    already computed, which the probability is then read from."""

    def boundary_prob(self, head_logits, h=None, keep_logit=None):
        raise NotImplementedError


class TracksRatio:
    """A length policy that holds a ``target_ratio`` buffer (its per-document tracker aims at it); the trainer
    and the calibration point it at their target (``concept.streaming.gap.set_target``). ``track``: its
    per-document tracker's gain; above 0 the tracker holds each document near the target, which earns it the
    tighter ``max_ratio=auto`` budget (``concept.streaming.budget.TRACKED``); 0: no tracker (``UNTRACKED``)."""

    track: float = 0.0


class Gated:
    """A length policy with a soft boundary ``gate(h, head_logits, keep, valid, reset) -> [B, T]``: in training
    each concept input is multiplied by ``1 + g - stopgrad(g)`` so the LM loss reaches the policy."""

    def gate(self, h, head_logits, keep, valid, reset=None):
        raise NotImplementedError


class ReadsPredictor:
    """A length policy that reads the backbone's next-token distribution: the model binds
    ``policy.predictor(h) -> next-token logits`` (its norm + LM head) at construction."""


# -- samplers ----------------------------------------------------------------------------------------

class Sampler(Component):
    """``forward(logits) -> probs`` over the K concept ids (the hard choice is ``probs.argmax(-1)``).
    ``straight_through``: ``e = e_hard + (e_soft - stopgrad(e_soft))`` (True) or the hard embedding alone (False).
    ``hard = False``: the concept input is the soft mixture itself."""

    required = ("forward",)
    straight_through: bool = True
    hard: bool = True


class Tempered:
    """A sampler with a temperature ``tau`` that its family's objectives anneal (``--tau-start`` / ``--tau-end``:
    ``concept.objectives.TemperatureSchedule``). Its forward divides by ``temperature``, a tensor (a buffer, not
    saved) that setting ``tau`` fills in place: a forward compiled whole (``--compile model``) reads it as an input,
    so a schedule changing it every step recompiles nothing, where a Python float would be a constant of the graph.
    Call :meth:`init_temperature` in ``__init__``; ``tau`` reads back the number last set (no device read)."""

    _tau: float = 1.0

    def init_temperature(self, tau: float) -> None:
        import torch  # (here: this module imports no torch at import time)

        self.register_buffer("temperature", torch.tensor(float(tau)), persistent=False)
        self.tau = tau

    @property
    def tau(self) -> float:
        return self._tau

    @tau.setter
    def tau(self, value: float) -> None:
        changed, self._tau = float(value) != self._tau, float(value)
        if changed and "temperature" in getattr(self, "_buffers", {}):  # (unchanged: no op launched)
            self.temperature.fill_(self._tau)


class Mixes:
    """A sampler with latent feedback ``mix(e, h) -> e'``, applied to every concept input (``h``: the emitting
    token's shallow state)."""

    def mix(self, e, h):
        raise NotImplementedError


# -- vocabularies ------------------------------------------------------------------------------------

class Vocabulary(Component):
    """``size`` (K), ``logits(h) -> [..., K (+1)]``, ``embed_hard(ids)``, ``embed_soft(probs_k)``. ``levels`` > 1:
    a concept is that many code tokens, and the three methods take a ``level`` argument."""

    required = ("logits", "embed_hard", "embed_soft")
    levels: int = 1

    def logits(self, h):
        raise NotImplementedError

    def embed_hard(self, ids):
        raise NotImplementedError

    def embed_soft(self, probs):
        raise NotImplementedError


class Revivable:
    """A vocabulary whose codes can be re-initialised (``--revive-after``, ``--kmeans-init``): ``query(h,
    before=None)`` (the direction its head compares with the codes) and ``set_codes(level, ids, directions)``."""

    def query(self, h, before=None):
        raise NotImplementedError

    def set_codes(self, level: int, ids, directions) -> None:
        raise NotImplementedError


# -- position schemes, attention, tail fusions, backbones ----------------------------------------------

class PositionScheme(Component):
    """``text_positions(pos)``, ``concept_positions(pos, rank, stack)`` (stack: "middle" or "deep"); the type
    embeddings ``add_text_type(x)`` / ``add_concept_type(x)`` return their input unchanged by default."""

    required = ("text_positions", "concept_positions")

    def text_positions(self, pos):
        raise NotImplementedError

    def concept_positions(self, pos, rank, stack: str):
        raise NotImplementedError

    def add_text_type(self, x):
        return x

    def add_concept_type(self, x):
        return x


class AttentionBackend(Component):
    """A plain object: ``plan(layout) -> concept.attention.AttentionPattern`` for the deep stack's packed layout.
    ``supports_backward``: it trains. ``check_trainable(device) -> str``: a reason it cannot train there, or "".
    ``plans_deep_block``: its ``plan`` also takes a ``concept.packing.DeepBlock`` (a static layout's concepts and
    tail in one block, the boundary per row): the model then runs the deep stack over that block instead of the
    layout's wider ``[concepts ; tail]`` (``docs/plugins.md``)."""

    required = ("plan",)
    supports_backward: bool = True
    plans_deep_block: bool = False

    def plan(self, layout):
        raise NotImplementedError

    @staticmethod
    def check_trainable(device) -> str:
        return ""


class TailFusion(Component):
    """``forward(tail, update, has) -> [B, L, d]``: a tail token's deep-stack input from its shallow state and its
    segment's latest concept's middle update. ``needs_update = False``: the model skips computing the updates;
    ``flops_per_token``: its extra FLOPs per tail token."""

    required = ("forward",)
    needs_update: bool = True
    flops_per_token: float = 0.0


class Backbone(Pluggable):
    """Never instantiated: classmethods ``describe(config) -> BackboneInfo`` (cheap, loads no weights) and
    ``load(config) -> LoadedBackbone`` (``concept.backbone``)."""

    required = ("describe", "load")

    @classmethod
    def describe(cls, config):
        raise NotImplementedError

    @classmethod
    def load(cls, config):
        raise NotImplementedError


# -- families ------------------------------------------------------------------------------------------

@dataclass
class FlopTarget:
    """What a FLOP-matched pruned baseline must match (``Family.matched_flops``): forward FLOPs as a fraction of
    the dense backbone's at ``seq_len`` tokens, the layer its removed block starts at, the concept ratio the
    fraction stands for (if any), and a phrase naming the operating point for people."""

    flop_ratio: float
    first_layer: int
    seq_len: int
    about: str
    target_ratio: float | None = None


class Family:
    """A model family (``concept.families`` entry points; docs/plugins.md §8 "Write a family"). The registry
    makes it with no arguments. A minimal family sets ``name`` (its entry point's name) and defines ``build``;
    with options of its own, also ``section`` and ``settings``. Every other member has a working default.

    ``section``: its build-config section (``--set SECTION.KEY=VALUE``; saved in ``concept.json``), or None.
    ``build_section``: the option dataclass of its build options with flags (``concept.options``; its
    ``ComponentRef`` fields are component slots resolved from the registry, its ``name`` its key in a build config,
    e.g. ``concept.streaming.section.StreamingSection``), or None: only what it names is resolved, written,
    printed and inspected. ``defaults``: component names it builds with unless the user
    chose others. ``checks_components``: whether the components' ``check_compatible`` vetoes apply to its builds.
    ``stacks``: its model has shallow / middle / deep stacks and a concept ratio. ``training``: the option
    dataclass of the training options only it reads (``concept.options.FamilyOptions``), or None.
    ``build_options``: the option dataclass of the ``concept build`` flags only it reads (their values reach
    ``finish_build``), or None. ``decodes``: what ``concept generate`` can show of its decoding (``concepts``,
    ``mtp``, ``plan``)."""

    required = ("name", "build")
    name: str = ""
    section: str | None = None
    build_section: type | None = None
    defaults: dict[str, str] = {}
    checks_components: bool = False
    stacks: bool = False
    training: type | None = None
    build_options: type | None = None
    decodes: tuple[str, ...] = ()

    # -- building ----------------------------------------------------------------------------------
    def settings(self, options: dict, components: dict) -> tuple[Any, list[str]]:
        """Parse and check its section's ``options``: (settings, problems). Default: no options."""
        if options:
            return None, [f"{self.section}.{k}: unknown option (the {self.name} family has none)" for k in sorted(options)]
        return None, []

    def build(self, plan, loaded) -> Any:
        """The model (an ``nn.Module`` with ``family`` = this family's name, ``resolution`` (the build resolution
        given here), ``backbone``, ``new_modules()``, ``new_state_dict()``, and a forward returning ``logits`` and
        ``loss``) from a build resolution (``concept.config.BuildResolution``) and a loaded backbone."""
        raise NotImplementedError

    def finish_build(self, model, options, given: set, say) -> dict:
        """With ``build_options``: finish a freshly built model before it is saved; returns what ``concept build
        --json`` adds."""
        return {}

    def structure(self, plan) -> dict[str, Any]:
        """What ``concept build`` shows of a resolved plan: named sections of JSON data. Default: its section's
        settings, or nothing."""
        if self.section and plan.settings is not None and hasattr(plan.settings, "to_dict"):
            return {self.section: plan.settings.to_dict()}
        return {}

    def describe(self, model) -> str:
        """One sentence for people: what this model is."""
        return f"a {self.name} model"

    def inspect(self, model, request) -> dict[str, Any]:
        """What ``concept inspect`` shows beyond the backbone, parameters and components (named sections)."""
        return {}

    # -- training ----------------------------------------------------------------------------------
    def check_training(self, config, plan, device, dist) -> list[str]:
        """Problems of a ``TrainConfig`` for this family (empty: fine)."""
        return []

    def prepare(self, model, train: dict) -> None:
        """Set what a run's train.json says the model was trained for onto a built or loaded model."""

    def objectives(self, config, model, step, notes: list) -> list:
        """The objectives a ``TrainConfig`` asks for. Default: the shared ones (``concept.objectives.common``)."""
        # lazy: torch (this module is imported by `concept train --help`)
        from .objectives import common

        return common(config)

    def plots(self, name: str, rows: list[dict], out) -> None:
        """Write the family's own plots of a run's metrics into the run folder ``out``."""

    # -- decoding and evaluation -------------------------------------------------------------------
    def decoder(self, model):
        """The step-wise decoder ``concept.generation`` drives. Default: :class:`concept.decoding.ReplayDecoder`
        (the model's whole forward again at each step: exact, and slow for long outputs)."""
        # lazy: torch (this module is imported by `concept train --help`)
        from .decoding import ReplayDecoder

        return ReplayDecoder(model)

    def step_diagnostics(self, model, out, batch) -> dict[str, float]:
        """Cheap statistics of a training micro-batch, logged every ``--log-every`` steps."""
        return {}

    def evaluate(self, model, batches, bucket: int, controls: bool, seed: int) -> dict | None:
        """Held-out evaluation of its own, or None: the core's NLL."""
        return None

    def score(self, model, context, context_valid, continuation, continuation_valid):
        """Logits whose position k predicts continuation token k, or None: the core's causal forward."""
        return None

    def compile_refusal(self, model) -> str | None:
        """Why ``--compile`` cannot run ``model`` (one line naming the problem and the fix), or None: it runs its
        layer stacks through ``model.compiled_stacks`` when that is set (``concept.compiled``), with shapes that do
        not depend on the data. Default: a refusal naming the family. Under ``--compile model`` it is asked before
        every call of the model's whole-forward graph (``concept.compiled.WholeForward``: a refusal runs that call
        eagerly), so it is also where the host values that graph reads as constants are brought up to date. A family
        that compiles returns its tensors where ``concept.compiled.copied_out`` finds them (dataclass fields,
        containers, a ``concept.lazy.Deferred``'s named inputs, not a closure's): on CUDA a no-grad call's output is
        copied out of the CUDA graphs' memory that way, and what it misses the next call overwrites."""
        return (f"the {self.name} family does not compile its model (it does not implement "
                f"Family.compile_refusal); leave --compile off")

    # -- derived from another run (``concept train RUN --baseline NAME``) --------------------------
    def derive(self, config, source: dict, plan) -> tuple[Any, Any, list[str]]:
        """A run of this family derived from the run whose build config is ``source`` (resolved as ``plan``),
        trained with ``config``: (its ``BuildConfig``, the training config it trains with, notes for the user).
        Default: this family is not a baseline another run can derive (``concept.baselines`` are)."""
        raise ConfigError([f"baseline: the {self.name} family is not derived from another run; choose one of "
                           f"the baselines (dense, pruned)"])

    # -- as the source of a FLOP-matched baseline ------------------------------------------------
    def static_shapes(self, plan) -> bool:
        """Whether a model of this resolved build reads nothing back to the host to shape its tensors (a static
        budget): its baselines (``--baseline``) then build their masks the same way. Default: no."""
        return False

    def matched_flops(self, plan, config, shape) -> FlopTarget | None:
        """What a pruned baseline FLOP-matched to a run of this build trained with ``config`` (a ``TrainConfig``)
        must match (``concept train RUN --baseline pruned``): a :class:`FlopTarget` at ``config.seq_len`` tokens
        (``shape``: the backbone's ``concept.flops.Shape``), or None: the family has no such operating point, and
        the user chooses the block (``--prune-layers START:STOP``)."""
        return None


# kind -> base class (``concept.registry.KINDS``); a component that does not derive from it is refused at lookup
BASES: dict[str, type] = {
    "backbone": Backbone,
    "length_policy": LengthPolicy,
    "sampler": Sampler,
    "position_scheme": PositionScheme,
    "vocabulary": Vocabulary,
    "attention": AttentionBackend,
    "tail_fusion": TailFusion,
    "family": Family,
}


def missing_members(cls: type, base: type) -> list[str]:
    """The members of ``base.required`` that ``cls`` leaves undefined: absent, empty, or only the base's own (or
    ``torch.nn.Module``'s unimplemented ``forward``)."""
    found = []
    for member in base.required:
        owner = next((k for k in cls.__mro__ if member in vars(k)), None)
        value = vars(owner)[member] if owner is not None else None
        if owner is None or owner is base or value in ("", None) or (
                getattr(value, "__name__", "") == "_forward_unimplemented"):
            found.append(member)
    return found
