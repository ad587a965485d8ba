"""Anti-collapse for learned codes (concept.codes): spherical k-means, pointing codes at queries, dead-code
revival (deterministic, logged, exact on resume) and k-means initialisation, in both families; bad input."""
import copy
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import concept
from concept import BuildConfig, ComponentRef
from concept.codes import QUERIES_PER_STEP, CodeRevival, CodeUse, KMeansInit, spherical_kmeans
from concept.distributed import Dist
from concept.errors import ConfigError
from concept.syncs import HostSyncs
from concept.training import TrainConfig, Trainer
from plugins.vocabularies.codebook import CodebookVocabConfig, CodebookVocabulary
from plugins.vocabularies.embedding import EmbeddingVocabConfig, EmbeddingVocabulary

from .test_objectives import interrupted_at_three
from .test_planner_executor import pe_config
from .test_training import corpus  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

CTX = SimpleNamespace(hidden_size=32, uses_null_class=True)


def vocabularies():
    torch.manual_seed(0)
    return {"codebook": CodebookVocabulary(CodebookVocabConfig(size=24, code_dim=8, levels=2), CTX),
            "embedding": EmbeddingVocabulary(EmbeddingVocabConfig(size=24), CTX)}


# -- the pieces ---------------------------------------------------------------------------------

def test_spherical_kmeans_finds_planted_clusters():
    g = torch.Generator().manual_seed(0)
    centers = F.normalize(torch.randn(6, 16, generator=g), dim=-1)
    points = F.normalize(centers.repeat_interleave(40, 0) + 0.05 * torch.randn(240, 16, generator=g), dim=-1)
    found = spherical_kmeans(points, 6, torch.Generator().manual_seed(1))
    sim = found @ centers.T
    assert found.shape == (6, 16) and torch.allclose(found.norm(dim=-1), torch.ones(6))
    assert sorted(sim.argmax(-1).tolist()) == list(range(6))  # one centroid per planted cluster
    assert float(sim.max(-1).values.min()) > 0.99
    wrong = F.normalize(torch.randn(6, 16, generator=g), dim=-1)  # negative control: random unit vectors
    assert float((wrong @ centers.T).max(-1).values.min()) < 0.9
    with pytest.raises(ValueError, match="need 1 <= k <= n"):
        spherical_kmeans(points[:3], 4, g)


@pytest.mark.parametrize("name", ["codebook", "embedding"])
def test_a_code_pointed_at_a_state_is_that_states_best_code(name):
    vocab = vocabularies()[name]
    states = torch.randn(5, 32) * 7
    ids = torch.tensor([3, 11, 17, 20, 0])
    before = vocab.logits(states)[:, : vocab.size].argmax(-1)
    assert not torch.equal(before, ids)  # negative control: they were not
    probe = torch.randn(3, 32)
    untouched = torch.ones(vocab.size + 1, dtype=torch.bool)
    untouched[ids] = False
    other = vocab.logits(probe)[:, untouched]
    vocab.set_codes(0, ids, vocab.query(states))
    assert torch.equal(vocab.logits(states)[:, : vocab.size].argmax(-1), ids)
    assert torch.equal(vocab.logits(probe)[:, untouched], other)  # the other codes (and NULL) are not touched


def test_a_deeper_codebook_level_is_pointed_at_what_the_levels_below_left():
    vocab = vocabularies()["codebook"]
    states = torch.randn(4, 32)
    first = vocab.logits(states, 0)[:, :24].argmax(-1)
    ids = torch.tensor([5, 6, 7, 8])
    level0 = vocab.book(0).detach().clone()
    vocab.set_codes(1, ids, vocab.query(states, first[:, None]))
    assert torch.equal(vocab.logits(states, 1, first[:, None])[:, :24].argmax(-1), ids)
    assert torch.equal(vocab.book(0), level0)  # level 0's codebook is not touched


# -- revival on its own -------------------------------------------------------------------------

class Stream:
    """A fake model whose every micro-batch emits the given ids from given states, into one codebook."""

    def __init__(self, vocab):
        self.vocab = vocab

    def code_vocabularies(self):
        return [("", self.vocab)]

    def code_uses(self, out):
        return [CodeUse("concept", self.vocab, 0, out.ids, out.states)]


def drive(objective, model, steps, start=0, ids=(0, 1), n=6, seed=0, counted=None):
    """``steps`` training steps of one micro-batch each; returns what device_step logged (its device values
    read). ``counted``: a list that gets each step's :class:`HostSyncs` (the step alone, not the read)."""
    logged = []
    for step in range(start, start + steps):
        objective.before_step(SimpleNamespace(dist=Dist(), step=step))
        g = torch.Generator().manual_seed(seed * 100 + step)
        out = SimpleNamespace(ids=torch.tensor(list(ids) * (n // len(ids))), states=torch.randn(n, 32, generator=g))
        skipped = torch.tensor(False)
        with HostSyncs() as seen:
            objective.stats(model, {}, out)
            row = objective.device_step(model, {}, {}, skipped)
        if counted is not None:
            counted.append(seen)
        logged.append({k: float(v) if isinstance(v, torch.Tensor) else v for k, v in row.items()})
    return logged


def test_codes_unused_for_n_steps_are_revived_every_n_steps_from_the_steps_queries():
    """Every step counts each code's idle steps (on the device); the steps N, 2N, ... revive the codes idle for
    N steps or more (one declared host sync per N steps)."""
    vocab = vocabularies()["codebook"]
    model, start = Stream(vocab), vocab.codebook.detach().clone()
    revival = CodeRevival(after=3, seed=0)
    logged = drive(revival, model, 2)
    assert [r["revived"] for r in logged] == [0, 0] and torch.equal(vocab.codebook, start)  # not idle long enough
    assert logged[1]["idle_share"] == 0.0  # 22 of 24 codes idle for 2 steps, none for 3 yet
    logged = drive(revival, model, 1, start=2)
    # step 3: the 22 unused codes are dead; the step's 6 queries revive 6 of them
    assert logged[0]["revived"] == 6
    assert logged[0]["idle_share"] == pytest.approx(22 / 24)
    changed = (vocab.codebook != start).any(-1)
    assert int(changed.sum()) == 6 and not bool(changed[:2].any())  # the used codes 0 and 1 are never touched
    idle = revival.idle["concept"]
    assert int((idle == 0).sum()) == 8 and int((idle == 3).sum()) == 16  # revived and used: 0; the rest still dead
    third = vocab.codebook.detach().clone()
    logged = drive(revival, model, 2, start=3)
    assert [r["revived"] for r in logged] == [0, 0] and torch.equal(vocab.codebook, third)  # steps 4, 5: counted only
    assert [r["idle_share"] for r in logged] == pytest.approx([16 / 24, 16 / 24])
    logged = drive(revival, model, 1, start=5)
    # step 6: the 16 idle for 6 steps first (the longest idle), then the 6 revived at step 3 and unused since
    assert logged[0]["revived"] == 6 and logged[0]["idle_share"] == pytest.approx(22 / 24)
    assert int((vocab.codebook != start).any(-1).sum()) == 12 and int(((vocab.codebook != third).any(-1)).sum()) == 6
    idle = revival.idle["concept"]
    assert [int((idle == k).sum()) for k in (0, 3, 6)] == [8, 6, 10]


class PerStepRevival(CodeRevival):
    """The revival as it was before 2026-11-27 (the slow reference): usage counted on the host (``.cpu()``) per
    micro-batch, and after every step (``after_step``, which made the trainer read every step's log) the codes
    idle for N steps revived."""

    def before_step(self, context) -> None:
        super().before_step(context)
        self._queries = {}

    def stats(self, model, batch, out):
        for use in model.code_uses(out):
            use = use.chosen()
            K = use.vocabulary.size
            used = self._used.setdefault(use.name, torch.zeros(K, dtype=torch.float64))
            used += torch.bincount(use.ids.detach().cpu().long(), minlength=K)[:K].double()
            if use.ids.numel():
                self._queries.setdefault(use.name, []).append(use.queries(QUERIES_PER_STEP).cpu())
            self._targets[use.name] = use
        return {}

    def device_step(self, model, means, totals, skipped):
        return {}

    def after_step(self, model, means, totals):
        dist, revived, idle_codes, codes = self.dist, 0, 0, 0
        for i, (name, use) in enumerate(sorted(self._targets.items())):
            K = use.vocabulary.size
            used = torch.tensor(dist.sum(self._used[name].tolist()) if dist else self._used[name].tolist())
            idle = self.idle.get(name, torch.zeros(K, dtype=torch.long))
            idle = torch.where(used > 0, torch.zeros_like(idle), idle + 1)
            dead = (idle >= self.after).nonzero().flatten()
            idle_codes, codes = idle_codes + len(dead), codes + K
            if len(dead):
                local = self._queries.get(name, [])
                gathered = dist.gather_objects(local) if dist else [local]
                queries = torch.cat([q for qs in gathered for q in qs]) if any(gathered) else None
            if len(dead) and queries is not None:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step * 101 + i)
                order = dead[torch.randperm(len(dead), generator=g)]
                order = order[idle[order].argsort(descending=True, stable=True)][: queries.shape[0]]
                pick = torch.randperm(queries.shape[0], generator=g)[: len(order)]
                use.vocabulary.set_codes(use.level, order.to(use.ids.device), queries[pick].to(use.states.device))
                idle[order] = 0
                revived += len(order)
            self.idle[name] = idle
        return {"revived": revived, "idle_share": idle_codes / codes} if codes else {}


def drive_both(after, steps, ids=(0, 1, 2), n=6):
    """The revival and its per-step reference on twin codebooks, ``steps`` steps of one micro-batch (masked
    uses, as the models give them: every position's ids and states, half of them emitted); returns (the
    codebooks, what each logged, the revival's counts per step)."""
    twins, logged, counted = [vocabularies()["codebook"], vocabularies()["codebook"]], ([], []), []
    revivals = [CodeRevival(after, seed=2), PerStepRevival(after, seed=2)]
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        out = SimpleNamespace(ids=torch.tensor(list(ids) * (2 * n // len(ids))),
                              states=torch.randn(2 * n, 32, generator=g), mask=torch.arange(2 * n) % 2 == 0)
        for k, (revival, vocab) in enumerate(zip(revivals, twins)):
            model = SimpleNamespace(code_uses=lambda o, v=vocab: [CodeUse("concept", v, 0, o.ids, o.states,
                                                                          mask=o.mask)])
            revival.before_step(SimpleNamespace(dist=Dist(), step=step))
            skipped = torch.tensor(False)
            with HostSyncs() as seen:
                revival.stats(model, {}, out)
                row = revival.device_step(model, {}, {}, skipped)
            row.update(revival.after_step(model, {}, {}))
            logged[k].append({key: float(v) for key, v in row.items()})
            if k == 0:
                counted.append(seen)
    return twins, logged, counted


@pytest.mark.parametrize("after, steps", [(1, 4), (3, 3)])
def test_revival_equals_the_per_step_one_at_its_steps(after, steps):
    """Every N-th step revives what the per-step revival revived there: with N = 1 at every step, with N = 3
    through the first revival step (before it nothing is idle for N steps); bit for bit. Between revival
    steps nothing is read: no hidden sync, and no declared one. Negative control: one step after the first
    revival with N = 3 the per-step revival moves codes that the new one leaves for step 6."""
    (new, old), (a, b), counted = drive_both(after, steps)
    start = vocabularies()["codebook"].codebook
    assert torch.equal(new.codebook, old.codebook) and not torch.equal(new.codebook, start)
    assert a == b and a[-1]["revived"] > 0
    assert all(c.hidden == 0 for c in counted), [dict(c.syncs) for c in counted]
    assert [dict(c.declared) for c in counted] == [{"code revival": 1} if (i + 1) % after == 0 else {}
                                                   for i in range(steps)]
    if after == 3:
        (new, old), (a, b), _ = drive_both(after, steps + 1)
        assert a[-1]["revived"] == 0 < b[-1]["revived"] and not torch.equal(new.codebook, old.codebook)


def test_revival_is_deterministic_and_resumes_exactly_from_its_state(monkeypatch):
    """A resumed revival revives what the run without a break does. Its idle counters (a checkpoint's ints)
    reach the step's device in its first step through one pinned, non-blocking copy (``concept.syncs.upload``;
    a ``.to()`` from pageable memory would wait on CUDA): no hidden sync. Negative controls: resumed without the
    counters, other codes are revived; the counters made in the step with ``torch.tensor(..., device=)`` are
    counted as the sync they are on CUDA."""
    def resumed(state, vocab, counted):
        again = CodeRevival(after=2, seed=5)
        again.load_state_dict(state, None)
        drive(again, Stream(vocab), 2, start=3, ids=(0, 1, 2), counted=counted)  # (step 4: a revival step)
        return again

    straight_vocab, again_vocab = vocabularies()["codebook"], vocabularies()["codebook"]
    straight = CodeRevival(after=2, seed=5)
    drive(straight, Stream(straight_vocab), 5, ids=(0, 1, 2))
    first = CodeRevival(after=2, seed=5)
    drive(first, Stream(again_vocab), 3, ids=(0, 1, 2))
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    counted = []
    resumed(state, copy.deepcopy(again_vocab), counted)
    assert [(c.hidden, dict(c.declared)) for c in counted] == [(0, {"code revival": 1}), (0, {})]
    with monkeypatch.context() as m:
        m.setattr("concept.codes.upload", lambda data, dtype, device: torch.tensor(data, dtype=dtype, device=device))
        counted = []
        resumed(state, copy.deepcopy(again_vocab), counted)
        assert dict(counted[0].syncs) == {"tensor from host data": 1}
    again = resumed(state, again_vocab, [])
    assert torch.equal(straight_vocab.codebook, again_vocab.codebook)
    assert torch.equal(straight.idle["concept"], again.idle["concept"])
    # negative control: resuming without the idle counters revives other codes
    lost_vocab = vocabularies()["codebook"]
    lost = CodeRevival(after=2, seed=5)
    drive(lost, Stream(lost_vocab), 3, ids=(0, 1, 2))
    forgetful = CodeRevival(after=2, seed=5)
    drive(forgetful, Stream(lost_vocab), 2, start=3, ids=(0, 1, 2))
    assert not torch.equal(straight_vocab.codebook, lost_vocab.codebook)


def test_kmeans_init_points_codes_at_the_centroids_of_the_first_batches_queries():
    vocab = vocabularies()["codebook"]
    model = Stream(vocab)
    g = torch.Generator().manual_seed(3)
    batches = [SimpleNamespace(ids=torch.zeros(30, dtype=torch.long), states=torch.randn(30, 32, generator=g))
               for _ in range(2)]
    model.eval, model.train, model.training = (lambda: None), (lambda mode=True: None), True
    context = SimpleNamespace(step=0, model=model, batch=lambda i: i, forward=lambda i: batches[i],
                              gathered=lambda: __import__("contextlib").nullcontext())  # (a StepContext's parts)
    init = KMeansInit(batches=2, seed=7)
    init.before_step(context)
    queries = torch.cat([vocab.query(b.states) for b in batches]).detach()
    centroids = spherical_kmeans(queries, 24, torch.Generator().manual_seed(7 * 1_000_003))
    assert torch.allclose(F.normalize(vocab.codebook, dim=-1), centroids, atol=1e-6)
    skipped = torch.tensor(False)
    assert init.device_step(model, {}, {}, skipped) == {"kmeans_codes": 24, "kmeans_states": 60}
    assert init.device_step(model, {}, {}, skipped) == {}  # logged once
    later = vocab.codebook.detach().clone()
    KMeansInit(batches=2, seed=7).before_step(SimpleNamespace(**{**vars(context), "step": 3}))  # a resumed run
    assert torch.equal(vocab.codebook, later)


# -- in the trainer, both families --------------------------------------------------------------

@pytest.fixture(scope="module")
def codebook_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "codebook"
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                          "intermediate": 64}),
                      split="1,2,1", vocabulary=ComponentRef("codebook", {"size": 64, "code_dim": 8}),
                      attention=ComponentRef("chunked", {"chunk": 16}))
    concept.save(concept.build(cfg), out)
    return out


def small(**kw):
    base = dict(steps=6, seq_len=32, batch=2, eval_every=100, eval_batches=1, checkpoint_every=3, log_every=100,
                warmup=2, lora=concept.lora.LoraSettings(rank=2), revive_after=2, kmeans_init=1)
    base.update(kw)
    return TrainConfig(**base)


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_streaming_training_revives_and_resumes_exactly(codebook_run, corpus, tmp_path):  # noqa: F811
    straight = Trainer.start(codebook_run, tmp_path / "straight", small(data=str(corpus)))
    assert [o.name for o in straight.objectives][-2:] == ["kmeans_init", "code_revival"]
    straight.train()
    a = rows(tmp_path / "straight")
    assert a[0]["kmeans_codes"] > 0 and "kmeans_codes" not in a[1]
    assert all("revived" in r and 0 <= r["idle_share"] <= 1 for r in a) and sum(r["revived"] for r in a) > 0
    resumed = interrupted_at_three(codebook_run, tmp_path / "resumed", small(data=str(corpus)))
    with HostSyncs() as seen:  # the resumed run's first step: its restored counters uploaded without a sync
        resumed.queue_step()
    assert seen.hidden == 0 and dict(seen.declared) == {"policy scan": 1, "code revival": 1}, dict(seen.syncs)
    resumed.train()
    b = rows(tmp_path / "resumed")
    for key in ("loss", "revived", "idle_share"):
        assert [r[key] for r in a] == [r[key] for r in b], key  # bit for bit
    one, two = concept.load(tmp_path / "straight"), concept.load(tmp_path / "resumed")
    assert torch.equal(one.vocabulary.codebook, two.vocabulary.codebook)


def test_planner_training_revives_each_types_codes_and_resumes_exactly(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "pe"
    types = [{"name": "topic", "size": 8, "max_len": 2}, {"name": "gist", "size": 16, "max_len": 4}]
    cfg = pe_config(types=types)
    cfg.vocabulary = ComponentRef("codebook", {"code_dim": 8})
    concept.save(concept.build(cfg), out)
    train = dict(data=str(corpus), steps=4, seq_len=24, checkpoint_every=2, task="continue", context_len=12,
                 revive_after=1)
    straight = Trainer.start(out, tmp_path / "straight", small(**train))
    straight.train()
    a = rows(tmp_path / "straight")
    assert sum(r["revived"] for r in a) > 0 and "kmeans_codes" in a[0]
    revival = next(o for o in straight.objectives if o.name == "code_revival")
    assert sorted(revival.idle) == ["gist", "topic"]
    interrupted_at_three(out, tmp_path / "resumed", small(**train)).train()
    assert [(r["loss"], r["revived"]) for r in rows(tmp_path / "resumed")] == [(r["loss"], r["revived"]) for r in a]


def test_bad_anti_collapse_input_is_a_clear_error(codebook_run, corpus, tmp_path):  # noqa: F811
    fsq = tmp_path / "fsq"
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                          "intermediate": 64}),
                      split="1,2,1", vocabulary=ComponentRef("fsq", {"levels_per_dim": [4, 4]}))
    concept.save(concept.build(cfg), fsq)
    with pytest.raises(ConfigError, match=r"--revive-after: the FSQVocabulary vocabulary has no code rows"):
        Trainer.start(fsq, tmp_path / "a", small(data=str(corpus), kmeans_init=0))
    assert not (tmp_path / "a").exists()  # nothing written
    with pytest.raises(ConfigError, match="revive-after: .* FSDP2"):
        Trainer.check(small(data=str(corpus)), BuildConfig.from_dict(json.loads((codebook_run / "concept.json").read_text())["config"]),
                      Dist(mode="fsdp2", world_size=2))
    dense = Trainer.start(codebook_run, tmp_path / "dense", small(data=str(corpus), baseline="dense", steps=1))
    assert any("--revive-after / --kmeans-init do nothing" in n for n in dense.notes)
    problems = small(data=str(corpus), revive_after=-1, kmeans_init=-2).validate(2048, 4)
    assert any("revive-after" in p for p in problems) and any("kmeans-init" in p for p in problems)
