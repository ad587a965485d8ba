"""A loaded model's compute precision: ``concept.load(..., dtype=)`` and the ``--dtype`` of ``eval``, ``generate``,
``chat`` and ``serve`` (``concept.precision``), proven on the CPU with bf16 autocast, the path a GPU takes.

``bf16`` is the regime of a bf16 training run: the frozen base stored in bf16 once, the model run under bf16 autocast,
the LoRA adapters and the new modules fp32. So no frozen weight is cast inside a forward (counted by a
``TorchDispatchMode``; the negative control: the fp32 base under the same autocast, cast at every use). ``auto`` is bf16
on a CUDA device and fp32 elsewhere: on this CPU bit for bit the fp32 model. Generation, scoring and evaluation run
in the model's precision; a model whose base the precision cast cannot be saved (its fp32 weights would be written
rounded).

bf16 keeps 8 bits of mantissa: the tolerance is 3 % of the fp32 logits' range, as in ``tests/test_bf16.py``.
"""
import json

import pytest
import torch

import concept
from benchmarks.step_counts import StepCounter, frozen_parameters
from concept.config import DTYPES
from concept.errors import ConceptError, ConfigError
from concept.precision import Precision, dtype_choice, frozen_base, inference_dtype
from concept.tokens import encode_text, tokenizer_for
from concept.training import Trainer
from tests.test_cli_train import run as run_cli
from tests.test_training import built, corpus, small  # noqa: F401  (fixtures)

IDS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
TOLERANCE = 0.03
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(built, corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("dtype") / "run"
    Trainer.start(built, out, small(data=str(corpus), steps=2, lr=1e-2, lr_new=1e-2, eval_every=2,
                                    checkpoint_every=2)).train()
    return out


def within(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference relative to the reference's range."""
    return float((out.float() - ref.float()).abs().max() / (ref.float().max() - ref.float().min()))


def logits(model, ids=IDS, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kw).logits


def test_bf16_stores_the_base_once_and_casts_no_frozen_weight_in_a_forward(trained):
    fp32, bf16 = concept.load(trained), concept.load(trained, dtype="bf16")
    base = frozen_base(bf16)
    assert base and all(p.dtype == torch.bfloat16 for p in base.values())
    adapters = [p for n, p in bf16.backbone.named_parameters() if "lora_" in n]
    modules = [p for m in bf16.new_modules().values() for p in m.parameters()]
    assert adapters and modules and all(p.dtype == torch.float32 for p in adapters + modules)  # as the run saved them
    counter = StepCounter(frozen_parameters(bf16))
    with counter:
        out = logits(bf16)
    assert counter.total > 100 and sum(counter.frozen_casts.values()) == 0, counter.frozen_casts
    assert out.dtype == torch.bfloat16  # (its call ran under bf16 autocast: the model's own forward hooks)
    reference = logits(fp32)
    assert 0 < within(out, reference) < TOLERANCE  # bf16 arithmetic, within bf16's rounding
    assert not torch.is_autocast_enabled("cpu")  # (left as it was after the call)


def test_negative_control_an_fp32_base_under_bf16_autocast_is_cast_at_every_use(trained):
    model = concept.load(trained)
    counter = StepCounter(frozen_parameters(model))
    with counter, torch.autocast("cpu", dtype=torch.bfloat16):
        logits(model)
    layers = len(concept.backbone.decoder(model.backbone).layers)
    assert counter.frozen_casts["_to_copy"] >= 7 * layers  # every projection of every layer


def test_auto_is_fp32_on_a_cpu_bit_for_bit_and_bf16_once_decided_for_cuda(trained):
    fp32, auto = concept.load(trained), concept.load(trained, dtype="auto")
    assert torch.equal(logits(auto), logits(fp32))
    assert auto.precision.dtype == torch.float32 and all(p.dtype == torch.float32 for p in auto.parameters())
    gpu = concept.load(trained, dtype="auto")
    assert gpu.precision.dtype is None  # undecided until its first call on a device
    assert inference_dtype(gpu, torch.device("cuda")) == torch.bfloat16  # (the decision a CUDA call makes)
    assert all(p.dtype == torch.bfloat16 for p in frozen_base(gpu).values())
    assert logits(gpu).dtype == torch.bfloat16  # once stored in bf16 it runs bf16 on every device
    assert inference_dtype(gpu, torch.device("cpu")) == torch.bfloat16  # (and the decision stays)
    assert inference_dtype(auto, torch.device("cuda")) == torch.bfloat16  # run on the CPU, then moved: decided again
    assert all(p.dtype == torch.bfloat16 for p in frozen_base(auto).values())
    fixed = concept.load(trained, dtype="fp32")
    assert inference_dtype(fixed, torch.device("cuda")) == torch.float32  # (the control: a chosen fp32 stays fp32)


def test_dtype_names_and_bad_values(trained, tmp_path):
    assert [dtype_choice(v) for v in ("auto", "fp32", "bf16", "bfloat16", "float32", torch.bfloat16,
                                      torch.float32)] == ["auto", "fp32", "bf16", "bf16", "fp32", "bf16", "fp32"]
    assert concept.load(trained, dtype=torch.bfloat16).precision.dtype == torch.bfloat16
    for bad in ("fp16", torch.float16, None):
        with pytest.raises(ConfigError, match="dtype: one of auto, fp32, bf16"):
            dtype_choice(bad)
    with pytest.raises(ConfigError, match="dtype"):  # refused before the folder is read
        concept.load(tmp_path / "no-such-run", dtype="half")
    model = concept.load(trained)
    assert getattr(model, "precision", None) is None  # fp32: nothing installed, the model as before
    assert not model._forward_pre_hooks


def test_an_exception_inside_a_call_leaves_autocast_as_it_was(trained):
    model = concept.load(trained, dtype="bf16")
    with pytest.raises(Exception):
        model(torch.full((1, 8), 10 ** 6))  # a token id past the vocabulary
    assert not torch.is_autocast_enabled("cpu") and model.precision.active == []
    assert logits(model).dtype == torch.bfloat16  # and the next call runs as before


def test_generation_in_bf16_equals_teacher_forcing_within_bf16(trained):
    model = concept.load(trained, dtype="bf16")
    prompts = [[5, 17, 3, 44, 9], [8, 2, 61]]
    gen = model.generate(prompts, max_new_tokens=7, output_logits=True)
    assert gen.logits.dtype == torch.bfloat16  # decoded under the model's autocast
    for b, p in enumerate(prompts):
        seq = torch.tensor([p + gen.tokens[b]])
        keep = torch.tensor([gen.keep[b] + [False]])
        forced = logits(model, seq, keep=keep)[0].float()
        n = len(gen.tokens[b])
        step = gen.logits[b, :n].float()
        assert within(step, forced[len(p) - 1:len(p) - 1 + n]) < TOLERANCE
        assert within(step, forced[len(p) - 2:len(p) - 2 + n]) > 2 * TOLERANCE  # off by one position: caught
    plain = concept.load(trained).generate(prompts, max_new_tokens=2, output_logits=True)
    assert plain.logits.dtype == torch.float32  # (the control: an fp32 load decodes in fp32)


def test_an_ambient_autocast_is_left_to_an_fp32_model(trained):
    """``running`` adds nothing for fp32: a caller's own autocast (as ``tests/test_bf16.py`` decodes) still applies."""
    model = concept.load(trained)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gen = model.generate([[5, 17, 3]], max_new_tokens=2, output_logits=True)
    assert gen.logits.dtype == torch.bfloat16


def test_eval_dtype_on_the_command_line(trained):
    def evaluate(*extra):
        r = run_cli("eval", trained, "--batches", 2, "--batch", 2, "--no-controls", "--json", *extra)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    fp32, auto, bf16 = evaluate("--dtype", "fp32"), evaluate(), evaluate("--dtype", "bf16")
    assert (fp32["dtype"], auto["dtype"], bf16["dtype"]) == ("fp32", "fp32", "bf16")  # auto: fp32 on a CPU
    assert auto["bits_per_token"] == fp32["bits_per_token"]
    assert bf16["bits_per_token"] != fp32["bits_per_token"]
    assert abs(bf16["bits_per_token"] - fp32["bits_per_token"]) < 0.02 * fp32["bits_per_token"]
    bad = run_cli("eval", trained, "--dtype", "fp16")
    assert bad.exit_code != 0 and "fp16" in bad.output and "bf16" in bad.output


def test_generate_dtype_on_the_command_line(trained):
    r = run_cli("generate", trained, "--prompt", "def f(x):", "--max-new-tokens", 4, "--dtype", "bf16", "--json")
    assert r.exit_code == 0, r.output
    row = json.loads(r.stdout.splitlines()[-1])
    model = concept.load(trained, dtype="bf16")
    ids = encode_text(tokenizer_for(model), "def f(x):")
    assert row["tokens"] == model.generate([ids], max_new_tokens=4).tokens[0]  # the API's bf16 decoding, greedy


def test_scoring_runs_in_the_loaded_dtype(trained):
    pytest.importorskip("lm_eval")
    from concept.recipes.harness import ConceptLM

    lm = ConceptLM(run=str(trained), dtype="bfloat16", batch_size=2)  # (lm-eval's spelling)
    assert lm.scorer.model.precision.dtype == torch.bfloat16
    bf16 = lm.scorer.loglikelihood_tokens([([5, 6, 7], [8, 9])])[0][0]
    fp32 = ConceptLM(run=str(trained), dtype="fp32", batch_size=2).scorer.loglikelihood_tokens([([5, 6, 7], [8, 9])])[0][0]
    assert bf16 != fp32 and abs(bf16 - fp32) < 0.05 * abs(fp32)
    with pytest.raises(ConfigError, match="dtype"):
        ConceptLM(run=str(trained), dtype="int8")


def test_a_model_loaded_in_bf16_is_not_saved_and_nothing_is_written(trained, tmp_path):
    model = concept.load(trained, dtype="bf16")
    with pytest.raises(ConceptError, match="dtype='fp32'"):
        model.save_pretrained(tmp_path / "export")
    assert not (tmp_path / "export").exists()
    assert isinstance(model.precision, Precision)
    concept.load(trained, dtype="auto").save_pretrained(tmp_path / "auto")  # undecided (CPU): fp32, saved as it was
    assert (tmp_path / "auto" / "concept.json").is_file()


def test_the_frontier_evaluates_in_its_training_dtype(monkeypatch):
    from concept.recipes.frontier import running

    seen = {}

    def eval_one(*args, **kwargs):
        seen.update(kwargs)
        raise StopIteration

    monkeypatch.setattr(running, "eval_one", eval_one)
    spec = type("Spec", (), {"seq_len": 32, "eval_batches": 1, "eval_batch": 1, "controls": False,
                             "domains": [type("D", (), {"source": "stdlib", "label": "code"})()],
                             "train": small(dtype="bf16")})()
    with pytest.raises(StopIteration):
        running.evaluate_run(None, None, spec)
    assert seen["dtype"] == "bf16"
    assert running._eval_key(spec, 1)["dtype"] == "bf16"  # a cache of another dtype is not reused


def test_every_command_that_runs_a_model_takes_the_same_dtype():
    from tests.test_cli_consistency import options_of

    for name in ("train", "eval", "generate", "chat", "serve"):
        option = next((o for o in options_of(name) if "--dtype" in o.opts), None)
        assert option is not None, f"concept {name} has no --dtype"
        assert (tuple(option.type.choices), option.default) == (DTYPES, "auto"), name


def test_transformers_torch_dtype_means_the_same_precision(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    concept.load(trained).save_pretrained(tmp_path / "export")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "export", trust_remote_code=True, torch_dtype=torch.bfloat16)
    assert hf.concept.precision.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in frozen_base(hf.concept).values())
    assert all(p.dtype == torch.float32 for m in hf.concept.new_modules().values() for p in m.parameters())
    with torch.no_grad():
        assert hf(IDS).logits.dtype == torch.bfloat16
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "export", trust_remote_code=True, torch_dtype=torch.float16)
    assert getattr(half.concept, "precision", None) is None  # another dtype: the whole model cast, as before
    assert all(p.dtype == torch.float16 for p in half.concept.parameters())


@pytest.fixture(scope="module")
def other_kinds(built, corpus, tmp_path_factory):  # noqa: F811
    """A trained dense and pruned baseline and a trained planner-executor (2 steps each)."""
    from tests.test_planner_executor import pe_config
    from tests.test_planner_executor import small as pe_small

    folder = tmp_path_factory.mktemp("kinds")
    runs = {}
    for kind, extra in (("dense", {}), ("pruned", {"prune_layers": "1:2"})):
        Trainer.start(built, folder / kind, small(data=str(corpus), steps=2, baseline=kind, eval_every=2,
                                                  checkpoint_every=2, **extra)).train()
        runs[kind] = folder / kind
    concept.save(concept.build(pe_config()), folder / "pe-built")
    Trainer.start(folder / "pe-built", folder / "planner-executor", pe_small(data=str(corpus), steps=2)).train()
    runs["planner-executor"] = folder / "planner-executor"
    return runs


@pytest.mark.parametrize("kind", ["dense", "pruned", "planner-executor"])
def test_every_kind_runs_in_bf16(other_kinds, kind):
    """The precision is the core's: a baseline and the planner-executor load in bf16 (their frozen base stored in bf16,
    their trained weights fp32), their logits within bf16's tolerance of fp32's, and they generate in bf16."""
    fp32, bf16 = concept.load(other_kinds[kind]), concept.load(other_kinds[kind], dtype="bf16")
    base = frozen_base(bf16)
    assert base and all(p.dtype == torch.bfloat16 for p in base.values())
    assert all(p.dtype == torch.float32 for n, p in bf16.named_parameters() if p.requires_grad or "lora_" in n)
    ids = IDS[:, :24]
    out, reference = logits(bf16, ids), logits(fp32, ids)
    assert out.dtype == torch.bfloat16 and 0 < within(out, reference) < TOLERANCE
    gen = bf16.generate([[5, 17, 3, 44]], max_new_tokens=3, output_logits=True)
    assert len(gen.tokens[0]) == 3 and gen.logits.dtype == torch.bfloat16
