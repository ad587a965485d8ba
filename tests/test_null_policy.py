"""`null` length policy: vectorised batched decisions equal the step-wise rule used in decoding."""
import pytest
import torch

from concept.components import BuildContext
from concept_plugins.length_policies.null import NullPolicy, NullPolicyConfig

K = 5  # NULL class index


def head_logits(index):
    """Head logits whose decision is ``index`` (NULL = K): the chosen class gets a large logit."""
    return torch.nn.functional.one_hot(index, K + 1).float() * 10.0


def policy(max_run):
    ctx = BuildContext(hidden_size=8, vocab_size=10, num_layers=3, split=(1, 1, 1), concept_vocab_size=K)
    return NullPolicy(NullPolicyConfig(max_run=max_run), ctx)


def stepwise(p, index, valid):
    """Obviously correct loop: count NULLs, force a concept when max_run were seen in a row."""
    keep = torch.zeros_like(valid)
    for b in range(index.shape[0]):
        run = 0
        for t in range(index.shape[1]):
            if not valid[b, t]:
                run = 0
                continue
            k = bool(index[b, t] != K) or run >= p.max_run
            keep[b, t] = k
            run = 0 if k else run + 1
    return keep


@pytest.mark.parametrize("max_run", [1, 2, 3, 7])
@pytest.mark.parametrize("null_rate", [0.0, 0.5, 0.9, 1.0])
def test_batched_equals_stepwise_loop(max_run, null_rate):
    g = torch.Generator().manual_seed(max_run * 100 + int(null_rate * 10))
    index = torch.randint(0, K, (4, 40), generator=g)
    index[torch.rand(4, 40, generator=g) < null_rate] = K
    valid = torch.ones(4, 40, dtype=torch.bool)
    valid[1, 30:] = False  # right padding
    valid[2, :6] = False  # left padding
    p = policy(max_run)
    assert torch.equal(p.decide(None, head_logits(index), valid), stepwise(p, index, valid))


@pytest.mark.parametrize("max_run", [1, 3])
def test_step_api_equals_batched(max_run):
    g = torch.Generator().manual_seed(1)
    index = torch.randint(0, K + 1, (3, 30), generator=g)
    index[:, 5:20] = K  # a long NULL run
    p = policy(max_run)
    batched = p.decide(None, head_logits(index), torch.ones_like(index, dtype=torch.bool))
    state = p.init_state(3, index.device)
    steps = []
    for t in range(index.shape[1]):
        k, state = p.step(None, head_logits(index[:, t]), state)
        steps.append(k)
    assert torch.equal(torch.stack(steps, 1), batched)


def test_max_run_bounds_the_tail():
    p = policy(3)
    index = torch.full((1, 50), K)  # the head says NULL everywhere
    keep = p.decide(None, head_logits(index), torch.ones(1, 50, dtype=torch.bool))
    assert keep.sum() == 50 // 4
    runs, run = [], 0
    for k in keep[0].tolist():
        run = 0 if k else run + 1
        runs.append(run)
    assert max(runs) == 3


def test_document_starts_reset_the_run():
    """Packed documents: the NULL run restarts at each document, as if each were alone."""
    p = policy(2)
    index = torch.full((1, 12), K)
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]])
    starts = torch.tensor([[1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    keep = p.decide(None, head_logits(index), torch.ones(1, 12, dtype=torch.bool), reset=starts)
    alone = [p.decide(None, head_logits(index[:, doc[0] == d]), torch.ones(1, int((doc[0] == d).sum()), dtype=torch.bool))
             for d in range(3)]
    assert torch.equal(keep, torch.cat(alone, dim=1))


def test_null_bias_moves_the_ratio():
    p = policy(100)
    logits = torch.randn(2, 200, K + 1, generator=torch.Generator().manual_seed(0))
    valid = torch.ones(2, 200, dtype=torch.bool)
    rates = []
    for bias in (-3.0, 0.0, 3.0):
        p.null_bias.fill_(bias)
        rates.append(p.decide(None, logits, valid).float().mean().item())
    assert rates[0] > rates[1] > rates[2]
    probs = p.boundary_prob(logits)
    assert torch.all((probs >= 0.5) == p.decide(None, logits, valid))


def test_invalid_config():
    assert NullPolicyConfig(max_run=0).validate()
