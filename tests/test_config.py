"""Config: JSON round trip, --set overrides, all problems reported at once."""
import json

import pytest

from concept import BuildConfig, ComponentRef, ConfigError, resolve
from concept.streaming.operating_point import parse_split


def test_json_round_trip():
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 4}), split="1,2,1")
    cfg.apply_overrides(["sampler.tau=0.7", "vocabulary.size=64", "attention=sdpa"])
    again = BuildConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.sampler.params == {"tau": 0.7} and again.attention.name == "sdpa"
    assert json.loads(cfg.to_json())["streaming"]["vocabulary"]["params"]["size"] == 64


def test_all_problems_reported_together():
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama"), split="2,4,2")
    cfg.apply_overrides(["vocabulary.size=0", "sampler.tau=-1", "length_policy.max_rn=3"])
    cfg.length_policy.params["track"] = "many"
    cfg.attention.name = "chunkd"
    with pytest.raises(ConfigError) as info:
        resolve(cfg)
    text = str(info.value)
    assert "size: K must be >= 1" in text
    assert "tau: temperature must be > 0" in text
    assert "Did you mean 'max_run'" in text
    assert "track: expected a number" in text
    assert "Did you mean 'chunked'" in text
    assert len(info.value.problems) == 5


def test_type_coercion_from_cli_strings():
    cfg = BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": "4"}), split="1,2,1")
    cfg.sampler.params["tau"] = "0.5"
    plan = resolve(cfg)
    assert plan.components["backbone"].config.layers == 4
    assert plan.components["sampler"].config.tau == 0.5


@pytest.mark.parametrize("spec,expected", [
    ("auto", (4, 18, 8)), ("4,22,4", (4, 22, 4)), ("0.2,0.6,0.2", (6, 18, 6)), (" 1, 28 ,1", (1, 28, 1)),
])
def test_split_ok(spec, expected):
    assert parse_split(spec, 30) == (expected, [])


@pytest.mark.parametrize("layers,expected", [(3, (1, 1, 1)), (4, (1, 2, 1)), (8, (1, 5, 2)), (32, (4, 19, 9))])
def test_auto_split_is_the_default_operating_point_on_any_depth(layers, expected):
    """"auto" = 2/15 shallow, 4/15 deep (at least one layer each): 4,18,8 on SmolLM2's 30 layers."""
    assert parse_split("auto", layers) == (expected, [])


@pytest.mark.parametrize("spec,message", [
    ("4,20,4", "sums to 28"), ("0,26,4", "at least one layer"), ("4,22", "three values"),
    ("a,b,c", "must be numbers"), ("0.5,0.4,0.2", "sum to 1"),
])
def test_split_errors(spec, message):
    counts, problems = parse_split(spec, 30)
    assert counts is None and message in problems[0]


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match="Did you mean 'sampler'"):
        BuildConfig.from_dict({"streaming": {"samplr": "argmax"}})
    with pytest.raises(ConfigError, match="Did you mean 'seed'"):
        BuildConfig.from_dict({"sed": 1})


def test_build_config_is_the_family_backbone_seed_and_the_family_s_section():
    """The streaming keys live in the streaming family's section (``concept.streaming.section``): keyword arguments
    and attributes reach it; ``to_dict`` has no streaming key at the top; a misspelt option is refused with the
    nearest; ``dataclasses.replace`` leaves the original's section alone."""
    import dataclasses

    from concept.streaming.section import StreamingSection

    cfg = BuildConfig(backbone="tiny-llama", split="2,4,2", attention="sdpa")
    explicit = BuildConfig(backbone=ComponentRef("tiny-llama"),
                           sections={"streaming": StreamingSection(split="2,4,2", attention=ComponentRef("sdpa"))})
    assert cfg == explicit and cfg.section is cfg.sections["streaming"]
    assert sorted(cfg.to_dict()) == ["backbone", "family", "seed", "streaming"]
    assert cfg.to_dict()["streaming"]["split"] == "2,4,2" and cfg.attention.name == "sdpa"
    cfg.max_ratio = 0.5  # (an attribute of the section)
    assert cfg.section.max_ratio == 0.5 and "max_ratio" not in vars(cfg)
    changed = dataclasses.replace(cfg, split="1,6,1")
    assert changed.split == "1,6,1" and cfg.split == "2,4,2"
    assert explicit != changed  # (negative control: another split is another config)
    with pytest.raises(ConfigError, match="Did you mean 'split'"):
        BuildConfig(splt="2,4,2")
    with pytest.raises(AttributeError, match="no option 'splt'"):
        cfg.splt  # noqa: B018
