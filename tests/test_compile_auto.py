"""``--compile auto``: compiled where inductor runs (``model`` on a CUDA device with Triton, ``on`` on a torch
without layer regions), eager on other devices and for a model its family cannot compile now; decided for the
training device, or at a model's first call from its inputs' device (``concept.load`` compiles before the model is
moved). On this CPU ``auto`` is eager, bit for bit and with no graph; the decision's compiled side runs here with
``device_choice`` said to give ``model`` (captured by ``aot_eager``)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch._dynamo.utils import counters

import concept
import concept.compiled
from concept.compiled import (AutoCompile, WholeForward, auto_choice, compile_model, compiled_choice, device_choice,
                              settle)
from concept.errors import ConceptError
from concept.families import family_of
from tests.conftest import mixed_model
from concept.training import TrainConfig, Trainer
from tests.test_compile import captured, graphs_by_function, run  # noqa: F401  (``run``: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def budgeted_model(max_ratio=0.25):
    model = copy.deepcopy(mixed_model("null"))  # (shared by the worker's tests: never changed in place)
    model.max_ratio = max_ratio
    return model


def said_to_compile(monkeypatch, seen: list | None = None) -> None:
    """``auto`` said to give ``model`` on this CPU (as on a CUDA device with Triton), captured by ``aot_eager``;
    the device types it was asked about in ``seen``."""
    monkeypatch.setattr(concept.compiled, "WHOLE_BACKEND", "aot_eager")

    def choice(device_type):
        if seen is not None:
            seen.append(device_type)
        return "model"
    monkeypatch.setattr(concept.compiled, "device_choice", choice)


def test_auto_is_model_on_cuda_with_triton_on_older_torch_and_eager_elsewhere(monkeypatch):
    monkeypatch.setattr(concept.compiled, "TRITON_INSTALLED", True)
    monkeypatch.setattr(concept.compiled, "LAYER_REGIONS", True)
    regions = concept.compiled._layer_region is not None  # (this torch has nested compile regions)
    assert device_choice("cuda") == ("model" if regions else "on")
    assert device_choice("cpu") == "off" and device_choice("mps") == "off"
    monkeypatch.setattr(concept.compiled, "LAYER_REGIONS", False)  # (a torch whose layers are no regions)
    assert device_choice("cuda") == "on"
    monkeypatch.setattr(concept.compiled, "TRITON_INSTALLED", False)  # inductor has no GPU code without Triton
    assert device_choice("cuda") == "off"
    assert auto_choice(budgeted_model(), "cuda") == ("off", "eager: CUDA without Triton (auto compiles on CUDA "
                                                            "with Triton only)")


def test_auto_is_eager_for_a_model_its_family_refuses(monkeypatch):
    """A streaming model without a static budget: ``model`` refuses it with the family's reason; ``auto`` runs it
    eagerly and says why."""
    said_to_compile(monkeypatch)
    unbudgeted = budgeted_model(max_ratio=None)
    choice, why = auto_choice(unbudgeted, "cuda")
    assert choice == "off" and "static concept budget" in why
    with pytest.raises(ConceptError, match="static concept budget"):  # (control: the choice itself refuses)
        compile_model(copy.deepcopy(unbudgeted), "model")
    assert auto_choice(budgeted_model(), "cuda") == ("model", "model on cuda")


def test_auto_on_a_cpu_is_eager_bit_for_bit_and_compiles_nothing(fresh_dynamo, monkeypatch):
    graphs = graphs_by_function(monkeypatch)
    model = budgeted_model()
    auto = compile_model(copy.deepcopy(model), "auto")
    assert isinstance(auto.forward, AutoCompile) and compiled_choice(auto) == "auto" and auto.compiled_stacks is None
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast, slow = auto(ids, labels=ids), model(ids, labels=ids)
    assert torch.equal(fast.logits, slow.logits) and torch.equal(fast.loss, slow.loss)
    assert compiled_choice(auto) == "off" and "forward" not in auto.__dict__
    assert auto.compile_reason.startswith("eager: a cpu device") and not graphs


def test_auto_decides_at_the_first_call_from_its_inputs_device(fresh_dynamo, monkeypatch):
    """Where ``auto`` compiles: the first call compiles the whole forward (one graph) and runs it, equal to eager;
    asked once, for the inputs' device."""
    graphs, seen = graphs_by_function(monkeypatch), []
    said_to_compile(monkeypatch, seen)
    model = budgeted_model()
    auto = compile_model(copy.deepcopy(model), "auto")
    assert not seen  # (not decided when compiled: the model may still move)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(2):
            ids = torch.randint(0, 97, (2, 24), generator=g)
            fast, slow = auto(ids, labels=ids), model(ids, labels=ids)
            assert torch.equal(fast.keep, slow.keep)
            torch.testing.assert_close(fast.logits, slow.logits, atol=1e-5, rtol=1e-5)
    assert seen == ["cpu"] and isinstance(auto.forward, WholeForward) and compiled_choice(auto) == "model"
    assert dict(graphs) == {"forward_whole": 1} and not counters["graph_break"]


def test_generation_decides_auto_before_it_picks_its_decoder(fresh_dynamo, monkeypatch):
    """``auto`` compiling: generation decodes with the compiled static decoder (the choice's), the tokens eager's.
    Without the decision before the decoder is picked, it would decode eagerly (negative control: ``settle`` made a
    no-op)."""
    captured(monkeypatch)  # (every compile captured by aot_eager: the static step's too)
    said_to_compile(monkeypatch)
    model = budgeted_model()
    family = type(family_of(model))
    static = []
    real = family.static_decoder
    monkeypatch.setattr(family, "static_decoder", lambda self, m, budget, choice: static.append(choice) or real(
        self, m, budget, choice))
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    eager = model.generate(prompts, max_new_tokens=4)
    auto = compile_model(copy.deepcopy(model), "auto")
    assert auto.generate(prompts, max_new_tokens=4).tokens == eager.tokens and static == ["model"]
    monkeypatch.setattr(concept.generation, "settle", lambda model, device: None)
    again = compile_model(copy.deepcopy(model), "auto")
    assert again.generate(prompts, max_new_tokens=4).tokens == eager.tokens and static == ["model"]


def test_settle_leaves_a_decided_model_alone(monkeypatch):
    said_to_compile(monkeypatch)
    model = compile_model(budgeted_model(), "off")
    settle(model, torch.device("cpu"))
    assert compiled_choice(model) == "off"


def trainer(run, name, compile):  # noqa: F811
    config = TrainConfig(steps=2, seq_len=32, batch=2, eval_every=100, checkpoint_every=100, log_every=100,
                         warmup=1, data=str(run / "code.jsonl"), lora=concept.lora.LoraSettings(rank=2),
                         compile=compile)
    return Trainer.start(run / "built", run / name, config)


def test_training_with_auto_records_what_it_ran_and_why(run, fresh_dynamo, monkeypatch):  # noqa: F811
    """On this CPU: eager (its steps eager's, bit for bit), ``train.json``'s ``compile_resolved`` ``off`` and a note
    saying why. Said to compile: ``model``, decided for the training device when the run starts (its compiled steps
    equal eager's: ``tests/test_compile_model.py``)."""
    eager, auto = trainer(run, "auto-eager", "off"), trainer(run, "auto-cpu", "auto")
    assert compiled_choice(auto.model) == "off" and any(n.startswith("--compile auto: eager: a cpu device")
                                                        for n in auto.notes)
    assert [auto.train_step()["loss"] for _ in range(2)] == [eager.train_step()["loss"] for _ in range(2)]
    said_to_compile(monkeypatch)
    compiled = trainer(run, "auto-model", "auto")
    assert compiled_choice(compiled.model) == "model" and isinstance(compiled.model.forward, WholeForward)
    for started, resolved in ((auto, "off"), (compiled, "model")):
        record = json.loads((started.out / "train.json").read_text())
        assert record["compile"] == "auto" and record["compile_resolved"] == resolved


def test_a_run_trained_with_auto_resumes_and_its_record_is_checked(run, fresh_dynamo):  # noqa: F811
    """``compile_resolved`` is a derived key of ``train.json`` (``run_files.TRAIN_DERIVED``): an ``auto`` run resumes
    (it was read as a config field: the resume refused the record as damaged), and a wrong type in it is named."""
    from concept import run_files

    trainer(run, "auto-resumed", "auto").train()
    resumed = Trainer.resume(run / "auto-resumed", steps=3)
    assert compiled_choice(resumed.model) == "off"
    resumed.train()
    record = json.loads((run / "auto-resumed" / "train.json").read_text())
    assert record["steps"] == 3 and record["compile_resolved"] == "off"
    assert run_files.train_problems({**record, "compile_resolved": 3}) == ["compile_resolved: expected a "
                                                                                  "string, got a number"]


def test_auto_is_a_choice_of_every_command_and_one_default_serves_them_all():
    """``--compile auto`` is offered by train, eval, generate and bench; their default, ``TrainConfig``'s and the
    Python API's are the one ``DEFAULT_COMPILE`` (``off`` until a GPU lease supports ``auto``: one line to change)."""
    import inspect

    from click.testing import CliRunner

    from cli.main import cli
    from concept.config import DEFAULT_COMPILE
    from concept.train_config import TrainConfig

    assert DEFAULT_COMPILE == "off" and TrainConfig().compile == DEFAULT_COMPILE
    for api in (concept.build, concept.load):
        assert inspect.signature(api).parameters["compile"].default == DEFAULT_COMPILE
    for command in ("train", "eval", "generate", "bench"):
        out = CliRunner().invoke(cli, [command, "--help"], terminal_width=400).output
        assert "auto" in out[out.index("--compile"):], command
        if command != "train":  # (train's flags come from TrainConfig's fields)
            option = next(p for p in cli.commands[command].params if p.name == "compile_")
            assert option.default == DEFAULT_COMPILE, command
