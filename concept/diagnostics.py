"""Diagnostics for concept models (docs/diagnostics.md): cheap training signals and a held-out evaluation.

Three entry points, each documented with healthy / unhealthy readings in ``docs/diagnostics.md``:

* :func:`step_diagnostics` — signals from tensors the training step already holds (no extra
  forward): realised ratio, head entropy / max-prob, P(keep), concept-usage perplexity and
  fraction, cos(e_soft, e_hard).
* :func:`grad_norms` — gradient L2 norm per new-module group and for the LoRA adapters.
* :func:`evaluate` — held-out NLL (overall and by position bucket) plus what the model's family adds
  (``Family.evaluate``; the streaming family's concept statistics, ΔNLL controls and depth decomposition are
  in ``concept.streaming.diagnostics``, the planner-executor's plan statistics in
  ``concept.planner.diagnostics``).
* :func:`compression_map` — a rich ``Text`` showing which tokens became concepts.

Everything here works on any model whose forward returns an object with ``.logits``; the
family-specific parts come from the model's family (a baseline has none).
"""
from __future__ import annotations

import inspect
import math

import torch

from . import data as concept_data
from . import memory, packing
from .builder import load, read_train
from .data import builtin_corpus
from .distributed import pick_device
from .errors import ConfigError
from .families import family_of
from .lora import lora_merged
from .losses import next_token_loss
from .mtp import mtp_pairs
from .precision import DEFAULT_INFERENCE_DTYPE, DTYPE_NAMES, inference_dtype, running
from .syncs import to_device
from .tokens import encode_text

LN2 = math.log(2.0)


# -- helpers --------------------------------------------------------------------------------
def unwrap(model):
    """The model behind a DDP / FSDP-style wrapper (``.module``), else the model itself."""
    inner = getattr(model, "module", None)
    if inner is not None and not hasattr(model, "length_policy") and hasattr(inner, "forward"):
        return inner
    return model


def _device(model) -> torch.device:
    try:
        return next(unwrap(model).parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def real_mask(batch, input_ids) -> torch.Tensor:
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    return to_device(mask, input_ids.device).bool()


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
      at kept positions;
    * ``gate_norm`` — with an identity start (``h + gate * e``), the RMS of the gate on the discrete
      embedding.

    Values that are undefined for the batch (no kept position) are ``nan``. These are the streaming family's
    (``concept.streaming.diagnostics``); another family reports its own, a baseline none.
    """
    return family_of(unwrap(model)).step_diagnostics(unwrap(model), out, batch)


def grad_norms(model) -> dict[str, float]:
    """L2 norm of the gradients (after backward) of each new-module group of
    ``model.new_modules()`` (vocabulary, length_policy, sampler, positions) and of the LoRA
    parameters (``lora``: parameters whose name contains ``lora_``). A group with no gradient
    (frozen, no parameters, or not reached by backward) reads 0.0."""
    m = unwrap(model)

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


def pair_nll(logits, input_ids, valid, doc):
    """Per-pair NLL [B, T-1] (0 where not a pair) and the pair mask."""
    pair = valid[:, 1:] & valid[:, :-1]
    if doc is not None:
        pair = pair & (doc[:, 1:] == doc[:, :-1])
    nll = next_token_loss(logits, input_ids, valid, doc, reduction="none")
    return nll, pair


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

    A model gets what its family adds (``Family.evaluate``). A streaming model (``concept.streaming.diagnostics``)
    also gets, over the whole evaluation: ``ratio``
    (concepts per real token), ``concepts`` (count), ``usage_perplexity``, ``usage_fraction``,
    ``head_entropy``, ``max_prob``, ``boundary_prob`` (if the policy has it),
    ``cos_soft_hard`` (with multi-level codes also ``usage_perplexity/level<l>``), ``gate_norm`` (identity
    start) and, with ``controls``, ``delta_nll_shuffle`` / ``delta_nll_random``: the
    NLL with the concepts' whole inputs permuted among the concept slots of each batch (seeded), or
    rebuilt from random ids and random tokens' shallow states (see :func:`_control`), with the
    same keep pattern, minus the normal NLL. Both > 0 means the concepts carry information. The code-only
    controls ``delta_nll_codes_shuffled`` / ``delta_nll_codes_zero`` change only the concepts' discrete
    embeddings (permuted among the slots of the batch, or removed), each slot keeping its continuous part
    (the identity start's shallow state): > 0 means the discrete id itself carries information.
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
    base = unwrap(model)
    with running(base, _device(model)):  # (a loaded model's dtype: its autocast around every path it evaluates)
        # a model built here names its family; anything else with a forward returning logits (a Hugging Face
        # model, a stand-in) is evaluated as a dense model
        own = family_of(base).evaluate(base, batches, bucket, controls, seed) if hasattr(base, "family") else None
        return own if own is not None else evaluate_tokens(model, batches, bucket)


@torch.no_grad()
def evaluate_tokens(model, batches, bucket: int = 64, extra=None) -> dict:
    """The held-out NLL of :func:`evaluate` (overall, by position bucket, and the MTP heads' accuracy), in eval
    mode. ``extra``: what a family adds, called after each batch's forward as ``extra.add(forward, out,
    input_ids, valid, doc, kwargs, nll, pair)`` (``nll`` [B, T-1] float64 per pair, ``pair`` its mask) and
    merged from ``extra.result(tokens)``. The sums stay on the model's device (:class:`HeldOutSums`) and are read
    after the last batch: a batch's evaluation asks nothing of the host, so the next batch's forward is queued
    while the device runs this one."""
    base = unwrap(model)
    fn = model if callable(model) else model.forward
    forward = getattr(base, "forward", fn)
    device = _device(model)
    heads = getattr(base, "mtp_heads", None)
    sums = HeldOutSums(device, bucket, heads.k if heads is not None else 0)

    modes = _modes(model)
    _set_eval(model)
    try:
        for batch in batches:
            input_ids = to_device(batch["input_ids"], device)  # (on CUDA: pinned, no wait for the batch before)
            valid = real_mask(batch, input_ids)
            doc = batch.get("document_ids")
            doc = None if doc is None else to_device(doc, device)
            kwargs = _forward_kwargs(forward, valid, doc)
            out = fn(input_ids, **kwargs)
            nll, pair = pair_nll(out.logits, input_ids, valid, doc)
            nll = nll.double()
            sums.add(nll, pair, valid, doc)
            if heads is not None:
                sums.add_mtp_hits(base.mtp_state(out), heads, input_ids, valid, doc)
            if extra is not None:
                extra.add(fn, out, input_ids, valid, doc, kwargs, nll, pair)
    finally:
        _restore(modes)

    result = sums.result()
    if extra is not None:
        result.update(extra.result(result["tokens"]))
    return result


class BucketSums:
    """Values summed by bucket of their position (``position // bucket``), with their counts, on the device: a batch's
    are added without reading anything back (a row of T positions has at most ceil(T / bucket) buckets: the shapes
    follow T, not the data); :meth:`read` reads them, after the last batch."""

    def __init__(self, device: torch.device, bucket: int):
        self.bucket = bucket
        self.sums = torch.zeros(0, dtype=torch.float64, device=device)  # (grown to the longest row's buckets)
        self.counts = torch.zeros(0, dtype=torch.float64, device=device)

    def add(self, values: torch.Tensor, at: torch.Tensor, positions: torch.Tensor) -> None:
        """``values`` where ``at`` (both [B, T]), each in the bucket of its ``positions`` [B, T] (below T)."""
        buckets = -(-values.shape[1] // self.bucket)
        if buckets > self.sums.numel():
            grow = buckets - self.sums.numel()
            self.sums, self.counts = (torch.cat([t, t.new_zeros(grow)]) for t in (self.sums, self.counts))
        index = (positions // self.bucket).flatten()
        self.sums.index_add_(0, index, torch.where(at, values.double(), 0.0).flatten())
        self.counts.index_add_(0, index, at.flatten().double())

    def read(self) -> tuple[float, int, dict[str, float], dict[str, int]]:
        """(the sum, the count, the mean by bucket, the count by bucket): the buckets with a value, named
        ``"0-64"``, ``"64-128"`` ..."""
        sums, counts = self.sums.cpu(), self.counts.cpu()  # (read here, after the last batch)
        used = [i for i in range(len(counts)) if counts[i] > 0]
        return (float(sums.sum()), int(counts.sum()),
                {_bucket_name(i, self.bucket): float(sums[i] / counts[i]) for i in used},
                {_bucket_name(i, self.bucket): int(counts[i]) for i in used})


class HeldOutSums:
    """The sums of a held-out evaluation, on the device, each batch's added without reading anything back: the NLL
    of the predicted pairs per position bucket (:class:`BucketSums`: a pair t -> t+1 in the bucket of token t's
    position in its document), and per MTP head its hits and scored pairs. :meth:`result` reads them, after the last
    batch."""

    def __init__(self, device: torch.device, bucket: int, mtp_heads: int = 0):
        self.buckets = BucketSums(device, bucket)
        self.mtp = torch.zeros(2, mtp_heads, dtype=torch.float64, device=device)  # hits, pairs per head

    def add(self, nll: torch.Tensor, pair: torch.Tensor, valid: torch.Tensor, doc: torch.Tensor | None) -> None:
        """A batch's per-pair NLL [B, T-1] (``pair`` its mask) into the sums by position bucket."""
        self.buckets.add(nll, pair, packing.time_positions(valid, doc)[:, :-1])

    def add_mtp_hits(self, state, heads, input_ids, valid, doc) -> None:
        """Each MTP head's top-1 hits against the real token t+1+i, over every position (the pairs it is scored on
        masked in, not selected: nothing read back)."""
        T = input_ids.shape[1]
        for i in range(heads.k):
            ok = mtp_pairs(valid, doc, i)
            _, guess = heads.top1(state[:, : T - 1 - i], i)
            self.mtp[0, i] += ((guess == input_ids[:, 1 + i:]) & ok).sum()
            self.mtp[1, i] += ok.sum()

    def result(self) -> dict:
        """The held-out keys of :func:`evaluate` (and ``mtp_accuracy`` with MTP heads), read from the device."""
        total, count, by_position, tokens_by_position = self.buckets.read()
        mtp = self.mtp.cpu()
        nan = float("nan")
        mean = total / count if count else nan
        result = {"tokens": count, "nll": mean, "bits_per_token": mean / LN2,
                  "perplexity": math.exp(mean) if count else nan,
                  "nll_by_position": by_position, "tokens_by_position": tokens_by_position}
        if mtp.shape[1]:
            result["mtp_accuracy"] = [round(float(h / n), 4) if n else nan for h, n in zip(mtp[0], mtp[1])]
        return result


def _forward_kwargs(forward, valid, doc) -> dict:
    """The keyword arguments of one evaluation forward: the mask, and the documents as the forward takes them
    (``document_ids``, else their ``position_ids``, else neither)."""
    kwargs = {"attention_mask": valid.long()}
    if _accepts(forward, "document_ids"):
        kwargs["document_ids"] = doc
    elif _accepts(forward, "position_ids"):
        kwargs["position_ids"] = packing.time_positions(valid, doc)
    return kwargs


# -- evaluating a run folder -------------------------------------------------------------------
def heldout_source(run, data: str | None, seq_len: int | None, encoding_errors: str | None, text_field: str | None):
    """(source, split, seq_len, text_field, encoding_errors) of a run's held-out evaluation: all of
    ``data`` if given (the held-out split of a built-in corpus such as ``stdlib`` or ``pydoc``), else
    the held-out split of what the run trained on; unset options default to the run's training settings."""
    train = read_train(run) or {}
    if data is not None:  # ("" is refused by the reader, not taken for "the run's data")
        source, split = data, "heldout" if builtin_corpus(data) else "all"
    elif train.get("eval_data") is not None:  # the run's own --eval-data
        source = train["eval_data"]
        split = "heldout" if builtin_corpus(source) else "all"
    else:
        source, split = train.get("data"), "heldout"
    return (source, split, seq_len or train.get("seq_len") or 256, text_field or train.get("text_field", "text"),
            encoding_errors or train.get("encoding_errors", "strict"))


def evaluate_folder(path, data, seq_len, batches, batch, controls, encoding_errors, text_field, device, model=None,
                    progress=None, data_split: str | None = None, streaming: bool | None = None,
                    dtype: str = DEFAULT_INFERENCE_DTYPE, merge_lora: bool = False):
    """Evaluate the run folder ``path`` (or its already loaded ``model``) on one data source: the
    batches ``concept eval`` uses. Returns (model, tokenizer, documents, result). ``progress(done, total)`` is
    called once the data is read (0 done) and after each batch. ``data_split`` / ``streaming``: a dataset id's
    split and reading (None: the run's own for its own data, else ``train`` / loaded whole). ``dtype``, ``merge_lora``:
    how the model is loaded (``concept.load``'s; not for a ``model`` given). The result names the dtype it ran in and,
    for a model whose LoRA was merged, ``lora_merged`` (how many adapted layers)."""
    problems = [f"{name}: at least {low}, got {value}" for name, value, low in
                (("batches", batches, 1), ("batch", batch, 1), ("seq_len", seq_len, 2))
                if value is not None and (not isinstance(value, int) or value < low)]
    if problems:
        raise ConfigError(problems)
    source, split, seq_len, text_field, encoding_errors = heldout_source(path, data, seq_len, encoding_errors, text_field)
    where = pick_device(device)  # (an unusable device: before anything is loaded)
    model = load(path, dtype=dtype, merge_lora=merge_lora).to(where) if model is None else model
    info = model.resolution.backbone_info
    if info.max_positions and seq_len > info.max_positions:  # as `concept train` refuses it
        raise ConfigError([f"seq-len: {seq_len} is above the backbone's maximum of {info.max_positions} positions; "
                           f"pass --seq-len {info.max_positions} or less"])
    too_big = memory.inference_problem(info, batch, seq_len, where)
    if too_big:
        raise ConfigError([too_big])
    tokenizer = concept_data.tokenizer_for(model)
    # the run's own data: its hub split / streaming; other data: the defaults
    own = data is None and train_data_settings(path).get("eval_data") is None
    hub = {k: train_data_settings(path).get(k) for k in ("data_split", "streaming")} if own else {}
    if data_split is not None:
        hub["data_split"] = data_split
    if streaming is not None:
        hub["streaming"] = streaming
    hub["streaming"] = bool(hub.get("streaming"))
    tokens = concept_data.open_tokens(source, split, tokenizer, text_field=text_field, encoding_errors=encoding_errors,
                                      **hub)
    packed = concept_data.PackedSequences(tokens, None, seq_len, seed=0)
    docs = _LazyDocuments(lambda: concept_data.read_documents(source, split, text_field, encoding_errors=encoding_errors,
                                                              data_split=hub.get("data_split")))
    n = min(batches, max(1, len(packed) // batch))
    result = evaluate(model, counted((packed.batch(i, batch) for i in range(n)), n, progress), controls=controls)
    # streaming | dense | pruned | planner-executor
    result["model"] = model.family
    result["dtype"] = DTYPE_NAMES[inference_dtype(model, where)]
    merged = lora_merged(unwrap(model).backbone)
    if merged:  # (concept.load(..., merge_lora=True))
        result["lora_merged"] = merged
    return model, tokenizer, docs, result


def counted(batches, total: int, progress=None):
    """``batches``, calling ``progress(done, total)`` first with 0, then each time a batch has been used (when
    the evaluation asks for the next one, or finds there is none)."""
    if progress is None:
        yield from batches
        return
    progress(0, total)
    for done, b in enumerate(batches, 1):
        yield b
        progress(done, total)


def train_data_settings(run) -> dict:
    return read_train(run) or {}


class _LazyDocuments:
    """The documents evaluated, read only when asked for (``--show-map``): the batches come from token shards."""

    def __init__(self, read):
        self._read, self._docs = read, None

    def _all(self) -> list:
        if self._docs is None:
            self._docs = self._read()
        return self._docs

    def __getitem__(self, i):
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self):
        return iter(self._all())


# -- compression map ------------------------------------------------------------------------
def compression_map(model, tokenizer, text: str, max_tokens: int = 256):
    """Run the model (eval mode, previous modes restored) on ``text`` and return a
    ``rich.text.Text``: tokens that emitted a concept are shown in bold reverse video, the
    others plainly, followed by a legend line with the realised ratio. Tokens are decoded one
    by one with ``tokenizer.decode([id])`` (a Hugging Face tokenizer or any object with
    ``encode`` / ``decode``); ``tokenizer=None`` uses ``model.tokenizer``. Only the first
    ``max_tokens`` tokens are shown."""
    from rich.text import Text

    tokenizer = tokenizer if tokenizer is not None else getattr(unwrap(model), "tokenizer", None)
    if tokenizer is None:
        raise ValueError("compression_map needs a tokenizer (none given and the model has none)")
    ids = encode_text(tokenizer, text)[:max_tokens]
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
