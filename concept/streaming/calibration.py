"""Build-time ratio calibration: set a fresh model's NULL bias so that it already runs near its
target concepts-per-token ratio, before any training.

A freshly built head is untrained, and with the NULL bias at 0 the `null` policy emits a
concept at almost every token (the K concept logits outweigh the one NULL logit), so an
untrained model does not compress at all. ``calibrate`` runs the shallow stack and the head on
a few short rows of text (the training split of the default corpus, or ``data``) and bisects
the bias until the policy's own decisions (``policy.decide``, with its maximum run of NULLs,
its ratio tracker and document resets) emit ``target_ratio`` concepts per token on them: the
same machinery as the trainer's final calibration (``RatioControl.finish``,
``PIController.calibrate_exact``). A policy that tracks a target itself (the `null` and `mtp`
policies' per-document tracker) is pointed at ``target_ratio`` too.

Only policies whose ratio a bias controls (``null_bias`` + ``keep_logit``: `null`, `threshold`,
`mtp`) are calibrated; `fixed` and `entropy` set their ratio by their own parameters. It is
deterministic (the rows are a fixed function of the data: documents in sha256 order of their
names, packed with seed 0) and reads only the shallow stack, so it costs a few shallow
forwards; ``concept build`` calls it unless ``--no-calibrate``, and records the result in the
run's ``concept.json`` under ``calibration``. Training recalibrates the bias at its first step
and at its end anyway (with ``--ratio-control`` other than ``none``).

    model = concept.build(concept.BuildConfig(split="4,22,4"))
    concept.calibrate(model, target_ratio=0.125)   # {'target_ratio': 0.125, 'ratio': 0.125, 'null_bias': ...}
"""
from __future__ import annotations

import hashlib

import torch

from .. import data as data_
from ..contracts import TracksRatio
from ..errors import ConfigError
from ..packing import document_starts
from ..tokens import tokenizer_for
from .operating_point import DEFAULT_TARGET_RATIO
from . import gap
from .options import CALIBRATION_BATCH, CALIBRATION_SEQ_LEN, StreamingBuild
from .ratio import PIController, ratio_controllable

DEFAULT_BATCHES = 4  # batches of DEFAULT_BATCH rows of DEFAULT_SEQ_LEN tokens: 2,048 tokens
DEFAULT_BATCH, DEFAULT_SEQ_LEN = CALIBRATION_BATCH, CALIBRATION_SEQ_LEN  # (declared with the build options)
MIN_DOCUMENTS = 16  # rows are drawn from at least this many documents (when the data has them)


def calibratable(model) -> bool:
    """The model's length policy has a bias that sets its ratio (:func:`ratio_controllable`)."""
    return ratio_controllable(getattr(model, "length_policy", None))


def check(target_ratio: float, batches: int, batch: int, seq_len: int) -> list[str]:
    """The problems of a calibration's settings: the build options' declared checks, then the rows'."""
    problems = StreamingBuild(target_ratio=target_ratio, calibration_batches=batches).validate()
    return problems + [f"{name}: must be >= 1, got {value}" for name, value in (("batch", batch), ("seq-len", seq_len))
                       if value < 1]


def calibration_rows(model, data=None, rows: int = DEFAULT_BATCHES * DEFAULT_BATCH, seq_len: int = DEFAULT_SEQ_LEN,
                     text_field: str = "text", encoding_errors: str = "strict"):
    """Up to ``rows`` packed rows of ``seq_len`` tokens from the training split of ``data`` (default:
    the Python standard library), drawn from documents taken in sha256 order of their names (each cut
    to its first ``32 * seq_len`` characters). Returns (batch dict, label of the data)."""
    tokenizer = tokenizer_for(model)  # before reading: a backbone too small for bytes fails fast
    docs = data_.read_documents(data, "train", text_field, encoding_errors=encoding_errors)
    docs.sort(key=lambda d: hashlib.sha256(d.name.encode("utf-8", "surrogatepass")).hexdigest())
    cap, chosen, chars = 32 * seq_len, [], 0
    for d in docs:  # enough text for `rows` rows at <= 4 characters per token, from several documents
        chosen.append(data_.Document(d.name, d.text[:cap]))
        chars += len(chosen[-1].text)
        if len(chosen) >= MIN_DOCUMENTS and chars >= 4 * rows * seq_len:
            break
    packed = data_.PackedSequences(chosen, tokenizer, seq_len, seed=0, cache_dir=False)
    n = min(rows, len(packed))
    batch = packed.rows(packed.permutation(0)[:n])
    label = data_.builtin_corpus(data) or str(data)
    return batch, label



def decision_inputs(model, batches):
    """What a length policy decides on, for ``batches`` (dicts of ``input_ids`` / ``attention_mask`` /
    ``document_ids``), concatenated over them: (head logits, valid mask, document starts, shallow
    states or None). Only the shallow stack and the head run; call it under ``torch.no_grad()``
    with the model in the mode whose decisions are wanted. The shallow states are kept only for a
    policy that reads them (``reads_hidden``). Shared by ``calibrate`` and the trainer's final
    calibration."""
    reads_h = model.length_policy.reads_hidden
    logits, valid, reset, states = [], [], [], []
    for b in batches:
        mask = b["attention_mask"].bool()
        h = model.shallow_states(b["input_ids"], mask, b["document_ids"])
        logits.append(model.vocabulary.logits(h))
        states.append(h if reads_h else None)
        valid.append(mask)
        reset.append(document_starts(mask, b["document_ids"]))
    return torch.cat(logits), torch.cat(valid), torch.cat(reset), torch.cat(states) if reads_h else None

def calibrate(model, target_ratio: float = DEFAULT_TARGET_RATIO, data=None, batches: int = DEFAULT_BATCHES,
              batch: int = DEFAULT_BATCH, seq_len: int = DEFAULT_SEQ_LEN, text_field: str = "text",
              encoding_errors: str = "strict") -> dict | None:
    """Set ``model.length_policy.null_bias`` so that the untrained model emits ``target_ratio``
    concepts per token on ``batches`` x ``batch`` rows of ``seq_len`` tokens of ``data``.

    Returns what it did (also stored as ``model.calibration``, which ``concept.save`` writes to
    ``concept.json``): target_ratio, ratio (reached on those rows), null_bias, data, tokens, rows,
    seq_len; None for a policy whose ratio no bias controls. ``ConfigError`` for bad settings,
    ``ConceptError`` for unreadable data."""

    problems = check(target_ratio, batches, batch, seq_len)
    if problems:
        raise ConfigError(problems)
    if not calibratable(model):
        return None
    policy = model.length_policy
    resolution = model.resolution  # (None: a model built by hand)
    max_positions = resolution.backbone_info.max_positions if resolution is not None else 0
    seq_len = min(seq_len, max_positions) if max_positions else seq_len
    rows, label = calibration_rows(model, data, batches * batch, seq_len, text_field, encoding_errors)
    device = next(model.parameters()).device
    if isinstance(policy, TracksRatio):  # the tracker's target (null, mtp)
        gap.set_target(policy, target_ratio)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():  # only the shallow stack and the head
            logits, valid_all, reset, h = decision_inputs(model, ({k: v[start:start + batch].to(device)
                                                                   for k, v in rows.items()}
                                                                  for start in range(0, rows["input_ids"].shape[0], batch)))
            reached = PIController(target_ratio).calibrate_exact(  # 20 halvings: the bias to ~1e-5 of its range
                policy, logits, valid_all, reset, iters=20, h=h)
    finally:
        model.train(was_training)
    result = {"target_ratio": float(target_ratio), "ratio": float(reached), "null_bias": float(policy.null_bias),
              "data": label, "tokens": int(valid_all.sum()), "rows": int(valid_all.shape[0]), "seq_len": int(seq_len)}
    model.calibration = result
    return result
