"""One definition per option (``concept.options``): TrainConfig / LoraSettings / BuildConfig fields carry the
flag, help, default and simple checks; the CLI options, the checks and the mapping back come from them."""
import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from concept import options
from concept.config import BuildConfig
from concept.lora import LoraSettings
from concept.options import check, click_params, from_params, nested, option, paths
from concept.training import TrainConfig
from concept_cli.build_cmd import build
from concept_cli.frontier_cmd import TRAIN, frontier
from concept_cli.train_cmd import train

COMMAND_ONLY = {"source", "out", "resume", "force", "accept_data_change", "distributed", "as_json",
                "config_file", "print_config"}  # train's hand-written parameters


def params(command, args=("RUN",)):
    """The command's parameters once parsed (the generated ones included) and the values of ``args``."""
    ctx = command.make_context(command.name, list(args))
    return ctx.command.get_params(ctx), ctx.params


def test_every_train_option_has_exactly_one_flag_and_a_help_text():
    entries = options.entries(TrainConfig)
    declared = {f.name for f in dataclasses.fields(TrainConfig)} - {"lora"}
    declared |= {f"lora_{f.name}" for f in dataclasses.fields(LoraSettings)}
    assert {e.name for e in entries} == declared  # every field (and lora field) is an option
    assert all(e.spec.help.strip() for e in entries), [e.name for e in entries if not e.spec.help.strip()]
    made, _ = params(train)
    flags = [opt for p in made for opt in p.opts]
    assert len(flags) == len(set(flags))  # no flag twice
    by_name = {p.name: p for p in made}
    for e in entries:
        assert by_name[e.name].opts == [e.flag] and by_name[e.name].help == e.spec.help
    assert set(by_name) - {"_click_default_help"} == set(paths(TrainConfig)) | COMMAND_ONLY
    assert paths(TrainConfig)["lora_rank"] == "lora.rank" and paths(TrainConfig)["mtp"] == "mtp"


def test_train_options_keep_their_flags_defaults_and_choices():
    made, values = params(train)
    by_flag = {p.opts[0]: p for p in made}
    assert values["steps"] == 300 and values["lora_targets"] == LoraSettings().targets and values["baseline"] is None
    assert list(by_flag["--ratio-control"].type.choices) == ["both", "pi", "loss", "none"]
    assert list(by_flag["--align-loss"].type.choices) == ["cosine", "mse"]
    assert by_flag["--grad-checkpointing"].is_flag and by_flag["--prune-layers"].metavar == "START:STOP"
    assert from_params(TrainConfig, values) == TrainConfig()  # the CLI defaults are TrainConfig's
    # a bare --baseline is the dense one; --lora-* set config.lora
    _, values = params(train, ["RUN", "--baseline", "--lora-rank", "3", "--mtp", "0.5", "--task", "continue"])
    config = from_params(TrainConfig, values)
    assert config.baseline == "dense" and config.lora.rank == 3 and config.mtp == 0.5 and config.task == "continue"
    _, values = params(train, ["RUN", "--baseline", "pruned"])
    assert from_params(TrainConfig, values).baseline == "pruned"


def test_importing_the_cli_imports_no_torch():
    """The train options are made when `concept train` parses or prints help, not when the CLI is imported."""
    code = "import sys\nimport concept_cli.main\nprint('torch' in sys.modules, 'concept.training' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_train_config_is_the_cores_options_then_each_familys():
    """A family's training options (``Family.training``) join TrainConfig after the core's, as flat flags; the
    core declares none of them (the concept ones moved to their families: issue 41), an option two families
    inherit from one base (``concept.code_options``) is one option read by both, and a name declared twice
    otherwise is an error naming both owners. A run's config has the core's options and its family's only."""
    import concept.train_config as tc
    from concept.code_options import CodeTraining
    from concept.planner.options import PlannerTraining
    from concept.streaming.options import StreamingTraining

    names = [f.name for f in dataclasses.fields(TrainConfig)]
    core = [f.name for f in dataclasses.fields(tc.CoreTrainConfig)]
    own = {cls: [f.name for f in dataclasses.fields(cls)] for cls in (StreamingTraining, PlannerTraining)}
    assert names[:len(core)] == core and sorted(names[len(core):]) == sorted(set(own[StreamingTraining] + own[PlannerTraining]))
    assert len(names) == len(set(names))
    moved = {"target_ratio", "tau_start", "tau_end", "usage_weight", "revive_after", "kmeans_init", "align_at"}
    assert not set(core) & (set(own[StreamingTraining]) | set(own[PlannerTraining]) | moved)
    shared = [f.name for f in dataclasses.fields(CodeTraining)]
    assert all(TrainConfig.option_owners[n] == ("streaming", "planner-executor") for n in shared)
    assert TrainConfig.option_owners["target_ratio"] == ("streaming",) == TrainConfig.option_owners["align_at"]
    assert {"task", "placement", "ratio_control"} <= {e.name for e in options.entries(TrainConfig)}
    assert TrainConfig(task="continue", context_len=4, seq_len=16).task == "continue"
    for name, cls in (("streaming", StreamingTraining), ("planner-executor", PlannerTraining)):
        assert [f.name for f in dataclasses.fields(tc.for_family(name))] == core + own[cls]
    assert not hasattr(tc.for_family("planner-executor")(), "target_ratio")

    @dataclasses.dataclass
    class Clashing(options.FamilyOptions):
        seq_len: int = options.option(3, help="a name the core declares")

    with pytest.raises(TypeError, match="'seq_len' of .*Clashing is declared by the core already"):
        tc._compose([*tc.family_options(), ("clashing", Clashing)])

    @dataclasses.dataclass
    class Redeclaring(options.FamilyOptions):  # negative control: the same name, not inherited from the base
        tau_start: float = options.option(1.0, help="a name a family declares")

    with pytest.raises(TypeError, match="'tau_start' of .*Redeclaring is declared by .*StreamingTraining already"):
        tc._compose([*tc.family_options(), ("redeclaring", Redeclaring)])


def test_checks_report_every_problem_with_the_flag_name():
    config = TrainConfig(seq_len=1, ratio_control="x", min_lr=2.0, weight_decay=-1.0, clip=0.0, pi_ki=float("nan"),
                         target_ratio=1.0, baseline="sparse", lora=LoraSettings(rank=0, dropout=1.0))
    problems = config.validate()
    for message in ("seq-len: must be >= 2, got 1", "ratio-control: one of both, pi, loss, none, got 'x'",
                    "min-lr: must be in [0, 1], got 2.0", "weight-decay: must be >= 0, got -1.0",
                    "clip: must be > 0, got 0.0", "pi-ki: must be a finite number, got nan",
                    "target-ratio: must be in (0, 1), got 1.0", "baseline: dense or pruned, got 'sparse'",
                    "lora-rank: must be >= 1, got 0", "lora-dropout: must be in [0, 1), got 1.0"):
        assert message in problems, (message, problems)
    assert len(problems) == 10, problems
    # a value of the wrong type (a hand-edited train.json) is named, never a traceback
    problems = TrainConfig(steps="many", seq_len=2.5, lr=True, data=3, context_len=1).validate()
    assert problems == ["data: expected a string, got 3", "steps: expected an integer, got 'many'",
                        "seq-len: expected an integer, got 2.5", "lr: expected a number, got True"]


@pytest.mark.parametrize("value", [-1.0, 1.5])
def test_out_of_range_values_fail_a_range(value):
    @dataclass
    class Settings:
        share: float = option(0.5, minimum=0, maximum=1, help="A share.")

    assert check(Settings(share=value)) == [f"share: must be in [0, 1], got {value}"]
    assert check(Settings()) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e39])
def test_every_number_option_is_finite_whatever_its_range(value):
    """One rule for every float option (NaN, an infinity, or beyond float32), with or without bounds (issue 43:
    --lr inf, --lora-alpha nan, --ratio-loss-weight nan, --tau-start inf trained)."""
    @dataclass
    class Settings:
        share: float = option(0.5, minimum=0, maximum=1, help="A share.")
        scale: float = option(1.0, help="Unbounded.")
        rate: float = option(1.0, above=0, help="Bounded below only.")

    assert check(Settings(share=value, scale=value, rate=value)) == [
        f"{name}: must be a finite number, got {value}" for name in ("share", "scale", "rate")]
    assert check(Settings(scale=-1e30)) == []


def test_a_small_dataclass_end_to_end():
    @dataclass
    class Inner:
        size: int = option(4, above=0, help="Size.")

    @dataclass
    class Outer:
        mode: str = option("a", choices=("a", "b", "c"), help="Mode.")
        name: str | None = option(None, flag="--called", help="Name.")
        inner: Inner = nested(Inner, prefix="in")  # noqa: RUF009 (a default_factory field)
        quiet: bool = option(False, help="Say less.")

    made = click_params(Outer)
    assert [p.opts for p in made] == [["--mode"], ["--called"], ["--in-size"], ["--quiet"]]
    assert paths(Outer) == {"mode": "mode", "name": "name", "in_size": "inner.size", "quiet": "quiet"}
    assert from_params(Outer, {"mode": "b", "in_size": 7, "other": 1}) == Outer(mode="b", inner=Inner(7))
    assert check(Outer(mode="d", name=None)) == ["mode: one of a, b, c, got 'd'"]
    assert check(Inner(size=0), prefix="in-") == ["in-size: must be > 0, got 0"]
    unset = click_params(Outer, "mode", "quiet", unset=True)
    assert [p.default for p in unset] == [None, None] and unset[0].help == "Mode.  [default: a]"
    assert unset[1].help == "Say less."  # (a flag that is off by default shows no default)
    with pytest.raises(ValueError, match="no option named nope"):
        click_params(Outer, "nope")


def test_train_json_round_trip_and_an_older_file():
    config = TrainConfig(steps=40, baseline="pruned", prune_layers="1:3", distill=0.5, align_loss="mse",
                         task="continue", context_len=8, curriculum="16:0.5", dtype="bf16",
                         lora=LoraSettings(rank=4, dropout=0.1, targets="q_proj,v_proj"))
    saved = json.loads(json.dumps(config.to_dict()))  # as train.json holds it
    assert TrainConfig.from_dict(saved) == config and saved["lora"]["rank"] == 4
    older = {"steps": 300, "seq_len": 256, "batch": 8, "grad_accum": 1, "lr": 2e-4, "lr_new": 1e-3, "warmup": 10,
             "clip": 1.0, "lora": {"rank": 8, "alpha": 16.0, "targets": "q_proj,v_proj"}, "target_ratio": 0.25,
             "ratio_control": "both", "ratio_loss_weight": 0.1, "usage_weight": 0.0, "tau_start": 1.0,
             "tau_end": 0.5, "data": None, "text_field": "text", "seed": 0, "eval_every": 50, "eval_batches": 4,
             "checkpoint_every": 50, "log_every": 10, "grad_checkpointing": False, "baseline": True, "device": "auto"}
    loaded = TrainConfig.from_dict(older)  # written before most of today's options existed
    assert loaded.baseline == "dense" and loaded.target_ratio == 0.25 and loaded.lora.targets == "q_proj,v_proj"
    assert loaded.lora.dropout == 0.0 and loaded.distill == 0.0 and loaded.dtype == "auto" and loaded.min_lr == 0.1
    assert loaded.validate() == []
    assert TrainConfig.from_dict(loaded.to_dict()) == loaded


def test_build_options_come_from_build_config_and_stay_unset_unless_given():
    made, values = params(build, [])
    by_flag = {p.opts[0]: p for p in made}
    assert all(values[k] is None for k in ("family", "split", "concept_input", "seed"))  # --config's values stay
    # the families are entry points (a third one installs like any plugin): a name, checked by resolve()
    assert by_flag["--family"].metavar == "NAME" and "plugins list --kind family" in by_flag["--family"].help
    assert by_flag["--seed"].help == "Seed for the new modules.  [default: 0]"
    assert by_flag["--split"].help.endswith("[default: auto]")
    flags = [p.opts[0] for p in made]
    assert flags.index("--family") < flags.index("--backbone") < flags.index("--split") < flags.index("--length-policy")
    _, values = params(build, ["--seed", "3", "--concept-input", "embedding"])
    assert values["seed"] == 3 and values["concept_input"] == "embedding"
    # every build option is a declared field: the component slots too (a name each, the default in the help)
    # (the core's: family, backbone, seed; the streaming family's section's: its slots, split, concept input, budget)
    from concept.streaming.section import StreamingSection

    assert {e.name for e in options.entries(BuildConfig)} == {"backbone", "seed", "family"}
    assert {e.name for e in options.entries(StreamingSection)} == {*StreamingSection.slots(), "split", "concept_input",
                                                                   "max_ratio"}
    assert all(values[slot] is None for slot in ("backbone", *StreamingSection.slots()))
    assert by_flag["--length-policy"].help == "Length policy plugin (default: null)."
    assert by_flag["--rope"].opts == ["--rope", "--position-scheme"] and by_flag["--rope"].name == "position_scheme"
    # then the families' own build options (the streaming family's calibration), after --seed, with real defaults
    assert flags.index("--seed") < flags.index("--target-ratio") < flags.index("--set")
    assert values["target_ratio"] == 0.125 and values["no_calibrate"] is False


def test_frontier_takes_trains_options_unset():
    made, values = params(frontier, [])
    names = [p.name for p in made]
    assert [n for n in names if n in TRAIN] == list(TRAIN) and all(values[k] is None for k in TRAIN)
    _, values = params(frontier, ["--lora-rank", "2", "--steps", "5", "--eval-batches", "3"])
    config = from_params(TrainConfig, {k: values[k] for k in TRAIN if values[k] is not None})
    assert config.lora.rank == 2 and config.steps == 5 and config.eval_batches == TrainConfig().eval_batches
