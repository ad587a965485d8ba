"""The streaming family's diagnostics (docs/diagnostics.md): the concept statistics of a training step and
of a held-out evaluation, the ΔNLL controls and the depth decomposition.

* :func:`step_diagnostics` — signals from tensors the training step already holds (no extra forward):
  realised ratio, head entropy / max-prob, P(keep), concept-usage perplexity and fraction,
  cos(e_soft, e_hard).
* :func:`evaluate` — the core's held-out NLL (``concept.diagnostics.evaluate_tokens``) plus
  :class:`ConceptEvaluation`: the same concept statistics over the whole evaluation, the identity start's
  gate norm and, with ``controls``, the ΔNLL controls (the concepts' whole inputs shuffled across the batch
  or rebuilt from random ids; their discrete codes alone shuffled or removed) and the depth decomposition.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from ..contracts import DifferentiableBoundary
from ..diagnostics import evaluate_tokens, pair_nll, real_mask


# -- concept statistics ----------------------------------------------------------------------
def _concept_stats(m, out, valid: torch.Tensor) -> dict:
    """Sums (not means) of the per-position concept signals of one forward output, so that several batches can be
    aggregated exactly: 0-dim tensors and histograms on the output's device, nothing read back (the head's signals
    are computed on :func:`emitting_rows`, as many a row as the budget allows, and the emitting ones masked in, not
    selected: the shapes follow the batch's and the budget's, not the decisions). :func:`_finish_concept_stats` reads
    them."""
    vocab = m.vocabulary
    K = int(vocab.size)
    keep = out.keep.bool() & valid
    kept = keep.sum()
    stats = {"real": valid.sum(), "kept": kept,
             # concepts: a policy's emit per emitting token (a multi-level concept is one concept of L slots)
             "concepts": kept * (m.emit // m.levels),
             "histogram": _histogram(out.concept_ids, keep, K)}
    codes = getattr(out, "codes", None)
    if codes is not None:  # multi-level codes: a histogram per level (a collapsed level reads perplexity 1)
        stats["level_histograms"] = torch.stack([_histogram(codes[..., level], keep, K)
                                                 for level in range(codes.shape[-1])])
    policy = m.length_policy
    if isinstance(policy, DifferentiableBoundary):
        p = policy.boundary_prob(out.head_logits, getattr(out, "shallow", None),
                                 keep_logit=getattr(out, "keep_logit", None)).float()  # (the forward's score)
        stats["boundary_sum"] = torch.where(valid, p, 0.0).sum()
    rows = emitting_rows(m, keep)  # [B, k]: every emitting token among them, k fixed by the budget
    at = keep.gather(1, rows)
    head = out.head_logits.gather(1, rows[..., None].expand(-1, -1, out.head_logits.shape[-1]))
    logp = torch.log_softmax(head[..., :K].float(), dim=-1)
    probs = logp.exp()
    e_soft = vocab.embed_soft(probs).float()
    e_hard = vocab.embed_hard(out.concept_ids.gather(1, rows).clamp(min=0)).float()
    emitted = lambda x: torch.where(at, x, 0.0).sum()  # noqa: E731
    stats["entropy_sum"] = emitted(-(probs * logp).sum(-1))
    stats["max_prob_sum"] = emitted(probs.max(-1).values)
    stats["cos_sum"] = emitted(F.cosine_similarity(e_soft, e_hard, dim=-1, eps=1e-12))
    return stats


def emitting_rows(m, keep: torch.Tensor) -> torch.Tensor:
    """[B, k] positions of each row that hold all its emitting tokens (``keep`` [B, T]), k fixed by the row's length
    and the model's static budget (the most boundaries a row keeps: ``concept.packing.budget``), T without one: the
    emitting tokens first (``topk`` of ``keep``), then as many others, which the caller masks out. The rows the concept
    statistics compute on, where selecting ``keep``'s would read its count back."""
    T = keep.shape[1]
    slots = m.concept_slots(T)  # (a static layout's slots: ``emit`` a boundary)
    k = slots // m.emit if slots else T
    if k == T:
        return torch.arange(T, device=keep.device).expand(keep.shape[0], T)
    return keep.to(torch.float32).topk(k, dim=1, sorted=False).indices


def _histogram(ids: torch.Tensor, keep: torch.Tensor, K: int) -> torch.Tensor:
    """How often each of the K ids was emitted: ``ids`` [B, T] (-1: none) where ``keep``; on their device."""
    counted = keep & (ids >= 0) & (ids < K)
    return torch.zeros(K, dtype=torch.long, device=ids.device).index_add_(
        0, ids.clamp(0, K - 1).flatten().long(), counted.flatten().long())


def _merge(total: dict | None, stats: dict) -> dict:
    if total is None:
        return dict(stats)
    for key, value in stats.items():
        total[key] = total[key] + value if key in total else value
    return total


def _usage(histogram: torch.Tensor, K: int) -> tuple[float, float]:
    """(perplexity of the id histogram, distinct ids used / K)."""
    n = histogram.sum()
    if n == 0:
        return float("nan"), 0.0
    p = histogram.double() / n
    nz = p[p > 0]
    return float(torch.exp(-(nz * nz.log()).sum())), float((histogram > 0).sum()) / K


def _finish_concept_stats(total: dict, K: int) -> dict[str, float]:
    """The concept statistics' means from :func:`_concept_stats`' sums (read from the device here)."""
    names = [k for k in ("real", "kept", "concepts", "entropy_sum", "max_prob_sum", "cos_sum", "boundary_sum")
             if k in total]
    values = dict(zip(names, torch.stack([total[k].double() for k in names]).tolist()))  # (one read for these)
    kept, real = values["kept"], values["real"]
    nan = float("nan")
    result = {
        "ratio": values["concepts"] / real if real else nan,  # concepts per token
        "head_entropy": values["entropy_sum"] / kept if kept else nan,
        "max_prob": values["max_prob_sum"] / kept if kept else nan,
    }
    if "boundary_sum" in values:
        result["boundary_prob"] = values["boundary_sum"] / real if real else nan
    result["usage_perplexity"], result["usage_fraction"] = _usage(total["histogram"].cpu(), K)
    for level, histogram in enumerate(total["level_histograms"].cpu() if "level_histograms" in total else ()):
        result[f"usage_perplexity/level{level}"] = _usage(histogram, K)[0]
    result["cos_soft_hard"] = values["cos_sum"] / kept if kept else nan
    return result


# -- training-step signals ------------------------------------------------------------------
def step_diagnostics(model, out, batch) -> dict[str, float]:
    """Cheap signals from tensors the training step already has (``concept.diagnostics.step_diagnostics``
    lists them); empty for an output without keep decisions."""
    if getattr(out, "keep", None) is None:
        return {}
    with torch.no_grad():
        valid = real_mask(batch, out.keep)
        return {**_finish_concept_stats(_concept_stats(model, out, valid), int(model.vocabulary.size)),
                **gate_norm(model)}


def gate_norm(model) -> dict[str, float]:
    """``gate_norm``: the RMS of the identity start's gate on the discrete embedding (``h + gate * e``; 0 when
    built: the discrete path opens as it trains); nothing without an identity start."""
    gate = model.concept_gate
    return {} if gate is None else {"gate_norm": float(gate.gate.detach().float().pow(2).mean().sqrt())}


# -- held-out evaluation ----------------------------------------------------------------------
CONTROLS = ("shuffle", "random", "codes_shuffled", "codes_zero")  # delta_nll_<name>: whole inputs, then codes only
def _control(name: str, model, out, valid: torch.Tensor, K: int, generator: torch.Generator):
    """A ΔNLL control: a function replacing the concepts' *whole* inputs before the middle stack
    (the continuous part of an identity start or a latent-feedback sampler included, so the
    control cannot read ≈ 0 while the concepts carry everything).

    shuffle: the inputs permuted among all concept slots of the batch.
    random: each slot's input rebuilt from a uniform random concept id and a random real token's
    shallow state (what the model would feed for a random concept emitted at a random token)."""
    def shuffle(c, slots):
        flat = c[slots]
        out_c = c.clone()
        out_c[slots] = flat[torch.randperm(len(flat), generator=generator).to(c.device)]
        return out_c

    def random(c, slots):
        B, C = slots.shape
        tokens = valid.nonzero()
        pick = tokens[torch.randint(len(tokens), (B * C,), generator=generator).to(tokens.device)]
        h = out.shallow[pick[:, 0], pick[:, 1]].view(B, C, -1)
        level = out.layout.concept_level  # multi-level codes: one random code for each slot's level
        ids = torch.randint(0, K, (B, C) if level is None else (B, C, model.levels), generator=generator).to(c.device)
        probs = torch.nn.functional.one_hot(ids, K).to(h.dtype)
        src = torch.arange(C, device=c.device).expand(B, C)
        return torch.where(slots[..., None], model.concept_inputs(probs, ids, src, h, level).to(c.dtype), c)

    return {"shuffle": shuffle, "random": random}[name]


def _code_control(name: str, generator: torch.Generator):
    """A code-only ΔNLL control: a function replacing the concepts' discrete embeddings only, each slot keeping
    its continuous part (the identity start's shallow state, a latent-feedback sampler's mix), so the two
    read what the discrete id itself carries.

    codes_shuffled: the embeddings permuted among the batch's concept slots (among the slots of one code
    level with multi-level codes): each slot reads another slot's id.
    codes_zero: the embeddings removed (zero): each slot keeps its continuous part alone."""
    def codes_shuffled(e, valid, level):
        out = e.clone()
        for at in [valid] if level is None else [valid & (level == lv) for lv in level[valid].unique().tolist()]:
            flat = e[at]
            out[at] = flat[torch.randperm(len(flat), generator=generator).to(e.device)]
        return out

    def codes_zero(e, valid, level):
        return torch.where(valid[..., None], torch.zeros_like(e), e)

    return {"codes_shuffled": codes_shuffled, "codes_zero": codes_zero}[name]


def _pair_sum(nll: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The float64 sum of ``nll`` where ``at``, on their device (masked in, not selected: nothing read back)."""
    return torch.where(at, nll.double(), 0.0).sum()


def _depth_split(depth: dict, nll, pair, keep, paths: dict) -> None:
    """Add to ``depth`` the NLL sums of the model (``nll``) and of the reference ``paths`` at the
    positions that emitted a concept and at tail positions (the position predicting t + 1); on the device."""
    for part, at in (("concept", pair & keep[:, :-1]), ("tail", pair & ~keep[:, :-1])):
        depth[f"{part}_n"] += at.sum()
        depth[part] += _pair_sum(nll, at)
        for name, x in paths.items():
            depth[f"{part}_{name}"] += _pair_sum(x, at)


class ConceptEvaluation:
    """What a streaming model adds to the core's held-out evaluation (``concept.diagnostics.evaluate_tokens``
    calls :meth:`add` after each batch's forward and merges :meth:`result`): the concept statistics over the
    whole evaluation and, with ``controls``, the ΔNLL controls and the depth decomposition."""

    def __init__(self, model, controls: bool, seed: int):
        self.model, self.controls = model, controls
        self.K = int(model.vocabulary.size)
        self.generator = torch.Generator().manual_seed(seed)
        self.code_generator = torch.Generator().manual_seed(seed + 1)  # (the whole-input controls' draws unchanged)
        self.stats = None
        self.control_sum = dict.fromkeys(CONTROLS, 0.0)  # (sums on the device once added to)
        self.depth: dict = defaultdict(float)  # NLL sums and counts at concept / tail positions (on the device)

    def add(self, forward, out, input_ids, valid, doc, kwargs: dict, nll, pair) -> None:
        model = self.model
        self.stats = _merge(self.stats, _concept_stats(model, out, valid))
        if not self.controls:
            return
        keep, batch_sum = out.keep.bool() & valid, _pair_sum(nll, pair)
        for name in CONTROLS:
            if name.startswith("codes_"):
                bad = forward(input_ids, keep=keep, perturb_codes=_code_control(name, self.code_generator), **kwargs)
            else:
                bad = forward(input_ids, keep=keep, perturb=_control(name, model, out, valid, self.K, self.generator),
                              **kwargs)
            self.control_sum[name] += _pair_sum(pair_nll(bad.logits, input_ids, valid, doc)[0], pair) - batch_sum
        with model.budget_off():  # every token a concept: more than a static budget holds
            keep_all = pair_nll(forward(input_ids, keep=valid, **kwargs).logits, input_ids, valid, doc)[0]
        _depth_split(self.depth, nll, pair, keep, {
            "keep_all": keep_all,
            "skip_middle": pair_nll(model.skip_middle(input_ids, valid.long(), doc), input_ids, valid, doc)[0]})

    def result(self, count: int) -> dict:
        nan, K = float("nan"), self.K
        none = torch.zeros(())
        stats = self.stats or {"real": none, "kept": none, "concepts": none, "entropy_sum": none, "max_prob_sum": none,
                               "cos_sum": none, "histogram": torch.zeros(K, dtype=torch.long)}
        result = {"concepts": int(stats["concepts"]), **_finish_concept_stats(stats, K)}
        if self.model.mtp_heads is not None:
            result["mtp_tau"] = self.model.length_policy.tau  # the confidence threshold the ratio control reached
        result.update(gate_norm(self.model))
        if self.controls:
            sums = {k: float(v) for k, v in {**{f"control_{k}": v for k, v in self.control_sum.items()},
                                             **self.depth}.items()}
            for name in CONTROLS:
                result[f"delta_nll_{name}"] = sums[f"control_{name}"] / count if count else nan
            for part in ("concept", "tail") if self.depth else ():
                n = sums[f"{part}_n"]
                for path in ("", "_keep_all", "_skip_middle"):
                    result[f"nll_{part}s{path}"] = sums[f"{part}{path}"] / n if n else nan
        return result


def evaluate(model, batches, bucket: int, controls: bool, seed: int) -> dict:
    """The held-out evaluation of a streaming model (``concept.diagnostics.evaluate`` documents its keys)."""
    return evaluate_tokens(model, batches, bucket, ConceptEvaluation(model, controls, seed))
