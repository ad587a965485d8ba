"""Scoring text under a run, the three questions evaluation harnesses ask a language model:

* ``loglikelihood``: log p(continuation | context) and whether greedy decoding would have produced the
  continuation (multiple choice, cloze);
* ``loglikelihood_rolling``: log p(text) of a whole text, in windows of at most ``max_length`` tokens
  (perplexity tasks);
* ``generate_until``: greedy (or sampled) text after a context, cut at the first stop string.

Any run scores the same way: a streaming model, a planner-executor, the dense and pruned baselines. By
default a continuation is scored from one causal forward over ``context + continuation`` (the model's
``logits`` at the positions before each continuation token; every built-in model's forward is exact
teacher forcing of its decoding). A family that reads its context another way gives its own logits
(``Family.score``: the planner-executor plans from the context and scores the continuation given the
plan). Generation is ``concept.generation.generate``: the family's KV-cached decoder.

Requests are batched, longest first (rows of a batch then have similar lengths, and the first batch
shows at once whether the longest fits in memory), right-padded, and answered in the order given.
Text is tokenised as the training data was, without special tokens; a continuation's leading
whitespace stays with it (a context's trailing spaces move to the continuation), and an empty
context is the tokenizer's end-of-text token.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from .builder import load
from .contracts import Family
from .data import tokenizer_for
from .distributed import pick_device
from .errors import ConceptError, ConfigError
from .families import family_of
from .generation import GenerationSettings, generate
from .precision import DEFAULT_INFERENCE_DTYPE, running

DEFAULT_MAX_LENGTH = 2048  # tokens per scored row, at most the backbone's context (as lm-eval's Hugging Face backend)


def _encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]


@dataclass
class Scorer:
    """Answers scoring requests with a loaded run. ``Scorer.from_run("runs/x")`` loads one."""

    model: torch.nn.Module
    tokenizer: object
    batch_size: int = 8
    max_length: int | None = None  # default: the backbone's context, at most DEFAULT_MAX_LENGTH

    def __post_init__(self):
        problems = []
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            problems.append(f"batch_size: at least 1, got {self.batch_size!r}")
        limit = getattr(self.model.backbone.config, "max_position_embeddings", None) or DEFAULT_MAX_LENGTH
        if self.max_length is None:
            self.max_length = min(limit, DEFAULT_MAX_LENGTH)
        elif not isinstance(self.max_length, int) or not 2 <= self.max_length <= limit:
            problems.append(f"max_length: between 2 and the backbone's context limit {limit}, got {self.max_length!r}")
        if problems:
            raise ConfigError(problems)
        self.model.eval()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos = int(eos) if eos is not None else 0

    @classmethod
    def from_run(cls, path, device: str = "auto", batch_size: int = 8, max_length: int | None = None,
                 dtype: str = DEFAULT_INFERENCE_DTYPE, merge_lora: bool = False) -> Scorer:
        """The run folder ``path`` loaded on ``device`` in ``dtype`` (``concept.load``'s: fp32 by default; ``auto``: bf16 on
        CUDA), its LoRA adapters merged into the base with ``merge_lora`` (``concept.load``'s)."""
        model = load(path, dtype=dtype, merge_lora=merge_lora).to(pick_device(device))
        return cls(model, tokenizer_for(model), batch_size, max_length)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- tokens ----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return _encode(self.tokenizer, text)

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of (context, continuation): the continuation's tokens are those of the whole text
        after the context's, so a word split across the boundary is tokenised as in running text."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not continuation:
            raise ConceptError("a continuation is empty: there is nothing to score")
        if not context:
            return [self.eos], self.encode(continuation)
        whole, head = self.encode(context + continuation), self.encode(context)
        if whole[:len(head)] != head:  # the boundary merged tokens: score the continuation's own tokens
            return head, self.encode(continuation)
        return head, whole[len(head):]

    # -- loglikelihood ---------------------------------------------------------------------------
    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context) in nats, whether it is the greedy continuation) per request."""
        return self.loglikelihood_tokens([self.pair(c, x) for c, x in requests])

    @torch.no_grad()
    def loglikelihood_tokens(self, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        for i, (context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ConceptError(f"request {i}: a context and a continuation of at least one token each are needed")
            if len(continuation) >= self.max_length:
                raise ConceptError(f"request {i}: its continuation has {len(continuation)} tokens, at least max_length "
                                   f"({self.max_length}); raise max_length or shorten it")
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][0]) + len(requests[i][1])))
        answers: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            # keep the last max_length tokens: the context is cut from the left
            rows = [(requests[i][0][-(self.max_length - len(requests[i][1])):], requests[i][1]) for i in batch]
            for i, logp in zip(batch, self._continuation_logprobs(rows)):
                target = torch.tensor(requests[i][1], device=logp.device)
                answers[i] = (float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all()))
        return answers

    def _continuation_logprobs(self, rows: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """Log-probabilities [n_i, V] at each continuation token of each (context, continuation) row."""
        with running(self.model, self.device):  # (the loaded model's dtype)
            return self._logprobs(rows)

    def _logprobs(self, rows: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        family = family_of(self.model)
        if type(family).score is not Family.score:  # (the default scores nothing: no padding made for it)
            context, context_valid = right_pad([c for c, _ in rows], self.eos, self.device)
            continuation, continuation_valid = right_pad([x for _, x in rows], self.eos, self.device)
            logits = family.score(self.model, context, context_valid, continuation, continuation_valid)
            if logits is not None:  # [B, Tx, V]: logits[:, k] predicts continuation token k
                return [logits[b, :len(x)].float().log_softmax(-1) for b, (_, x) in enumerate(rows)]
        ids, valid = right_pad([c + x for c, x in rows], self.eos, self.device)
        logits = self.model(ids, attention_mask=valid.long()).logits
        out = []
        for b, (c, x) in enumerate(rows):  # logits at t predict token t + 1
            out.append(logits[b, len(c) - 1: len(c) + len(x) - 1].float().log_softmax(-1))
        return out

    # -- rolling loglikelihood -------------------------------------------------------------------
    def loglikelihood_rolling(self, texts: list[str]) -> list[float]:
        """log p(text) in nats per text: its tokens in windows of max_length - 1, each window read after
        the token before it (the first after end-of-text), summed."""
        windows, owner = [], []
        for i, text in enumerate(texts):
            tokens = self.encode(text)
            step = self.max_length - 1
            for start in range(0, len(tokens), step):
                windows.append(([tokens[start - 1]] if start else [self.eos], tokens[start:start + step]))
                owner.append(i)
        totals = [0.0] * len(texts)
        for i, (logp, _) in zip(owner, self.loglikelihood_tokens(windows)):
            totals[i] += logp
        return totals

    # -- generation ------------------------------------------------------------------------------
    def generate_until(self, requests: list[tuple[str, dict]]) -> list[str]:
        """The text after each context (greedy unless ``do_sample``), cut before the first of ``until``;
        ``max_gen_toks`` new tokens at most (default 256). Other keys: ``do_sample``, ``temperature``,
        ``top_k``, ``top_p``, ``seed``."""
        jobs = []
        for i, (context, kwargs) in enumerate(requests):
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or ()
            until = (until,) if isinstance(until, str) else tuple(until)
            new = int(kwargs.pop("max_gen_toks", 256))
            if kwargs.get("temperature") == 0:  # lm-eval's greedy
                kwargs.pop("temperature")
                kwargs["do_sample"] = False
            known = {k: kwargs.pop(k) for k in ("do_sample", "temperature", "top_k", "top_p", "seed") if k in kwargs}
            if kwargs:
                raise ConceptError(f"request {i}: generation options {sorted(kwargs)} are not supported (known: until, "
                                   f"max_gen_toks, do_sample, temperature, top_k, top_p, seed)")
            if new < 1 or new >= self.max_length:
                raise ConceptError(f"request {i}: max_gen_toks must be between 1 and max_length - 1 "
                                   f"({self.max_length - 1}), got {new}")
            ids = self.encode(context) or [self.eos]
            settings = GenerationSettings(max_new_tokens=new, stop_strings=tuple(s for s in until if s), **known)
            problems = settings.validate()
            if problems:
                raise ConfigError(problems)
            jobs.append((ids[-(self.max_length - new):], settings))
        texts: list[str | None] = [None] * len(jobs)
        groups: dict = {}
        for i, (_, settings) in enumerate(jobs):  # one generate() call per batch of requests with the same settings
            groups.setdefault(astuple(settings), (settings, []))[1].append(i)
        for settings, members in groups.values():
            members.sort(key=lambda i: -len(jobs[i][0]))
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                out = generate(self.model, [jobs[i][0] for i in batch], settings=settings, tokenizer=self.tokenizer)
                for i, text in zip(batch, out.texts):
                    texts[i] = text
        return texts


def right_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] ids (``pad`` after each row) and the mask of real tokens."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long, device=device)
    valid = torch.zeros(len(rows), T, dtype=torch.bool, device=device)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r, dtype=torch.long, device=device)
        valid[b, :len(r)] = True
    return ids, valid
