"""Diagnostics for concept models (docs/diagnostics.md): cheap training signals and a held-out evaluation.

Three entry points, each documented with healthy / unhealthy readings in ``docs/diagnostics.md``:

* :func:`step_diagnostics` — signals from tensors the training step already holds (no extra
  forward): realised ratio, head entropy / max-prob, P(keep), concept-usage perplexity and
  fraction, cos(e_soft, e_hard).
* :func:`grad_norms` — gradient L2 norm per new-module group and for the LoRA adapters.
* :func:`evaluate` — held-out NLL (overall and by position bucket) plus, for a concept model,
  the same concept statistics aggregated over the whole evaluation and the two ΔNLL controls
  (concepts shuffled across the batch, concepts replaced by random ids).
* :func:`compression_map` — a rich ``Text`` showing which tokens became concepts.

Everything here works on any model whose forward returns an object with ``.logits``; the
concept-specific parts run only when the model has a ``length_policy`` (and the output
carries ``.keep`` / ``.concept_ids`` / ``.head_logits``).
"""
from __future__ import annotations

import inspect
import math
from collections import defaultdict

import torch
import torch.nn.functional as F

from . import packing
from .errors import ConfigError
from .families import family_of
from .losses import next_token_loss

LN2 = math.log(2.0)


# -- helpers --------------------------------------------------------------------------------
def _unwrap(model):
    """The model behind a DDP / FSDP-style wrapper (``.module``), else the model itself."""
    inner = getattr(model, "module", None)
    if inner is not None and not hasattr(model, "length_policy") and hasattr(inner, "forward"):
        return inner
    return model


def _is_concept_model(model) -> bool:
    return getattr(_unwrap(model), "length_policy", None) is not None


def _device(model) -> torch.device:
    try:
        return next(_unwrap(model).parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def _valid(batch, input_ids) -> torch.Tensor:
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    return mask.to(input_ids.device).bool()


def _concept_size(model) -> int:
    return int(_unwrap(model).vocabulary.size)


def _concept_stats(model, out, valid: torch.Tensor) -> dict:
    """Sums (not means) of the per-position concept signals of one forward output, so that
    several batches can be aggregated exactly. All on the output's device, in float32."""
    m = _unwrap(model)
    vocab = m.vocabulary
    K = int(vocab.size)
    keep = out.keep.bool() & valid
    ids = out.concept_ids[keep]
    ids = ids[ids >= 0]
    stats = {
        "real": int(valid.sum()),
        "kept": int(keep.sum()),
        # concepts: a policy's emit per emitting token (a multi-level concept is one concept of L slots)
        "concepts": int(keep.sum()) * (getattr(m, "emit", 1) // getattr(m, "levels", 1)),
        "histogram": torch.bincount(ids.long().flatten(), minlength=K)[:K].cpu(),
        "entropy_sum": 0.0,
        "max_prob_sum": 0.0,
        "cos_sum": 0.0,
    }
    codes = getattr(out, "codes", None)
    if codes is not None:  # multi-level codes: a histogram per level (a collapsed level reads perplexity 1)
        stats["level_histograms"] = torch.stack([torch.bincount(codes[..., level][keep].long(), minlength=K)[:K].cpu()
                                                 for level in range(codes.shape[-1])])
    policy = m.length_policy
    if hasattr(policy, "boundary_prob"):
        p = policy.boundary_prob(out.head_logits, getattr(out, "shallow", None)).float()
        stats["boundary_sum"] = float(p[valid].sum())
    if stats["kept"]:
        logits = out.head_logits[keep][:, :K].float()
        logp = torch.log_softmax(logits, dim=-1)
        probs = logp.exp()
        stats["entropy_sum"] = float(-(probs * logp).sum(-1).sum())
        stats["max_prob_sum"] = float(probs.max(-1).values.sum())
        e_soft = vocab.embed_soft(probs).float()
        e_hard = vocab.embed_hard(out.concept_ids[keep].clamp(min=0)).float()
        stats["cos_sum"] = float(F.cosine_similarity(e_soft, e_hard, dim=-1, eps=1e-12).sum())
    return stats


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
    kept, real = total["kept"], total["real"]
    nan = float("nan")
    result = {
        "ratio": total.get("concepts", kept) / real if real else nan,  # concepts per token
        "head_entropy": total["entropy_sum"] / kept if kept else nan,
        "max_prob": total["max_prob_sum"] / kept if kept else nan,
    }
    if "boundary_sum" in total:
        result["boundary_prob"] = total["boundary_sum"] / real if real else nan
    result["usage_perplexity"], result["usage_fraction"] = _usage(total["histogram"], K)
    for level, histogram in enumerate(total.get("level_histograms", ())):
        result[f"usage_perplexity/level{level}"] = _usage(histogram, K)[0]
    result["cos_soft_hard"] = total["cos_sum"] / kept if kept else nan
    return result


# -- training-step signals ------------------------------------------------------------------
def step_diagnostics(model, out, batch) -> dict[str, float]:
    """Cheap signals from tensors the training step already has (call under ``torch.no_grad()``).

    ``out`` is the model's forward output, ``batch`` the batch dict it ran on (only
    ``attention_mask`` is read; without it every token is real). Returns floats:

    * ``ratio`` — realised concepts per real token;
    * ``head_entropy`` / ``max_prob`` — mean entropy (nats) and mean max probability of the
      concept distribution ``softmax(head_logits[..., :K])`` at kept positions;
    * ``boundary_prob`` — mean P(keep) over real tokens (only if the length policy has
      ``boundary_prob``);
    * ``usage_perplexity`` — exp(entropy) of the histogram of concept ids used in the batch
      (1 = collapse onto one id, at most min(K, number of concepts));
    * ``usage_fraction`` — distinct ids used / K;
    * ``cos_soft_hard`` — mean cosine between ``e_soft = probs @ table`` and ``e_hard = table[id]``
      at kept positions.

    Values that are undefined for the batch (no kept position) are ``nan``. A model without a
    length policy gets an empty dict.
    """
    family = family_of(_unwrap(model))
    return family.step_diagnostics(_unwrap(model), out, batch) if family is not None else {}


def concept_step_diagnostics(model, out, batch) -> dict[str, float]:
    """:func:`step_diagnostics` of a model with a length policy and a concept head (the streaming family's)."""
    if not _is_concept_model(model) or getattr(out, "keep", None) is None:
        return {}
    with torch.no_grad():
        valid = _valid(batch, out.keep)
        return _finish_concept_stats(_concept_stats(model, out, valid), _concept_size(model))


def grad_norms(model) -> dict[str, float]:
    """L2 norm of the gradients (after backward) of each new-module group of
    ``model.new_modules()`` (vocabulary, length_policy, sampler, positions) and of the LoRA
    parameters (``lora``: parameters whose name contains ``lora_``). A group with no gradient
    (frozen, no parameters, or not reached by backward) reads 0.0."""
    m = _unwrap(model)

    def norm(params) -> float:
        squares = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
        return float(torch.stack(squares).sum().sqrt()) if squares else 0.0

    result = {}
    new_modules = getattr(m, "new_modules", None)
    if callable(new_modules):
        for name, module in new_modules().items():
            result[name] = norm(module.parameters()) if module is not None else 0.0
    result["lora"] = norm(p for name, p in m.named_parameters() if "lora_" in name)
    return result


# -- held-out evaluation --------------------------------------------------------------------
def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _modes(model):
    """Training flag of every submodule (restored after evaluation), or of the object itself."""
    if isinstance(model, torch.nn.Module):
        return [(m, m.training) for m in model.modules()]
    return [(model, getattr(model, "training", None))]


def _set_eval(model):
    if hasattr(model, "eval") and callable(model.eval):
        model.eval()


def _restore(modes):
    for module, flag in modes:
        if flag is None:
            continue
        if isinstance(module, torch.nn.Module):
            module.training = flag
        elif hasattr(module, "train") and callable(module.train):
            module.train(flag)


def _bucket_name(index: int, bucket: int) -> str:
    return f"{index * bucket}-{(index + 1) * bucket}"


def _pair_nll(logits, input_ids, valid, doc):
    """Per-pair NLL [B, T-1] (0 where not a pair) and the pair mask."""
    pair = valid[:, 1:] & valid[:, :-1]
    if doc is not None:
        pair = pair & (doc[:, 1:] == doc[:, :-1])
    nll = next_token_loss(logits, input_ids, valid, doc, reduction="none")
    return nll, pair


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


@torch.no_grad()
def evaluate(model, batches, bucket: int = 64, controls: bool = True, seed: int = 0) -> dict:
    """Held-out evaluation over an iterable of batch dicts ``{'input_ids', 'attention_mask',
    'document_ids'}`` (the last two optional). The model runs in eval mode; every submodule's
    previous mode is restored afterwards.

    Returns ``tokens`` (predicted tokens: pairs of real tokens of the same document), ``nll``
    (mean nats per predicted token), ``bits_per_token``, ``perplexity``, ``nll_by_position``
    ``{"0-64": x, ...}`` and ``tokens_by_position`` (same keys, counts): a pair (t -> t+1) falls
    in the bucket of the position of token t inside its document
    (``concept.packing.time_positions``), so bucket "0-64" holds the predictions of document
    tokens 1..64. Only non-empty buckets appear; token-weighting them gives back ``nll``.

    A concept model (with ``.length_policy``) also gets, over the whole evaluation: ``ratio``
    (concepts per real token), ``concepts`` (count), ``usage_perplexity``, ``usage_fraction``,
    ``head_entropy``, ``max_prob``, ``boundary_prob`` (if the policy has it),
    ``cos_soft_hard`` (with multi-level codes also ``usage_perplexity/level<l>``) and, with ``controls``, ``delta_nll_shuffle`` / ``delta_nll_random``: the
    NLL with the concepts' whole inputs permuted among the concept slots of each batch (seeded), or
    rebuilt from random ids and random tokens' shallow states (see :func:`_control`), with the
    same keep pattern, minus the normal NLL. Both > 0 means the concepts carry information.
    With ``controls`` a streaming model also gets the **depth decomposition**: its NLL at the
    positions that emitted a concept (``nll_concepts``) and at tail positions (``nll_tails``), and
    at the same positions the NLL of two reference paths of the same weights: every token a
    concept (``*_keep_all``: the backbone with this run's adapters, full depth and context) and no
    concept (``*_skip_middle``: the middle stack skipped, every earlier token visible).
    A model with MTP heads (the `mtp` policy) also gets ``mtp_tau`` (the confidence threshold the
    ratio control reached) and ``mtp_accuracy``: per head i, how often its top-1 is the real token
    t+1+i (what a drafter's acceptance rests on).

    A dense model gets ``document_ids`` / ``position_ids`` only where its forward names them;
    otherwise attention may cross packed documents (the loss never does).
    """
    base = _unwrap(model)
    family = family_of(base)
    own = family.evaluate(base, batches, bucket, controls, seed) if family is not None else None
    if own is not None:  # the family's own evaluation (e.g. NLL(y | plan) and the plan's statistics)
        return own
    concept = _is_concept_model(model)
    fn = model if callable(model) else model.forward
    forward = getattr(base, "forward", fn)
    device = _device(model)
    generator = torch.Generator().manual_seed(seed)
    K = _concept_size(model) if concept else 0

    nll_sum = torch.zeros((), dtype=torch.float64)
    count = 0
    by_bucket_sum: dict[int, float] = defaultdict(float)
    by_bucket_n: dict[int, int] = defaultdict(int)
    control_sum = {"shuffle": 0.0, "random": 0.0}
    depth: dict[str, float] = defaultdict(float)  # NLL sums and counts at concept / tail positions
    stats = None
    heads = getattr(base, "mtp_heads", None)
    mtp_hits = torch.zeros(heads.k if heads is not None else 0, dtype=torch.float64)
    mtp_pairs_n = torch.zeros_like(mtp_hits)

    modes = _modes(model)
    _set_eval(model)
    try:
        for batch in batches:
            input_ids = batch["input_ids"].to(device)
            valid = _valid(batch, input_ids)
            doc = batch.get("document_ids")
            doc = None if doc is None else doc.to(device)
            kwargs = {"attention_mask": valid.long()}
            if concept or _accepts(forward, "document_ids"):
                kwargs["document_ids"] = doc
            elif _accepts(forward, "position_ids"):
                kwargs["position_ids"] = packing.time_positions(valid, doc)
            out = fn(input_ids, **kwargs)
            nll, pair = _pair_nll(out.logits, input_ids, valid, doc)
            nll = nll.double()
            batch_sum = nll[pair].sum()
            nll_sum += batch_sum.cpu()
            count += int(pair.sum())

            index = (packing.time_positions(valid, doc)[:, :-1] // bucket)[pair]
            sums = torch.zeros(int(index.max()) + 1 if index.numel() else 0, dtype=torch.float64, device=device)
            sums.index_add_(0, index, nll[pair])
            ns = torch.bincount(index, minlength=sums.shape[0])
            for i in torch.nonzero(ns).flatten().tolist():
                by_bucket_sum[i] += float(sums[i])
                by_bucket_n[i] += int(ns[i])

            if heads is not None:  # each MTP head's top-1 against the real token t+1+i
                from .mtp import mtp_pairs

                T, state = input_ids.shape[1], base.mtp_state(out)
                for i in range(heads.k):
                    ok = mtp_pairs(valid, doc, i)
                    _, guess = heads.top1(state[:, : T - 1 - i][ok], i)
                    mtp_hits[i] += float((guess == input_ids[:, 1 + i:][ok]).sum())
                    mtp_pairs_n[i] += float(ok.sum())
            if not concept:
                continue
            stats = _merge(stats, _concept_stats(model, out, valid))
            if controls:
                keep = out.keep.bool() & valid
                for name in ("shuffle", "random"):
                    perturb = _control(name, base, out, valid, K, generator)
                    bad = fn(input_ids, keep=keep, perturb=perturb, **kwargs)
                    bad_nll, _ = _pair_nll(bad.logits, input_ids, valid, doc)
                    control_sum[name] += float(bad_nll.double()[pair].sum()) - float(batch_sum)
                if hasattr(base, "skip_middle"):
                    _depth_split(depth, nll, pair, keep, {
                        "keep_all": _pair_nll(fn(input_ids, keep=valid, **kwargs).logits, input_ids, valid, doc)[0],
                        "skip_middle": _pair_nll(base.skip_middle(input_ids, valid.long(), doc), input_ids, valid, doc)[0]})
    finally:
        _restore(modes)

    nan = float("nan")
    mean = float(nll_sum) / count if count else nan
    result = {
        "tokens": count,
        "nll": mean,
        "bits_per_token": mean / LN2,
        "perplexity": math.exp(mean) if count else nan,
        "nll_by_position": {_bucket_name(i, bucket): by_bucket_sum[i] / by_bucket_n[i] for i in sorted(by_bucket_n)},
        "tokens_by_position": {_bucket_name(i, bucket): by_bucket_n[i] for i in sorted(by_bucket_n)},
    }
    if concept:
        if stats is None:
            stats = {"real": 0, "kept": 0, "histogram": torch.zeros(K, dtype=torch.long),
                     "entropy_sum": 0.0, "max_prob_sum": 0.0, "cos_sum": 0.0}
        result["concepts"] = stats.get("concepts", stats["kept"])
        result.update(_finish_concept_stats(stats, K))
        if heads is not None:
            result["mtp_tau"] = base.length_policy.tau
        if controls:
            result["delta_nll_shuffle"] = control_sum["shuffle"] / count if count else nan
            result["delta_nll_random"] = control_sum["random"] / count if count else nan
            for part in ("concept", "tail") if depth else ():
                n = depth[f"{part}_n"]
                for path in ("", "_keep_all", "_skip_middle"):
                    result[f"nll_{part}s{path}"] = depth[f"{part}{path}"] / n if n else nan
    if heads is not None:
        result["mtp_accuracy"] = [round(float(h / n), 4) if n else nan for h, n in zip(mtp_hits, mtp_pairs_n)]
    return result


def _depth_split(depth: dict, nll, pair, keep, paths: dict) -> None:
    """Add to ``depth`` the NLL sums of the model (``nll``) and of the reference ``paths`` at the
    positions that emitted a concept and at tail positions (the position predicting t + 1)."""
    for part, at in (("concept", pair & keep[:, :-1]), ("tail", pair & ~keep[:, :-1])):
        depth[f"{part}_n"] += int(at.sum())
        depth[part] += float(nll[at].sum())
        for name, x in paths.items():
            depth[f"{part}_{name}"] += float(x.double()[at].sum())


# -- evaluating a run folder -------------------------------------------------------------------
def heldout_source(run, data: str | None, seq_len: int | None, encoding_errors: str | None, text_field: str | None):
    """(source, split, seq_len, text_field, encoding_errors) of a run's held-out evaluation: all of
    ``data`` if given (the held-out split of a built-in corpus such as ``stdlib`` or ``pydoc``), else
    the held-out split of what the run trained on; unset options default to the run's training settings."""
    from .builder import read_train
    from .data import builtin_corpus

    train = read_train(run) or {}
    if data:
        source, split = data, "heldout" if builtin_corpus(data) else "all"
    else:
        source, split = train.get("data"), "heldout"
    return (source, split, seq_len or train.get("seq_len") or 256, text_field or train.get("text_field", "text"),
            encoding_errors or train.get("encoding_errors", "strict"))


def evaluate_folder(path, data, seq_len, batches, batch, controls, encoding_errors, text_field, device, model=None):
    """Evaluate the run folder ``path`` (or its already loaded ``model``) on one data source: the
    batches ``concept eval`` uses. Returns (model, tokenizer, documents, result)."""
    import concept

    from . import data as concept_data
    from .distributed import pick_device

    problems = [f"{name}: at least {low}, got {value}" for name, value, low in
                (("batches", batches, 1), ("batch", batch, 1), ("seq_len", seq_len, 2))
                if value is not None and (not isinstance(value, int) or value < low)]
    if problems:
        raise ConfigError(problems)
    source, split, seq_len, text_field, encoding_errors = heldout_source(path, data, seq_len, encoding_errors, text_field)
    model = concept.load(path).to(pick_device(device)) if model is None else model
    tokenizer = concept_data.tokenizer_for(model)
    docs = concept_data.read_documents(source, split, text_field, encoding_errors=encoding_errors)
    packed = concept_data.PackedSequences(docs, tokenizer, seq_len, seed=0)
    n = min(batches, max(1, len(packed) // batch))
    result = evaluate(model, (packed.batch(i, batch) for i in range(n)), controls=controls)
    # streaming | dense | pruned | planner-executor
    result["model"] = model_kind(model)
    return model, tokenizer, docs, result


# -- compression map ------------------------------------------------------------------------
def _encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text) if hasattr(tokenizer, "encode") else tokenizer(text)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    if ids and isinstance(ids[0], (list, tuple)):
        ids = ids[0]
    return [int(i) for i in ids]


def compression_map(model, tokenizer, text: str, max_tokens: int = 256):
    """Run the model (eval mode, previous modes restored) on ``text`` and return a
    ``rich.text.Text``: tokens that emitted a concept are shown in bold reverse video, the
    others plainly, followed by a legend line with the realised ratio. Tokens are decoded one
    by one with ``tokenizer.decode([id])`` (a Hugging Face tokenizer or any object with
    ``encode`` / ``decode``); ``tokenizer=None`` uses ``model.tokenizer``. Only the first
    ``max_tokens`` tokens are shown."""
    from rich.text import Text

    tokenizer = tokenizer if tokenizer is not None else getattr(_unwrap(model), "tokenizer", None)
    if tokenizer is None:
        raise ValueError("compression_map needs a tokenizer (none given and the model has none)")
    ids = _encode(tokenizer, text)[:max_tokens]
    if not ids:
        return Text("(empty text)", style="dim")
    fn = model if callable(model) else model.forward
    input_ids = torch.tensor([ids], dtype=torch.long, device=_device(model))
    modes = _modes(model)
    _set_eval(model)
    try:
        with torch.no_grad():
            out = fn(input_ids, attention_mask=torch.ones_like(input_ids))
    finally:
        _restore(modes)
    keep = getattr(out, "keep", None)
    return render_concepts(tokenizer, ids, None if keep is None else keep[0].bool().tolist())


def render_concepts(tokenizer, ids: list[int], flags: list[bool] | None):
    """``rich.text.Text`` of ``ids`` with the tokens that emitted a concept (``flags``) in bold
    reverse video, and a legend line with the realised ratio (``flags=None``: a dense model).
    Tokens without a decision yet (``flags`` shorter than ``ids``) are shown plainly."""
    from rich.text import Text

    concept_style, legend_style = "bold reverse", "dim"
    result = Text()
    for i, token in enumerate(ids):
        kept = flags is not None and i < len(flags) and flags[i]
        result.append(tokenizer.decode([token]), style=concept_style if kept else None)
    result.append("\n")
    if flags is None:
        result.append(f"dense model: no concepts ({len(ids)} tokens)", style=legend_style)
        return result
    n_concepts, n = sum(flags), len(flags)
    result.append("concept", style=concept_style)
    result.append(f" = token emitted a concept; ratio {n_concepts / max(n, 1):.3f} "
                  f"({n_concepts} concepts / {n} tokens)", style=legend_style)
    return result


def model_kind(model) -> str:
    """What a loaded model is: its family's name, or ``dense`` / ``pruned`` for a baseline."""
    return getattr(model, "kind", None) or model.family
