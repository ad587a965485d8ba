"""Diagnostics (docs/diagnostics.md): step signals, grad norms, held-out evaluation with ΔNLL controls,
compression map. Tiny random backbones; every expected value is computed by hand."""
import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from concept.diagnostics import compression_map, evaluate, grad_norms, step_diagnostics

K = 32  # tiny_config's concept vocabulary
DENSE_KEYS = {"tokens", "nll", "bits_per_token", "perplexity", "nll_by_position", "tokens_by_position"}
CONCEPT_KEYS = {"ratio", "concepts", "usage_perplexity", "usage_fraction", "head_entropy", "max_prob",
                "boundary_prob", "cos_soft_hard", "gate_norm"}
CONTROL_KEYS = {"delta_nll_shuffle", "delta_nll_random", "delta_nll_codes_shuffled", "delta_nll_codes_zero"}
DEPTH_KEYS = {f"nll_{part}{path}" for part in ("concepts", "tails") for path in ("", "_keep_all", "_skip_middle")}


def make_batch(seed=0, B=3, T=24):
    """Padding on both sides and two packed documents in row 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 5:] = 0  # right padding
    if B > 2:
        mask[2, :4] = 0  # left padding
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, 10:] = 1
    return {"input_ids": ids, "attention_mask": mask, "document_ids": doc}


def set_keep_fraction(model, batch, fraction):
    """Move the NULL bias so that about ``fraction`` of the batch's tokens keep naturally."""
    with torch.no_grad():
        model.length_policy.null_bias.zero_()
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        logit = model.length_policy.keep_logit(out.head_logits)[batch["attention_mask"].bool()]
        model.length_policy.null_bias.fill_(float(torch.quantile(logit, 1 - fraction)))
    return model


@pytest.fixture
def model(tiny_models):
    """A private copy (tests change its NULL bias / table / mode) keeping about half the tokens."""
    m = copy.deepcopy(tiny_models())
    return set_keep_fraction(m, make_batch(), 0.5)


def fake_out(keep, ids, head_logits):
    return SimpleNamespace(keep=keep, concept_ids=torch.where(keep, ids, -1), head_logits=head_logits)


def hand_nll(logits, ids, mask, doc):
    """Mean CE over pairs (t, t+1) of real tokens of the same document, one pair at a time."""
    losses = []
    B, T = ids.shape
    for b in range(B):
        for t in range(T - 1):
            if mask[b, t] and mask[b, t + 1] and doc[b, t] == doc[b, t + 1]:
                losses.append(F.cross_entropy(logits[b, t][None].float(), ids[b, t + 1][None]).item())
    return sum(losses) / len(losses), len(losses)


# -- step diagnostics -------------------------------------------------------------------------
def test_step_diagnostics_values_in_range(model):
    batch = make_batch()
    model.train()
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"],
                document_ids=batch["document_ids"])
    with torch.no_grad():
        d = step_diagnostics(model, out, batch)
    assert set(d) == CONCEPT_KEYS - {"concepts"}
    valid = batch["attention_mask"].bool()
    assert d["ratio"] == pytest.approx(float(out.keep[valid].float().mean()))
    assert 0 < d["ratio"] < 1
    assert 0 <= d["head_entropy"] <= math.log(K) + 1e-5
    assert 1 / K - 1e-6 <= d["max_prob"] <= 1
    assert 0 <= d["boundary_prob"] <= 1
    n_concepts = int(out.keep[valid].sum())
    assert 1 <= d["usage_perplexity"] <= min(K, n_concepts) + 1e-4
    assert 0 < d["usage_fraction"] <= 1
    assert d["usage_fraction"] == len(set(out.concept_ids[out.keep].tolist())) / K
    assert -1 <= d["cos_soft_hard"] <= 1 + 1e-6
    assert all(isinstance(v, float) for v in d.values())


def test_usage_perplexity_uniform_is_K_and_collapse_is_one(model):
    keep = torch.ones(1, K, dtype=torch.bool)
    logits = torch.randn(1, K, K + 1)
    uniform = step_diagnostics(model, fake_out(keep, torch.arange(K)[None], logits), {})
    assert uniform["usage_perplexity"] == pytest.approx(K, rel=1e-6)
    assert uniform["usage_fraction"] == 1.0
    collapsed = step_diagnostics(model, fake_out(keep, torch.full((1, K), 5), logits), {})
    assert collapsed["usage_perplexity"] == pytest.approx(1.0, abs=1e-9)
    assert collapsed["usage_fraction"] == 1 / K
    # two ids, equally often: perplexity 2; padding positions are not counted
    ids = torch.tensor([[1, 2, 1, 2, 7, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    two = step_diagnostics(model, fake_out(torch.ones(1, 6, dtype=torch.bool), ids, logits[:, :6]),
                           {"attention_mask": mask})
    assert two["usage_perplexity"] == pytest.approx(2.0)
    assert two["ratio"] == 1.0


def test_cos_soft_hard_is_one_for_one_hot_probs(model):
    ids = torch.randint(0, K, (2, 10))
    keep = torch.rand(2, 10) < 0.6
    keep[0, 0] = True
    one_hot = F.one_hot(ids, K + 1).float() * 60.0  # softmax is one-hot to float precision
    d = step_diagnostics(model, fake_out(keep, ids, one_hot), {})
    assert d["cos_soft_hard"] == pytest.approx(1.0, abs=1e-5)
    assert d["max_prob"] == pytest.approx(1.0, abs=1e-6)
    assert d["head_entropy"] == pytest.approx(0.0, abs=1e-5)
    flat = step_diagnostics(model, fake_out(keep, ids, torch.zeros(2, 10, K + 1)), {})
    assert flat["head_entropy"] == pytest.approx(math.log(K), rel=1e-5)
    assert flat["max_prob"] == pytest.approx(1 / K, rel=1e-5)
    assert flat["cos_soft_hard"] < 0.9  # the table mean is far from any one row


def test_step_diagnostics_without_concepts_are_nan_not_errors(model):
    keep = torch.zeros(1, 5, dtype=torch.bool)
    d = step_diagnostics(model, fake_out(keep, torch.zeros(1, 5, dtype=torch.long), torch.randn(1, 5, K + 1)), {})
    assert d["ratio"] == 0.0 and d["usage_fraction"] == 0.0
    assert math.isnan(d["head_entropy"]) and math.isnan(d["cos_soft_hard"]) and math.isnan(d["usage_perplexity"])


# -- grad norms -----------------------------------------------------------------------------
def test_grad_norms_per_group(model):
    batch = make_batch()
    model.train()
    model.zero_grad(set_to_none=True)
    assert grad_norms(model) == {"vocabulary": 0.0, "length_policy": 0.0, "sampler": 0.0, "positions": 0.0,
                                 "tail_fusion": 0.0, "concept_gate": 0.0, "lora": 0.0}
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"])
    out.loss.backward()
    norms = grad_norms(model)
    expected = torch.cat([p.grad.flatten() for p in model.vocabulary.parameters() if p.grad is not None]).norm()
    assert norms["vocabulary"] == pytest.approx(float(expected), rel=1e-5)
    assert norms["vocabulary"] > 0
    assert norms["lora"] == 0.0 and norms["length_policy"] == 0.0


def test_grad_norms_lora_parameters():
    class Stub(nn.Module):
        def __init__(self):
            super().__init__()
            self.lora_A = nn.Linear(3, 2, bias=False)
            self.base = nn.Linear(3, 2, bias=False)

    stub = Stub()
    (stub.lora_A(torch.ones(1, 3)).sum() + stub.base(torch.ones(1, 3)).sum()).backward()
    assert grad_norms(stub) == {"lora": pytest.approx(float(stub.lora_A.weight.grad.norm()))}


# -- evaluate -------------------------------------------------------------------------------
def test_evaluate_nll_equals_hand_computed_ce(model):
    batches = [make_batch(0), make_batch(1, B=2, T=17)]
    result = evaluate(model, batches, controls=False)
    assert set(result) == DENSE_KEYS | CONCEPT_KEYS
    total, n = 0.0, 0
    with torch.no_grad():
        for b in batches:
            out = model(b["input_ids"], attention_mask=b["attention_mask"], document_ids=b["document_ids"])
            mean, count = hand_nll(out.logits, b["input_ids"], b["attention_mask"], b["document_ids"])
            total, n = total + mean * count, n + count
    assert result["tokens"] == n
    assert result["nll"] == pytest.approx(total / n, rel=1e-6)
    assert result["bits_per_token"] == pytest.approx(result["nll"] / math.log(2))
    assert result["perplexity"] == pytest.approx(math.exp(result["nll"]))
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    assert result["ratio"] == pytest.approx(result["concepts"] / real)


def test_nll_by_position_buckets_average_back_to_nll(model):
    batch = make_batch(2, B=3, T=30)
    result = evaluate(model, [batch], bucket=4, controls=False)
    buckets, counts = result["nll_by_position"], result["tokens_by_position"]
    assert list(buckets) == list(counts) and list(buckets)[0] == "0-4" and len(buckets) > 4
    weighted = sum(buckets[k] * counts[k] for k in buckets) / sum(counts.values())
    assert weighted == pytest.approx(result["nll"], rel=1e-9)
    # counts by hand: the pair (t, t+1) belongs to the bucket of t's position inside its document
    hand = {}
    ids, mask, doc = batch["input_ids"], batch["attention_mask"], batch["document_ids"]
    for b in range(ids.shape[0]):
        p = -1
        for t in range(ids.shape[1] - 1):
            if mask[b, t]:
                p = 0 if (p < 0 or doc[b, t] != doc[b, t - 1]) else p + 1
            if mask[b, t] and mask[b, t + 1] and doc[b, t] == doc[b, t + 1]:
                key = f"{p // 4 * 4}-{p // 4 * 4 + 4}"
                hand[key] = hand.get(key, 0) + 1
    assert counts == hand


def test_delta_shuffle_is_exactly_zero_with_one_concept(model):
    """No natural boundary; max_run=3 forces exactly one concept (t=3) in 6 tokens."""
    model.length_policy.null_bias.fill_(1e4)
    batch = {"input_ids": torch.randint(0, 97, (1, 6)), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    result = evaluate(model, [batch])
    assert result["concepts"] == 1
    assert result["delta_nll_shuffle"] == 0.0


def test_delta_shuffle_nonzero_with_several_concepts(model):
    with torch.no_grad():
        model.vocabulary.table.weight.mul_(20.0)  # concepts dominate the deep stack's input
    result = evaluate(model, [make_batch(3), make_batch(4)], seed=1)
    assert set(result) == DENSE_KEYS | CONCEPT_KEYS | CONTROL_KEYS | DEPTH_KEYS
    assert result["concepts"] > 5 and result["usage_fraction"] > 1 / K
    assert result["delta_nll_shuffle"] != 0.0
    assert result["delta_nll_random"] != 0.0
    assert evaluate(model, [make_batch(3), make_batch(4)], seed=1) == result  # seeded


def test_depth_decomposition_by_hand(model):
    """NLL at concept / tail positions of the model, of keep-all and of no-concept (skip-middle)
    forwards of the same weights, each computed by hand from the per-pair CE."""
    batches = [make_batch(5), make_batch(6, B=2, T=19)]
    result = evaluate(model, batches)
    sums = {}
    with torch.no_grad():
        for b in batches:
            ids, mask, doc = b["input_ids"], b["attention_mask"], b["document_ids"]
            out = model(ids, attention_mask=mask, document_ids=doc)
            keep = out.keep
            paths = {"": out.logits,
                     "_keep_all": model(ids, attention_mask=mask, document_ids=doc, keep=mask.bool()).logits,
                     "_skip_middle": model(ids, attention_mask=mask, document_ids=doc, keep=torch.zeros_like(keep)).logits}
            for bi in range(ids.shape[0]):
                for t in range(ids.shape[1] - 1):
                    if mask[bi, t] and mask[bi, t + 1] and doc[bi, t] == doc[bi, t + 1]:
                        part = "concepts" if keep[bi, t] else "tails"
                        sums[part] = sums.get(part, 0) + 1
                        for path, logits in paths.items():
                            ce = F.cross_entropy(logits[bi, t][None].float(), ids[bi, t + 1][None]).item()
                            sums["nll_" + part + path] = sums.get("nll_" + part + path, 0.0) + ce
    assert sums["concepts"] > 3 and sums["tails"] > 3
    for key in DEPTH_KEYS:
        part = key.split("_")[1]
        assert result[key] == pytest.approx(sums[key] / sums[part], rel=1e-5), key
    weighted = (result["nll_concepts"] * sums["concepts"] + result["nll_tails"] * sums["tails"]) / result["tokens"]
    assert weighted == pytest.approx(result["nll"], rel=1e-6)
    assert not DEPTH_KEYS & set(evaluate(model, batches, controls=False))


def test_delta_nll_positive_when_concepts_were_fitted(model):
    """Fit the concept table to one batch (the ids stay the argmax decisions): replacing the
    concepts by shuffled or random ids must then cost NLL."""
    batch = make_batch(5, B=2, T=20)
    set_keep_fraction(model, batch, 0.4)
    model.eval()  # deterministic decisions (argmax); the ST path still gives the table gradients
    for p in model.parameters():
        p.requires_grad_(False)
    table = model.vocabulary.table.weight
    table.requires_grad_(True)
    opt = torch.optim.Adam([table], lr=0.1)
    for _ in range(10):
        opt.zero_grad()
        model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"]).loss.backward()
        opt.step()
    result = evaluate(model, [batch])
    assert 0.2 < result["ratio"] < 0.8
    assert result["delta_nll_random"] > 0.05  # about 0.1-0.2 nats here
    assert result["delta_nll_shuffle"] > 0.05


def test_evaluate_restores_every_module_mode(model):
    model.train()
    model.backbone.lm_head.eval()  # a deliberately mixed state must come back as it was
    before = [m.training for m in model.modules()]
    evaluate(model, [make_batch()], controls=False)
    assert [m.training for m in model.modules()] == before
    model.eval()
    evaluate(model, [make_batch()], controls=False)
    assert not any(m.training for m in model.modules())


def test_dense_stand_in_gets_only_dense_keys(model):
    class Bigram:
        """Not a module: an object whose forward returns something with .logits."""

        def __init__(self):
            self.table = torch.randn(97, 97, generator=torch.Generator().manual_seed(0))

        def forward(self, input_ids, attention_mask=None):
            return SimpleNamespace(logits=self.table[input_ids])

    batch = make_batch()
    stand_in = Bigram()
    result = evaluate(stand_in, [batch])
    assert set(result) == DENSE_KEYS
    mean, n = hand_nll(stand_in.table[batch["input_ids"]], batch["input_ids"], batch["attention_mask"],
                       batch["document_ids"])
    assert result["tokens"] == n and result["nll"] == pytest.approx(mean, rel=1e-6)
    # the Hugging Face backbone itself is a dense model too
    hf = evaluate(model.backbone, [batch])
    assert set(hf) == DENSE_KEYS and math.isfinite(hf["nll"])


# -- compression map ------------------------------------------------------------------------
class PrintableTokenizer:
    """One token per printable ASCII character (ids 0..94, inside the tiny vocabulary of 97)."""

    def encode(self, text):
        return [ord(c) - 32 for c in text]

    def decode(self, ids):
        return "".join(chr(i + 32) for i in ids)


def test_compression_map_highlights_the_concept_tokens(model):
    from rich.text import Text

    text = "def f(x):  return x + 1  # concepts?"
    tok = PrintableTokenizer()
    model.train()
    result = compression_map(model, tok, text)
    assert isinstance(result, Text) and model.training
    assert result.plain.startswith(text + "\n") and "ratio" in result.plain
    model.eval()
    with torch.no_grad():
        keep = model(torch.tensor([tok.encode(text)])).keep[0]
    highlighted = {s.start for s in result.spans if s.style == "bold reverse" and s.start < len(text)}
    assert highlighted == set(keep.nonzero().flatten().tolist())
    assert f"({int(keep.sum())} concepts / {len(text)} tokens)" in result.plain
    assert compression_map(model, tok, text, max_tokens=7).plain.startswith(text[:7] + "\n")
