"""A loaded model's LoRA adapters merged into its base weights: ``concept.load(..., merge_lora=True)``, the
``--merge-lora`` of ``eval``, ``generate``, ``chat`` and ``serve``, lm-eval's ``merge_lora`` and transformers'
``from_pretrained(..., merge_lora=True)`` (``concept.lora.merge_adapters``).

Merged, each adapted projection is the plain ``nn.Linear`` of ``W + s B A``: the same logits as the adapters up to fp32
rounding (the negative control: the same model with its adapters off is far from them, so the adapters count), and the
forward is the backbone's without adapters: one matmul a projection, no adapter weight read or cast (counted by a
``TorchDispatchMode``; the control: the unmerged bf16 model casts its adapters at every forward). Under bf16 the
weights are merged in fp32 and then rounded once. What needs the adapters apart (saving, the frozen backbone without
them) refuses a merged model, and nothing is written.
"""
import json

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import concept
from concept.backbone import decoder
from concept.errors import ConceptError, ConfigError
from concept.lora import lora_merged, merge_adapters
from concept.precision import store_frozen_base
from concept.teacher import adapters_disabled, teacher_forward
from tests.test_cli_train import run as run_cli
from tests.test_inference_dtype import IDS, TOLERANCE, logits, other_kinds, trained, within  # noqa: F401 (fixtures)
from tests.test_training import built, corpus  # noqa: F401  (fixtures)

FP32 = 1e-5  # merged against the adapters: fp32 rounding, relative to the logits' range
PROJECTIONS = 7  # LoRA's default targets: q, k, v, o, gate, up, down
pytestmark = pytest.mark.usefixtures("one_thread")


def adapted_layers(model) -> int:
    return len(decoder(model.backbone).layers) * PROJECTIONS


class Reads(TorchDispatchMode):
    """Counts aten ops by name, and those that read one of ``watched``'s storages (any tensor argument)."""

    def __init__(self, watched=()):
        super().__init__()
        self.watched = {t.untyped_storage().data_ptr() for t in watched}
        self.ops, self.reading = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.watched
               for t in tree_flatten((args, kwargs or {}))[0]):
            self.reading[name] += 1
        return func(*args, **(kwargs or {}))


def forward_ops(model, watched=()) -> tuple[Reads, torch.Tensor]:
    """The ops of one no-grad forward, counted (those reading ``watched`` apart); and its logits."""
    counter = Reads(watched)
    with counter, torch.no_grad():
        out = model(IDS).logits
    return counter, out


def adapters(model) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if "lora_" in n]


def test_merged_logits_equal_the_adapters_within_fp32_rounding(trained):
    plain, merged = concept.load(trained), concept.load(trained, merge_lora=True)
    assert lora_merged(merged.backbone) == adapted_layers(merged) and lora_merged(plain.backbone) == 0
    reference, out = logits(plain), logits(merged)
    assert within(out, reference) < FP32
    with adapters_disabled(plain.backbone):  # the negative control: the adapters change the logits far more
        assert within(logits(plain), reference) > 100 * FP32


def test_a_merged_forward_runs_one_matmul_a_projection_and_reads_no_adapter(trained):
    plain, merged = concept.load(trained), concept.load(trained, merge_lora=True)
    assert not adapters(merged)
    assert all(type(m) is torch.nn.Linear for n, m in merged.backbone.named_modules() if n.endswith("_proj"))
    counted, _ = forward_ops(merged)
    control, _ = forward_ops(plain, adapters(plain))
    mm = lambda c: c.ops["mm"] + c.ops["addmm"] + c.ops["bmm"]  # noqa: E731
    assert mm(control) - mm(counted) >= 2 * adapted_layers(plain)  # each adapted projection: two adapter products
    assert sum(control.reading.values()) >= 2 * adapted_layers(plain)  # (the control reads every adapter)
    assert sum(counted.ops.values()) < sum(control.ops.values())


def test_merged_in_fp32_then_rounded_once_to_bf16_and_no_weight_cast_a_forward(trained):
    fp32 = concept.load(trained, merge_lora=True)
    bf16 = concept.load(trained, merge_lora=True, dtype="bf16")
    weights = dict(fp32.backbone.named_parameters())
    for name, p in bf16.backbone.named_parameters():
        if name.endswith("_proj.weight"):
            assert p.dtype == torch.bfloat16 and torch.equal(p, weights[name].to(torch.bfloat16)), name
    counted, out = forward_ops(bf16, list(bf16.backbone.parameters()))
    casts = ("_to_copy", "copy_", "cat")
    assert not any(counted.reading[c] for c in casts), counted.reading  # no backbone weight cast in a forward
    plain = concept.load(trained, dtype="bf16")
    control, _ = forward_ops(plain, adapters(plain))
    assert sum(control.reading[c] for c in casts) > 0  # the control: the unmerged model casts its adapters each call
    assert out.dtype == torch.bfloat16 and within(out, logits(concept.load(trained))) < TOLERANCE


def test_merged_generation_equals_its_teacher_forcing_and_the_adapters(trained):
    plain, merged = concept.load(trained), concept.load(trained, merge_lora=True)
    prompts = [[5, 17, 3, 44, 9], [8, 2, 61]]
    gen = merged.generate(prompts, max_new_tokens=6, output_logits=True)
    reference = plain.generate(prompts, max_new_tokens=6, output_logits=True)
    for b, p in enumerate(prompts):
        n = len(gen.tokens[b])
        seq = torch.tensor([p + gen.tokens[b]])
        forced = logits(merged, seq, keep=torch.tensor([gen.keep[b] + [False]]))[0]
        assert within(gen.logits[b, :n], forced[len(p) - 1:len(p) - 1 + n]) < FP32
        assert within(gen.logits[b, :n], forced[len(p) - 2:len(p) - 2 + n]) > 100 * FP32  # off by one: caught
    assert gen.tokens == reference.tokens and within(gen.logits, reference.logits) < FP32


def test_what_needs_the_adapters_apart_refuses_a_merged_model_and_writes_nothing(trained, tmp_path):
    merged = concept.load(trained, merge_lora=True)
    with pytest.raises(ConceptError, match="merge_lora"):
        merged.save_pretrained(tmp_path / "export")
    assert not (tmp_path / "export").exists()
    with pytest.raises(ConceptError, match="without merge_lora"):
        teacher_forward(merged, IDS)
    with pytest.raises(ConfigError, match="merge_lora"):
        concept.load(trained, merge_lora="yes")
    stored = concept.load(trained)
    store_frozen_base(stored, torch.bfloat16)
    with pytest.raises(ConceptError, match="not fp32"):  # the update would be rounded away
        merge_adapters(stored.backbone)
    assert lora_merged(stored.backbone) == 0


def test_a_model_without_adapters_merges_nothing(built):  # noqa: F811
    model = concept.load(built, merge_lora=True)
    assert lora_merged(model.backbone) == 0
    assert torch.equal(logits(model), logits(concept.load(built)))


@pytest.mark.parametrize("kind", ["dense", "pruned", "planner-executor"])
def test_every_kind_merges(other_kinds, kind):  # noqa: F811
    plain, merged = concept.load(other_kinds[kind]), concept.load(other_kinds[kind], merge_lora=True)
    assert lora_merged(merged.backbone) > 0 and not [n for n, _ in merged.named_parameters() if "lora_" in n]
    ids = IDS[:, :24]
    assert within(logits(merged, ids), logits(plain, ids)) < FP32


def test_eval_and_generate_merge_on_the_command_line(trained):
    def evaluate(*extra):
        r = run_cli("eval", trained, "--eval-batches", 2, "--batch", 2, "--no-controls", "--json", *extra)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    plain, merged = evaluate(), evaluate("--merge-lora")
    assert "lora_merged" not in plain and merged["lora_merged"] == adapted_layers(concept.load(trained))
    assert abs(merged["bits_per_token"] - plain["bits_per_token"]) < FP32 * plain["bits_per_token"]
    table = run_cli("eval", trained, "--eval-batches", 1, "--batch", 2, "--no-controls", "--merge-lora")
    assert table.exit_code == 0 and "LoRA layers merged into the base" in table.output
    r = run_cli("generate", trained, "--prompt", "def f(x):", "--max-new-tokens", 4, "--merge-lora", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.splitlines()[-1])["tokens"] == json.loads(
        run_cli("generate", trained, "--prompt", "def f(x):", "--max-new-tokens", 4, "--json").stdout.splitlines()[-1]
    )["tokens"]


def test_a_planner_evaluation_with_its_frozen_backbone_controls_says_what_to_drop(other_kinds):  # noqa: F811
    run = other_kinds["planner-executor"]
    r = run_cli("eval", run, "--eval-batches", 1, "--batch", 2, "--merge-lora")
    assert r.exit_code == 1 and "Traceback" not in r.output and "--no-controls" in r.output, r.output
    r = run_cli("eval", run, "--eval-batches", 1, "--batch", 2, "--merge-lora", "--no-controls", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["lora_merged"] > 0, r.output


def test_every_command_that_runs_a_model_takes_merge_lora():
    from tests.test_cli_consistency import options_of

    for name in ("eval", "generate", "chat", "serve"):
        option = next((o for o in options_of(name) if "--merge-lora" in o.opts), None)
        assert option is not None and option.is_flag and option.default is False, f"concept {name} --merge-lora"
    shown = run_cli("eval", "--help").output
    section = shown[shown.index("Device and precision:"):]
    assert "--merge-lora" in section[:section.index("\n\n")]  # (--help: beside --dtype)


def test_lm_eval_and_transformers_merge_too(trained, tmp_path):
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM

    from concept.recipes.harness import ConceptLM

    request = [([5, 6, 7], [8, 9])]
    merged = ConceptLM(run=str(trained), merge_lora=True, batch_size=2)
    plain = ConceptLM(run=str(trained), batch_size=2)
    assert lora_merged(merged.scorer.model.backbone) > 0
    a, b = merged.scorer.loglikelihood_tokens(request)[0][0], plain.scorer.loglikelihood_tokens(request)[0][0]
    assert abs(a - b) < FP32 * abs(b)
    concept.load(trained).save_pretrained(tmp_path / "export")  # its adapters a peft folder
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "export", trust_remote_code=True, merge_lora=True)
    assert lora_merged(hf.concept.backbone) > 0
    with torch.no_grad():
        assert within(hf(IDS).logits, logits(concept.load(trained))) < FP32
