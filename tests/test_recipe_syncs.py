"""Every recipe's training step makes no hidden host sync (issue 39, item 4; ``concept.syncs``): the streaming
family with every objective option on at once (``--usage-weight``, ``--placement``, ``--distill``, ``--align``,
a two-level codebook with ``--revive-after 2`` and ``--kmeans-init 1``) and the planner-executor with its own
(MTP concepts, commitment, <EOS>, quota, usage, revival, k-means), through a revival step. What is left is
declared: once per run (the first step's NULL-bias calibration, k-means), every N steps (code revival), per
forward (the policy scan; the planner's plan end check), per step (Hard-EM's E-step read). Negative controls: an
``.item()`` injected into an objective; Hard-EM's host E-step as it was. Every recipe and option alone:
``benchmarks/step_syncs.py`` (the slow test below)."""
import pathlib

import pytest
import torch

import concept
from benchmarks.step_syncs import CONTINUE, RECIPES, builds, corpus, count
from concept.planner.hard_em import HardEMObjective
from concept.streaming.objectives import UsageObjective
from concept.syncs import HostSyncs
from concept.training import TrainConfig, Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

EVERY_OPTION = {
    "streaming": ("codebook-2-levels", dict(usage_weight=0.1, placement=0.5, distill=1.0, align=0.5, revive_after=2,
                                            kmeans_init=1)),
    "planner-executor": ("planner-mtp", dict(CONTINUE, usage_weight=0.1, revive_after=2, kmeans_init=1)),
    "hard-em": ("planner-mtp", dict(CONTINUE, plan_training="hard-em", beam=2, estep_every=2)),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("recipe-syncs")
    corpus(folder)
    configs = builds()
    for name in {build for build, _ in EVERY_OPTION.values()}:
        torch.manual_seed(0)
        concept.save(concept.build(configs[name]), folder / "builds" / name)
    return folder


def trainer(folder, family, name=None):
    build, overrides = EVERY_OPTION[family]
    base = dict(steps=4, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=100, warmup=1,
                data=str(folder / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2))
    torch.manual_seed(0)
    return Trainer.start(folder / "builds" / build, folder / "runs" / (name or family),
                         TrainConfig(**{**base, **overrides}), force=True)


@pytest.mark.parametrize("family", ["streaming", "planner-executor"])
def test_a_step_with_every_objective_option_on_makes_no_hidden_sync(folder, family):
    run = trainer(folder, family)
    steps = []
    for _ in range(2):  # step 1 (calibration, k-means), step 2 (a revival step)
        with HostSyncs() as seen:
            run.queue_step()
        with HostSyncs() as read:
            rows = run.read_log()
        assert seen.hidden == 0 and read.hidden == 0, (dict(seen.syncs), dict(read.syncs))
        assert dict(read.declared) == {"step log": 1}
        steps.append(seen.declared)
    assert rows[0]["revived"] > 0 and 0 < rows[0]["idle_share"] <= 1
    if family == "streaming":
        assert dict(steps[0]) == {"NULL bias calibration": 1, "k-means init": 1, "policy scan": 3}
        assert dict(steps[1]) == {"code revival": 1, "policy scan": 1}
        assert rows[0]["usage_kl"] > 0 and rows[0]["placement"] > 0 and rows[0]["distill_kl"] > 0
    else:
        assert set(steps[0]) == {"k-means init", "plan end check"} and set(steps[1]) == {"code revival",
                                                                                        "plan end check"}
        assert rows[0]["plan_mtp"] > 0 and rows[0]["plan_usage"] > 0 and "eos_bias" in rows[0]


def test_negative_control_an_item_in_an_objective_is_counted(folder, monkeypatch):
    run = trainer(folder, "streaming", "injected")
    run.queue_step(), run.read_log()
    usage = UsageObjective.__call__

    def usage_and_read(self, model, batch, out, teacher=None):
        term = usage(self, model, batch, out, teacher)
        term.item()  # the term read back inside the step
        return term

    monkeypatch.setattr(UsageObjective, "__call__", usage_and_read)
    with HostSyncs() as seen:
        run.queue_step()
    assert dict(seen.syncs) == {"_local_scalar_dense": 1}


def test_a_hard_em_step_makes_one_declared_sync(folder):
    """Hard-EM (MTP concepts): the E-step's one read per step (the batch's tokens, the last E-step's plans),
    nothing hidden, whether it searches (step 1: every example new) or not (step 2: all cached)."""
    run = trainer(folder, "hard-em")
    batch = run.batch(0)
    run.runner.batch = lambda index: batch  # (the same examples twice: the second step finds them cached)
    shares = []
    for _ in range(2):
        with HostSyncs() as seen:
            run.queue_step()
        assert seen.hidden == 0, dict(seen.syncs)
        assert dict(seen.declared) == {"hard-EM E-step": 1}
        shares.append(run.read_log()[0]["estep_share"])
    assert shares == [1.0, 0.0]


def test_negative_control_the_host_estep_is_counted(folder, monkeypatch):
    """The E-step as it was (its search on the host, keys from the examples' bytes, ``Plan.from_rows``)."""
    from .test_hard_em_reference import ReferenceHardEM

    def host_estep(self, model, batch, step):
        reference = ReferenceHardEM(self.beam, self.every, self.prior, self._cache)
        return reference.prepare(model, batch, step)

    run = trainer(folder, "hard-em", "host-estep")
    monkeypatch.setattr(HardEMObjective, "prepare", host_estep)
    with HostSyncs() as seen:
        run.queue_step()
    assert seen.hidden > 10 and {"cpu", "_local_scalar_dense", "tensor from host data"} <= set(seen.syncs)


@pytest.mark.slow
def test_every_recipe_and_option_alone_makes_no_hidden_sync(tmp_path):
    """``benchmarks/step_syncs.py``'s recipes, 4 steps each."""
    corpus(tmp_path)
    for name, cfg in builds().items():
        torch.manual_seed(0)
        concept.save(concept.build(cfg), tmp_path / "builds" / name)
    for recipe in RECIPES:
        result = count(recipe, tmp_path, tmp_path / "code.jsonl", 4)
        hidden = sum(result["hidden"]) + sum(result["log_hidden"])
        assert hidden == 0, (recipe, result["where"])
