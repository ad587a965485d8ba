"""``concept plugins list --check`` runs a tiny conformance forward per component (``concept.conformance``; issue
41, item 2): every built-in passes, and a component that imports but breaks its kind's contract at its first call
is reported as broken with the call that failed (negative controls: one deliberately broken variant per check)."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from concept import conformance
from concept.attention import AttentionPattern, sdpa
from concept.contracts import AttentionBackend, LengthPolicy, Sampler, TailFusion, Vocabulary
from concept_plugins.attention.sdpa import DenseMaskPattern
from concept_plugins.vocabularies.embedding import EmbeddingVocabulary

PACKAGE = '''
import torch
from torch import nn

from concept.contracts import LengthPolicy


class IndexPolicy(LengthPolicy, nn.Module):
    """docs/plugins.md's example before issue 41: `decide(h, index, valid)`, which the model calls with a `reset`."""

    def __init__(self, config, ctx=None):
        super().__init__()

    def decide(self, h, index, valid):
        t = torch.arange(index.shape[1]).expand_as(index[..., 0])
        return (t % 2 == 1) & valid.bool()

    def init_state(self, batch_size, device):
        return torch.zeros(batch_size, dtype=torch.long)

    def step(self, h_t, index_t, t):
        return t % 2 == 1, t + 1
'''


class EveryOther(LengthPolicy, nn.Module):
    def __init__(self, config=None, ctx=None, offset: int = 0):
        super().__init__()
        self.offset = offset  # a step rule off by `offset` tokens: disagrees with decide()

    def decide(self, h, head_logits, valid, reset=None):
        return (torch.arange(valid.shape[1]).expand_as(valid) % 2 == 1) & valid

    def init_state(self, batch_size, device):
        return torch.full((batch_size,), self.offset, dtype=torch.long)

    def step(self, h_t, head_logits_t, t):
        return t % 2 == 1, t + 1


class Disagrees(EveryOther):
    def __init__(self, config=None, ctx=None):
        super().__init__(offset=1)


class Unnormalised(Sampler, nn.Module):
    def __init__(self, config=None, ctx=None):
        super().__init__()

    def forward(self, logits):
        return logits.exp()  # not probabilities


class Normalised(Unnormalised):
    def forward(self, logits):
        return logits.softmax(-1)


class SoftMismatch(EmbeddingVocabulary):
    def embed_soft(self, probs):
        return super().embed_soft(probs) * 1.01  # a soft mixture of one id is not that id


class CausalPattern(AttentionPattern):
    def __init__(self, mask):
        self.mask = mask

    def __call__(self, query, key, value, scaling):
        return sdpa(query, key, value, scaling, self.mask).transpose(1, 2)


class Causal(AttentionBackend):
    """Plain causal attention over the packed slots: not the one-pass rule."""

    def __init__(self, config=None, ctx=None, exact: bool = False):
        self.exact = exact

    def plan(self, layout):
        if self.exact:
            return DenseMaskPattern(layout)
        L = layout.length
        return CausalPattern(torch.ones(L, L, dtype=torch.bool).tril().expand(len(layout.meta.time), L, L))


class Exact(Causal):
    def __init__(self, config=None, ctx=None):
        super().__init__(exact=True)


class Mixing(TailFusion, nn.Module):
    def __init__(self, config=None, ctx=None):
        super().__init__()

    def forward(self, tail, update, has):
        return tail + update.cumsum(1)  # reads earlier tokens: not per token


class PerToken(Mixing):
    def forward(self, tail, update, has):
        return tail + update * has[..., None]


@pytest.mark.parametrize("kind, good, bad, found", [
    ("length_policy", EveryOther, Disagrees, "decide() and step() disagree (first at token 0"),
    ("sampler", Normalised, Unnormalised, "must return probabilities"),
    ("vocabulary", EmbeddingVocabulary, SoftMismatch, "embed_soft(one_hot(ids)) must equal embed_hard(ids)"),
    ("attention", Exact, Causal, "differs from dense-mask SDPA over the one-pass rule"),
    ("tail_fusion", PerToken, Mixing, "must be a per-token function"),
])
def test_each_check_passes_a_conforming_component_and_fails_a_broken_one(kind, good, bad, found):
    assert conformance.problem(kind, good) is None
    assert found in conformance.problem(kind, bad)


def test_a_vocabulary_without_its_methods_fails_at_its_first_call():
    class Empty(Vocabulary, nn.Module):
        size = 4

        def __init__(self, config=None, ctx=None):
            super().__init__()

    assert "NotImplementedError" in conformance.problem("vocabulary", Empty)


@pytest.fixture()
def bad_policy(tmp_path, monkeypatch):
    (tmp_path / "index_policy.py").write_text(PACKAGE)
    info = tmp_path / "index_policy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: index-policy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[concept.length_policies]\nindex = index_policy:IndexPolicy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from concept import registry

    monkeypatch.setattr(registry, "_REGISTRIES", {})


def test_check_catches_the_old_doc_example_and_passes_every_builtin(bad_policy):
    from concept_cli.main import cli

    r = CliRunner().invoke(cli, ["plugins", "list", "--check", "--json"])
    assert r.exit_code == 1, r.output
    rows = {(row["kind"], row["name"]): row for row in json.loads(r.stdout)}
    bad = rows.pop(("length_policy", "index"))
    assert bad["status"] == "error" and bad["detail"] == (
        "length policy plugin 'index' from index-policy==0.1 (index_policy:IndexPolicy) fails its conformance check: "
        "decide(h, head_logits, valid, reset) failed: TypeError: IndexPolicy.decide() takes 4 positional arguments "
        "but 5 were given; fix or uninstall index-policy")
    assert rows and all(row["status"] == "ok" for row in rows.values()), [r for r in rows.values() if r["status"] != "ok"]
    assert "1 of" in r.stderr and "broken" in r.stderr
