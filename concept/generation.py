"""Text generation: ``model.generate(input_ids, ...)`` for the streaming model and the dense baseline.

Sampling follows transformers' conventions and reuses its logits processors: greedy unless
``do_sample``; then repetition penalty, temperature, top-k and top-p, in transformers' order.
Concept ids are not sampled here: the model's configured concept sampler picks them (argmax
by default at inference). Prompts of different lengths are left-padded into one batch; every
row gives the same tokens as it would alone (tested).

Each row stops at the end-of-sequence token, when its generated text contains a stop string
(the text is cut before it), after ``max_new_tokens``, or at the backbone's context limit.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace

import torch

from . import multitoken
from .compiled import settle
from .errors import ConceptError, ConfigError
from .families import family_of
from .options import SEED_MAX, finite
from .precision import running
from .syncs import declared, upload
from .tokens import encode_text, tokenizer_for


@dataclass
class GenerationSettings:
    max_new_tokens: int = 32
    do_sample: bool = False  # greedy (argmax) unless True
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off (transformers' CTRL-style penalty)
    stop_strings: tuple[str, ...] = ()
    eos_token_id: int | None = None  # default: the tokenizer's
    seed: int | None = None  # row b samples with a generator seeded seed + b (same seed, same prompt -> same text)
    mtp: str | None = None  # multi-token decoding with the MTP heads: "verify" (= greedy) or "confadapt" (lossy)
    mtp_tau: float = 0.9  # confadapt: keep drafted tokens while the heads' top-1 probability is >= this

    def validate(self) -> list[str]:
        problems = [f"{name}: must be a finite number, got {getattr(self, name)}"
                    for name in ("temperature", "top_p", "repetition_penalty", "mtp_tau")
                    if isinstance(getattr(self, name), float) and not finite(getattr(self, name))]
        if problems:  # (the checks below compare numbers)
            return problems
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            problems.append(f"seed: must be in [0, {SEED_MAX}] (a 64-bit seed), got {self.seed}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            problems.append(f"temperature: must be > 0, got {self.temperature} (for greedy decoding leave "
                            f"do_sample off; the CLI's --temperature 0 means greedy)")
        if self.top_k < 0:
            problems.append(f"top_k: must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p: must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty: must be > 0 (1.0 turns it off), got {self.repetition_penalty}")
        if any(not s for s in self.stop_strings):
            problems.append("stop_strings: an empty stop string would stop at once; remove it")
        if self.mtp not in (None, "verify", "confadapt"):
            problems.append(f"mtp: verify or confadapt (or None: one token per step), got {self.mtp!r}")
        if not 0 < self.mtp_tau <= 1:
            problems.append(f"mtp_tau: must be in (0, 1], got {self.mtp_tau}")
        return problems


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, P + N]: left-padded prompts, then the new tokens (pad after a row stops)
    prompt_lengths: list[int]
    tokens: list[list[int]]  # per row: the new tokens (up to and including EOS / the stop string's end)
    finish_reasons: list[str]  # "eos", "stop", "length" or "context"
    kv: list[dict]  # per row: KV entries per stack and bytes held at the end (vs the dense backbone's)
    keep: list[list[bool]] | None = None  # per row: which tokens emitted a concept (prompt + fed new tokens)
    texts: list[str] | None = None  # per row: the new text (cut before a stop string), if a tokenizer is known
    logits: torch.Tensor | None = None  # [B, N, V] raw next-token logits of every step (output_logits=True)
    steps: int = 0  # decoding steps run (forwards after the prefill; with mtp each feeds a block of tokens)
    plans: list[list[dict]] | None = None  # planner-executor: per row, the plan ({"type": name, "ids": [...]} per type)


def settings_from(settings: GenerationSettings | None, overrides: dict) -> GenerationSettings:
    known = {f.name for f in fields(GenerationSettings)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError([f"{k}: not a generation setting (known: {', '.join(sorted(known))})" for k in unknown])
    settings = replace(settings or GenerationSettings(), **overrides)
    settings.stop_strings = tuple([settings.stop_strings] if isinstance(settings.stop_strings, str) else settings.stop_strings)
    problems = settings.validate()
    if problems:
        raise ConfigError(problems)
    return settings


def _processors(s: GenerationSettings):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if s.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    if s.do_sample:
        if s.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k:
            procs.append(TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            procs.append(TopPLogitsWarper(s.top_p))
    return procs


def prompt_rows(input_ids, attention_mask=None) -> list[list[int]]:
    """The real tokens of each prompt (any padding side), from a tensor / nested lists."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.reshape(ids.shape).bool()
        return [row[m].tolist() for row, m in zip(ids, mask)]
    rows = [list(input_ids)] if input_ids and isinstance(input_ids[0], int) else [list(r) for r in input_ids]
    return rows


def left_pad(rows: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for b, r in enumerate(rows):
        if r:
            ids[b, width - len(r):] = torch.tensor(r, dtype=torch.long, device=device)
            valid[b, width - len(r):] = True
    return ids, valid


def _context_limit(model) -> int | None:
    return getattr(model.backbone.config, "max_position_embeddings", None)


READ_EVERY = 16  # compiled decoding reads the sampled tokens back every this many steps (without stop strings or a streamer)


def _decoder(model, s: GenerationSettings, budget: int):
    settle(model, next(model.parameters()).device)  # (`--compile auto` decided before its decoder is chosen)
    compiled = getattr(model, "compiled_stacks", None)
    family = family_of(model)
    if compiled is not None and not s.mtp:  # --compile: static KV caches and a compiled step
        return family.static_decoder(model, budget, compiled.choice)
    return family.decoder(model)


def _stopped_text(text: str, stops: tuple[str, ...]) -> str | None:
    """``text`` cut before the first stop string it contains, or None."""
    hits = [text.index(s) for s in stops if s in text]
    return text[: min(hits)] if hits else None


@torch.no_grad()
def generate(model, input_ids, attention_mask=None, settings: GenerationSettings | None = None, *, tokenizer=None,
             streamer=None, output_logits: bool = False, **overrides) -> GenerationOutput | str | list[str]:
    """Generate from prompts (a [B, T] / [T] tensor with an optional attention mask, or lists of ids).

    ``overrides`` are :class:`GenerationSettings` fields (``max_new_tokens=64, do_sample=True,
    top_p=0.95, seed=0``...). ``streamer``: an object with ``put(ids)`` / ``end()`` such as
    transformers' ``TextStreamer`` (it receives the prompt ids first, then each new token).

    Text in, text out: a prompt string gives the new text (a string), a list of prompt strings a list
    of texts, each encoded with ``tokenizer`` (default: the model's, or bytes for backbones without one).
    """
    if isinstance(input_ids, str) or (isinstance(input_ids, (list, tuple)) and input_ids
                                      and all(isinstance(p, str) for p in input_ids)):
        return _generate_texts(model, input_ids, settings, tokenizer, streamer, overrides)
    s = settings_from(settings, overrides)
    rows = prompt_rows(input_ids, attention_mask)
    if not rows or any(len(r) == 0 for r in rows):
        raise ConceptError("a prompt is empty; generation needs at least one prompt token")
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if s.stop_strings and tokenizer is None:
        raise ConceptError("stop_strings need a tokenizer to read the text; pass tokenizer=")
    eos = s.eos_token_id if s.eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    pad = next((i for i in (getattr(tokenizer, "pad_token_id", None), eos) if i is not None), 0)
    budget = _new_token_budget(model, s, max(len(r) for r in rows))
    if s.mtp:
        multitoken.check(model, s)
    ids, valid = left_pad(rows, pad, next(model.parameters()).device)
    with running(model, ids.device):  # (a loaded model's dtype: its autocast, the decoder built under it too)
        decoder = _decoder(model, s, budget)
        finished = _FinishedRows(len(rows), eos, s.stop_strings, tokenizer, budget)
        was_training = model.training
        model.eval()
        try:
            ids, kept_logits, steps = _decode(model, decoder, ids, valid, s, pad, finished, streamer, output_logits)
        finally:
            model.train(was_training)
            if streamer is not None:
                streamer.end()
    last = "length" if budget == s.max_new_tokens else "context"
    reasons = [r or last for r in finished.reasons]
    texts = finished.final_texts()
    return GenerationOutput(
        sequences=ids, prompt_lengths=[len(r) for r in rows], tokens=finished.new, finish_reasons=reasons,
        kv=decoder.kv_stats(), keep=getattr(decoder, "keep", None), texts=texts,
        logits=(kept_logits if s.mtp else torch.stack(kept_logits, dim=1)) if output_logits else None, steps=steps,
        plans=getattr(decoder, "plans", None),
    )


def _generate_texts(model, prompts, settings, tokenizer, streamer, overrides) -> str | list[str]:
    """Text in, text out: each prompt encoded with ``tokenizer`` (default: the model's), the new texts."""
    tokenizer = tokenizer if tokenizer is not None else tokenizer_for(model)
    rows = [prompts] if isinstance(prompts, str) else list(prompts)
    out = generate(model, [encode_text(tokenizer, p) for p in rows], settings=settings, tokenizer=tokenizer,
                   streamer=streamer, **overrides)
    return out.texts[0] if isinstance(prompts, str) else out.texts


def _new_token_budget(model, s: GenerationSettings, longest: int) -> int:
    """How many new tokens the longest prompt leaves room for: ``max_new_tokens``, fewer (with a warning)
    near the backbone's context limit; a prompt (plus the plan a model writes after it) past it is refused."""
    limit = _context_limit(model)
    if limit is not None and longest >= limit:
        raise ConceptError(f"a prompt has {longest} tokens but the backbone's context limit is {limit}; shorten the "
                           f"prompt (keep its last {limit - 1} tokens or fewer)")
    planned = getattr(model, "plan_positions", 0)  # positions a model writes after the prompt first (a plan)
    if limit is not None and planned and longest + planned > limit:
        raise ConceptError(f"a prompt has {longest} tokens and the model writes up to {planned} plan positions after "
                           f"it, past the backbone's context limit of {limit}; shorten the prompt to at most "
                           f"{limit - planned} tokens")
    budget = s.max_new_tokens if limit is None else min(s.max_new_tokens, limit - longest)
    if budget < s.max_new_tokens:
        warnings.warn(f"max_new_tokens={s.max_new_tokens} would pass the context limit ({limit} positions); "
                      f"generating at most {budget} new tokens", stacklevel=3)
    return budget


class _FinishedRows:
    """Each row's new tokens (``new``), why it finished (``reasons``: "eos", "stop", None while it runs) and
    its text cut before a stop string (``texts``; None: not cut)."""

    def __init__(self, rows: int, eos, stop_strings: tuple[str, ...], tokenizer, budget: int):
        self.eos, self.stops, self.tokenizer, self.budget = eos, stop_strings, tokenizer, budget
        self.new = [[] for _ in range(rows)]
        self.reasons = [None] * rows
        self.texts = [None] * rows

    def record(self, b: int, t: int) -> bool:
        """Row b's next token; True once the row is finished."""
        self.new[b].append(t)
        if self.eos is not None and t == self.eos:
            self.reasons[b] = "eos"
        elif self.stops:
            cut = _stopped_text(self.tokenizer.decode(self.new[b]), self.stops)
            if cut is not None:
                self.reasons[b], self.texts[b] = "stop", cut
        return self.reasons[b] is not None or len(self.new[b]) >= self.budget

    def final_texts(self) -> list[str] | None:
        """Each row's new text (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return [t if t is not None else self.tokenizer.decode(n, skip_special_tokens=True)
                for t, n in zip(self.texts, self.new)]


def _decode(model, decoder, ids, valid, s: GenerationSettings, pad: int, finished: _FinishedRows, streamer,
            output_logits: bool):
    """The prompt's prefill, then the loop the settings call for: multi-token (``mtp``), on the device (a
    static, compiled decoder) or eager. Returns the sequences, the logits kept and the steps run."""
    if streamer is not None:
        streamer.put(ids.cpu())
    logits = decoder.prefill(ids, valid)
    if s.mtp:
        return _multitoken_loop(model, decoder, logits, ids, pad, finished.record, finished.new, s, streamer,
                                output_logits)
    processors = _processors(s)
    generators = _row_generators(s, ids.shape[0], ids.device)
    # pads take the row's first token in the penalty's view, so padding never changes a row's scores
    penalty_view = torch.where(valid, ids, ids.gather(1, valid.to(torch.int8).argmax(1, keepdim=True)))
    if getattr(decoder, "static", False):
        return _device_loop(decoder, logits, ids, valid, s, processors, penalty_view, generators, finished.eos, pad,
                            finished.budget, finished.record, finished.new, finished.reasons, streamer, output_logits)
    return _eager_loop(decoder, logits, ids, s, processors, penalty_view, generators, pad, finished, streamer,
                       output_logits)


def _row_generators(s: GenerationSettings, rows: int, device) -> list:
    """One generator per row (seed + row): a row's text does not depend on the other rows of the batch."""
    if s.do_sample and s.seed is not None:
        return [torch.Generator(device=device).manual_seed(s.seed + b) for b in range(rows)]
    return [None] * rows


def _eager_loop(decoder, logits, ids, s: GenerationSettings, processors, penalty_view, generators, pad: int,
                finished: _FinishedRows, streamer, output_logits: bool):
    """One token per step for every row (a finished row is fed ``pad``), read back once per step for all rows:
    the ``decoded tokens`` point (``concept.syncs``), the loop's one host sync per token (the host decides when a
    row ends: EOS, a stop string, the budget; the streamer gets the same copy). Which rows are still running goes
    back to the device with ``upload`` (no sync). Returns the sequences, the logits that predicted each new token
    and the steps run."""
    kept_logits, steps, reasons, device = [], 0, finished.reasons, ids.device
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    for i in range(finished.budget):
        if output_logits:
            kept_logits.append(logits)
        token = _sample(processors(penalty_view, logits.float()), s, generators)
        token = torch.where(done, torch.full_like(token, pad), token)
        penalty_view = torch.cat([penalty_view, torch.where(done, penalty_view[:, -1], token)[:, None]], dim=1)
        ids = torch.cat([ids, token[:, None]], dim=1)
        with declared("decoded tokens"):  # every row's new token, in one copy
            host = token.cpu()
            if streamer is not None:
                streamer.put(host)
            for b, t in enumerate(host.tolist()):
                if reasons[b] is None:
                    finished.record(b, t)
        if all(r is not None for r in reasons) or i == finished.budget - 1:
            break
        done = upload([r is not None for r in reasons], torch.bool, device)
        logits = decoder.step(token, ~done)
        steps += 1
    return ids, kept_logits, steps


def _sample(scores, s: GenerationSettings, generators):
    if not s.do_sample:
        return scores.argmax(-1)
    probs = torch.softmax(scores, dim=-1)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


def _device_loop(decoder, logits, ids, valid, s, processors, penalty_view, generators, eos, pad, budget, record, new,
                 reasons, streamer, output_logits):
    """The per-token loop of compiled decoding: the sampled tokens and which rows are done (EOS) stay on the
    device; the host reads the tokens every ``READ_EVERY`` steps (every step for a streamer or stop strings,
    which need the text), so up to ``READ_EVERY - 1`` steps may run after every row is done (they keep
    nothing). Returns the sequences, the logits and the steps, as the eager loop has them."""
    device = ids.device
    B = ids.shape[0]
    done = torch.zeros(B, dtype=torch.bool, device=device)  # on the device: EOS seen
    stopped = torch.zeros_like(done)  # on the host's word: a stop string
    every = 1 if streamer is not None or s.stop_strings else READ_EVERY
    fed, kept_logits, steps, read = [], [], 0, 0
    for i in range(budget):
        if output_logits:
            kept_logits.append(logits)
        token = _sample(processors(penalty_view, logits.float()), s, generators)
        token = torch.where(done | stopped, torch.full_like(token, pad), token)
        if s.repetition_penalty != 1.0:
            penalty_view = torch.cat([penalty_view, torch.where(done | stopped, penalty_view[:, -1], token)[:, None]], 1)
        fed.append(token)
        if streamer is not None:
            streamer.put(token.cpu())
        if (i + 1) % every == 0 or i == budget - 1:
            block = torch.stack(fed[read:], 1).tolist()  # one read of the steps since the last
            read = len(fed)
            for b in range(B):
                for t in block[b]:
                    if reasons[b] is None:
                        record(b, t)
            if all(r is not None for r in reasons) or i == budget - 1:
                break
            if s.stop_strings:
                stopped = torch.tensor([r == "stop" for r in reasons], device=device)
        if eos is not None:
            done = done | (token == eos)
        logits = decoder.step(token, ~(done | stopped))
        steps += 1
    width = max(len(r) for r in new)  # the eager loop stops when the last row does
    tail = torch.full((B, width), pad, dtype=torch.long, device=device)
    for b, r in enumerate(new):
        tail[b, : len(r)] = torch.tensor(r, dtype=torch.long, device=device)
    return torch.cat([ids, tail], dim=1), kept_logits[:width], steps


def _multitoken_loop(model, decoder, logits, ids, pad, record, new, s, streamer, output_logits):
    """Greedy decoding a block of tokens per forward (``concept.multitoken``); ``record(b, t)`` appends
    row b's token to ``new[b]`` and says whether the row is finished. Returns the sequences,
    the logits that predicted each new token ([B, N, V], padded with zeros) and the forwards run."""
    B = ids.shape[0]
    done = [False] * B
    per_row = [[] for _ in range(B)]
    steps = 0
    first = logits.argmax(-1)
    while not all(done):
        block, block_logits, count = multitoken.decode_step(model, decoder, first, s.mtp, s.mtp_tau)
        steps += 1
        kept = []
        for b in range(B):
            c = 0
            while not done[b] and c < int(count[b]):
                t = int(block[b, c])
                per_row[b].append(logits[b] if c == 0 else block_logits[b, c - 1])
                done[b] = record(b, t)
                c += 1
            kept.append(c)
        if streamer is not None:
            for j in range(max(kept)):
                streamer.put(torch.tensor([int(block[b, j]) if j < kept[b] else pad for b in range(B)]))
        kept = torch.tensor(kept, device=block.device)
        decoder.accept(kept)
        last = (kept - 1).clamp(min=0)
        logits = block_logits[torch.arange(B, device=block.device), last]
        first = logits.argmax(-1)
    width = max(len(r) for r in new)
    tail = torch.full((B, width), pad, dtype=torch.long, device=ids.device)
    for b, r in enumerate(new):
        tail[b, : len(r)] = torch.tensor(r, dtype=torch.long, device=ids.device)
    kept_logits = None
    if output_logits:
        kept_logits = torch.zeros(B, width, logits.shape[-1], dtype=logits.dtype, device=logits.device)
        for b, r in enumerate(per_row):
            if r:
                kept_logits[b, : len(r)] = torch.stack(r)
    return torch.cat([ids, tail], dim=1), kept_logits, steps


class TextStream:
    """A streamer (``put(ids)`` / ``end()``, as transformers' ``TextStreamer``) that writes the new
    text of one row as it is generated. It never writes a stop string or the text after it, nor
    half of a multi-byte character; ``finish(text)`` writes whatever of the final text is left."""

    def __init__(self, tokenizer, stop_strings=(), write=None):
        import sys

        self.tokenizer, self.stops = tokenizer, tuple(stop_strings)
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # could be the start of a stop string
        self.write = write or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
        self.ids, self.printed, self.prompt_seen, self.stopped = [], 0, False, False

    def put(self, ids) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        if self.stopped:
            return
        self.ids.extend(ids.flatten().tolist()[:1])
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = _stopped_text(text, self.stops) if self.stops else None
        if cut is not None:
            self.stopped, safe = True, len(cut)
        else:
            safe = len(text) - self.hold
            while safe > self.printed and text[safe - 1] == "\ufffd":  # an incomplete character
                safe -= 1
        self._emit(text[:safe])

    def _emit(self, text: str) -> None:
        if len(text) > self.printed:
            self.write(text[self.printed:])
            self.printed = len(text)

    def end(self) -> None:
        pass

    def finish(self, text: str) -> None:
        self._emit(text)


class GenerationMixin:
    """``model.generate(input_ids, ...)``, as on a transformers model: :func:`generate` with this model."""

    def generate(self, input_ids, attention_mask=None, **kwargs) -> GenerationOutput:
        return generate(self, input_ids, attention_mask, **kwargs)
