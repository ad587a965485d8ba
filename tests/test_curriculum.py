"""Short-to-long curriculum (``--curriculum START:FRACTION``): the schedule, its log, exact resume, and
bad input; for both families."""
import json

import pytest

import concept
from concept.training import TrainConfig, Trainer, curriculum_len, parse_curriculum

from .test_objectives import interrupted_at_three
from .test_planner_executor import pe_config
from .test_planner_executor import small as pe_small
from .test_training import built, corpus, small  # noqa: F401  (fixtures)


def test_schedule():
    cfg = TrainConfig(steps=10, seq_len=64, curriculum="16:0.5")
    lengths = [curriculum_len(cfg, s) for s in range(10)]
    assert lengths[0] == 16 and lengths[5:] == [64] * 5  # full length from half the steps on
    assert lengths == sorted(lengths) and lengths[1] == round(16 + 48 / 5)
    assert curriculum_len(TrainConfig(seq_len=64), 0) == 64  # no curriculum


@pytest.mark.parametrize("text, message", [
    ("80:0.5", "end shorter than it starts"), ("1:0.5", "at least 2 tokens"), ("16:0", "in (0, 1]"),
    ("16", "START:FRACTION"), ("a:b", "START:FRACTION"),
])
def test_bad_curriculum(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_curriculum(text, 64)
    assert any(message in p for p in TrainConfig(seq_len=64, curriculum=text).validate())


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_streaming_rows_grow_and_resume_exactly(built, corpus, tmp_path):  # noqa: F811
    cfg = lambda: small(data=str(corpus), curriculum="8:0.5", log_every=1)  # noqa: E731
    Trainer.start(built, tmp_path / "full", cfg()).train()
    full = rows(tmp_path / "full")
    assert [r["seq_len"] for r in full] == [8, 16, 24, 32, 32, 32]
    tokens = [r["tokens_per_s"] for r in full]
    assert all(t > 0 for t in tokens)
    interrupted_at_three(built, tmp_path / "part", cfg()).train()
    assert [r["loss"] for r in rows(tmp_path / "part")] == [r["loss"] for r in full]


def test_planner_executor_context_grows_with_the_rows(tmp_path):
    concept.save(concept.build(pe_config()), tmp_path / "pe")
    trainer = Trainer.start(tmp_path / "pe", tmp_path / "run", pe_small(curriculum="8:1.0", log_every=1))
    trainer.train()
    logged = rows(tmp_path / "run")
    assert [(r["seq_len"], r["context_len"]) for r in logged] == [(8, 4), (12, 6), (16, 8), (20, 10)]
    assert trainer.model.context_len == 12 and concept.load(tmp_path / "run").context_len == 12  # eval: the full context
