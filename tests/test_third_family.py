"""A third model family from outside the library (``tests/third_family.py``, soft-prompt tuning),
registered through a ``concept.families`` entry point the way an installed package registers one. It
builds, trains, resumes, evaluates and generates through the library's own commands and API, and no
file of the library knows it exists."""
import json
import pathlib

import pytest
import torch
from click.testing import CliRunner

import concept
from concept import BuildConfig, ComponentRef
from concept.diagnostics import evaluate
from concept.errors import ConfigError
from concept.training import TrainConfig, Trainer
from tests.test_training import corpus, losses  # noqa: F401  (corpus: a fixture)

REPO = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A distribution on sys.path whose metadata declares the family, as `pip install` would leave it."""
    site = tmp_path_factory.mktemp("site")
    info = site / "soft_prompt_family-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: soft-prompt-family\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[concept.families]\nsoft-prompt = tests.third_family:SoftPrompt\n")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(site))
    yield site
    mp.undo()
    forget_family("soft-prompt")  # (the family loaded from this module: not a later module's copy)


def forget_family(name: str) -> None:
    """Drop what this process loaded of the family ``name`` (its class and its started instance), so that the next
    lookup loads it from the entry points on ``sys.path`` now."""
    from concept.registry import registry

    registry("family")._loaded.pop(name, None)
    concept.families._INSTANCES.pop(name, None)


def config(**section):
    return BuildConfig(backbone=ComponentRef("tiny-llama", {"layers": 3, "hidden": 32, "heads": 2, "kv_heads": 1,
                                                           "intermediate": 64}),
                       family="soft-prompt", sections={"soft_prompt": {"length": 3, **section}} if section is not None else {})


@pytest.fixture(scope="module")
def built(installed, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("runs") / "soft"
    concept.save(concept.build(config()), out)
    return out


def small(corpus, **kw):  # noqa: F811
    return TrainConfig(**{**dict(steps=4, seq_len=32, batch=2, eval_every=2, eval_batches=1, checkpoint_every=2,
                                 log_every=2, warmup=1, lr=1e-2, lr_new=1e-2, data=str(corpus),
                                 lora=concept.lora.LoraSettings(rank=2)), **kw})


def test_no_library_file_names_it():
    for path in (*(REPO / "concept").rglob("*.py"), *(REPO / "cli").rglob("*.py"), *(REPO / "plugins").rglob("*.py")):
        text = path.read_text()
        assert "soft-prompt" not in text and "soft_prompt" not in text and "SoftPrompt" not in text, path


def test_it_is_listed_with_its_distribution(installed):
    from concept_cli.main import cli

    result = CliRunner().invoke(cli, ["plugins", "list", "--kind", "family", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["soft-prompt"]["provider"] == "soft-prompt-family==0.1"
    assert {"streaming", "planner-executor"} <= set(rows)


def test_its_options_are_checked_with_the_rest(installed):
    with pytest.raises(ConfigError) as err:
        concept.build(config(length=0, colour=1))
    assert "soft_prompt.length: at least 1 vector" in str(err.value)
    assert "soft_prompt.colour: unknown option" in str(err.value)
    streaming = BuildConfig(backbone=config().backbone, sections={"soft_prompt": {"length": 3}})
    with pytest.raises(ConfigError, match="configure the soft-prompt family; this build is 'streaming'"):
        concept.resolve(streaming)


def test_inspect_shows_what_it_says_about_itself(built):
    from concept_cli.main import cli

    result = CliRunner().invoke(cli, ["inspect", str(built), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["family"] == "soft-prompt" and shown["soft prompt"]["vectors"] == 3
    assert "3 learned prompt vectors" in shown["description"]


def test_it_builds_and_saves_its_section(built):
    record = json.loads((built / "concept.json").read_text())
    assert record["config"]["family"] == "soft-prompt" and record["config"]["soft_prompt"] == {"length": 3}
    model = concept.load(built)
    assert type(model).__name__ == "SoftPromptModel" and model.prompt.vectors.shape == (3, 32)


def test_it_trains_resumes_exactly_evaluates_and_generates(built, corpus, tmp_path):  # noqa: F811
    straight = Trainer.start(built, tmp_path / "straight", small(corpus))
    straight.train()
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[1]["prompt_norm"] > 0 and rows[1]["grad_norm/prompt"] > 0  # its own step diagnostics, its module
    from tests.test_third_family_installed import streaming_names_in

    for file in (*built.rglob("*.json"), *(tmp_path / "straight").rglob("*.json")):  # no streaming option written
        assert streaming_names_in(file.read_text()) == [], file
    trained = concept.load(tmp_path / "straight")
    assert not torch.equal(trained.prompt.vectors, concept.load(built).prompt.vectors)

    first = Trainer.start(built, tmp_path / "resumed", small(corpus))
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C at step 2's row: the checkpoint is written on the way out
        first.train(progress=lambda row: row["step"] == 2 and first.loop.on_sigint(None, None))
    assert first.step in (2, 3)  # the log is read one step late: the step seen, or the one queued after it
    assert json.loads((tmp_path / "resumed" / "checkpoint" / "state.json").read_text())["step"] == first.step
    Trainer.resume(tmp_path / "resumed").train()
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")  # bit for bit

    batch = {"input_ids": torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))}
    result = evaluate(trained, [batch], controls=False)
    with torch.no_grad():
        logits = trained(batch["input_ids"]).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())
    assert result["nll"] == pytest.approx(float(expected), rel=1e-5)

    prompts = [[5, 6, 7, 8], [9, 10]]  # rows of different lengths: left-padded into one batch
    generated = trained.generate(prompts, max_new_tokens=6)
    for prompt, tokens in zip(prompts, generated.tokens):
        with torch.no_grad():  # decoding = teacher forcing: each token is the argmax of the forced forward
            forced = trained(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].argmax(-1)
        assert tokens == forced.tolist()


TINY_FLAGS = ["--backbone", "tiny-llama", *(f for kv in ("layers=3", "hidden=32", "heads=2", "kv_heads=1",
                                                          "intermediate=64") for f in ("--set", f"backbone.{kv}"))]


def test_the_cli_builds_dry_runs_and_inspects_it(installed, tmp_path):
    """Issue 41, bug 1: `concept build --family soft-prompt` (a family with its own config section) saved the run,
    then crashed with `KeyError: 'target'` (and `--dry-run` too): the CLI took any family with a section for the
    planner-executor and drew plan types. The CLI now asks the family what to show (`Family.structure`; this
    family declares none, so its section's settings are shown)."""
    from concept_cli.main import cli

    run = CliRunner()
    dry = run.invoke(cli, ["build", "--family", "soft-prompt", *TINY_FLAGS, "--set", "soft_prompt.length=2",
                           "--dry-run"])
    assert dry.exit_code == 0 and dry.exception is None, dry.output
    assert "soft_prompt" in dry.stdout and "length" in dry.stdout and "stacks" not in dry.stdout

    out = tmp_path / "soft"
    built = run.invoke(cli, ["build", "--family", "soft-prompt", *TINY_FLAGS, "--set", "soft_prompt.length=2",
                             "-o", str(out)])
    assert built.exit_code == 0 and built.exception is None, built.output
    assert "soft_prompt" in built.stdout and "parameters" in built.stdout and "stacks" not in built.stdout
    assert "soft-prompt family" in built.stderr

    again = run.invoke(cli, ["build", "--family", "soft-prompt", *TINY_FLAGS, "--set", "soft_prompt.length=2",
                             "-o", str(out), "--force", "--json"])
    assert again.exit_code == 0, again.output
    data = json.loads(again.stdout)
    assert data["soft_prompt"] == {"length": 2} and "stacks" not in data

    shown = run.invoke(cli, ["inspect", str(out)])
    assert shown.exit_code == 0 and shown.exception is None, shown.output
    assert "soft prompt" in shown.stdout and "vectors" in shown.stdout


def test_the_streaming_keys_are_refused_for_it(installed, corpus):  # noqa: F811
    """It reads no streaming key (no ``Family.build_section``): setting one is refused, at build and at training."""
    import dataclasses

    with pytest.raises(ConfigError) as err:
        concept.resolve(dataclasses.replace(config(), split="1,1,1", length_policy=ComponentRef("fixed")))
    assert "split: the soft-prompt family does not read it" in str(err.value)
    assert "length_policy: the soft-prompt family does not read it" in str(err.value)
    with pytest.raises(ConfigError, match="tau-start 2.0: only for streaming or planner-executor runs"):
        Trainer.check(small(corpus, tau_start=2.0), config())
    Trainer.check(small(corpus), config())  # (the defaults: fine)
