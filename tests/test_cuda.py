"""Exactness on a CUDA device: every attention backend against the naive reference, decoding against
teacher forcing, and a bf16 training run that resumes exactly.

Marked ``cuda``; without a CUDA device every test skips. The GPU kit's ``exact`` stage runs them
(``python -m benchmarks.gpu_kit exact``, docs/gpu.md); by hand: ``pytest -m cuda tests/test_cuda.py``.

* **Backends** (each one the registry lists, with its default configuration: compiled FlexAttention,
  xformers' own kernels): the padded batch of the equivalence tests (right and left padding, every
  kind of decision run), logits and the new modules' gradients, against the naive per-position loop
  (``tests/reference.py``) run in float32 on the CPU with the same weights. In fp32 the CUDA model
  must agree to ``TOLERANCES["fp32"]``; under bf16 autocast (what training uses on CUDA) to
  ``TOLERANCES["bf16"]``, with the concept ids fixed to the reference's (an argmax over near-equal
  logits may pick another id in bf16: a different input, not an error). The tiny backbone's attention
  is sharpened (q and k projections x8) so that the deep stack's rule matters: a wrong position rule
  moves the logits by 5-12% (measured on CPU), above the bf16 tolerance of 3% (the negative control
  checks it with the GPU's own bf16 output).
  Errors are relative L2 norms, ``|x - ref| / |ref|``. The tiny backbone has 2 KV heads: the bug this
  test found on its first GPU run of ``cascade`` (2026-11-27: bf16 gradients off by 1e34, the merged output
  handed to the CUDA backward in a layout it misreads across heads; docs/architecture.md §6) needs more than
  one. Its CPU counterpart, with the CUDA operators stood in for: tests/test_uninitialised_memory.py.
* **The deep block**: the same with a static budget, the deep stack over one block of T slots (`sdpa`,
  `chunked`, `flex`: the backends that plan it).
* **Decoding** with the KV caches equals the teacher-forced one-pass forward (fp32).
* **Training** in bf16 on CUDA, interrupted after 3 of 6 steps and resumed, gives the same losses
  and weights bit for bit as the uninterrupted run (under ``torch.use_deterministic_algorithms``).
* **Compiled** (``--compile on``: ``reduce-overhead``, CUDA graphs, whose outputs' memory the next compiled
  call reuses; ``concept.compiled``): a no-grad forward with every output kept past the later calls, the
  prefill and the static decoding step, and three bf16 training steps (the first with the ratio controller's
  no-grad calibration forward, which crashed on 2026-11-27) equal eager; under ``--compile model`` over two layers
  a stack (each stack's second layer a second call of its nested compile region), its training forward and backward
  CUDA graphs (none skipped), with and without gradient accumulation. On a CPU,
  ``tests/test_graph_memory.py`` emulates the graphs' memory rules.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import warnings

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (read when it first starts)

import concept  # noqa: E402
from concept import BuildConfig, ComponentRef  # noqa: E402
from concept.losses import next_token_loss  # noqa: E402
from concept.registry import registry  # noqa: E402
from concept.training import TrainConfig, Trainer  # noqa: E402
from concept.compiled import compile_model  # noqa: E402
from benchmarks.compiled import count_cudagraph_recordings, cudagraph_recordings, cudagraph_skips  # noqa: E402
from tests.conftest import (POLICIES, assert_decoding_matches_teacher_forcing, mix_decisions,  # noqa: E402
                            randomize_new_modules, tiny_config)
from tests.test_graph_memory import batch, streaming_forward, streaming_model  # noqa: E402
from tests.reference import reference_logits, shallow_states  # noqa: E402
from tests.test_equivalence import padded_batch  # noqa: E402
from tests.test_training import (corpus, losses, small,  # noqa: E402,F401  (corpus: a fixture)
                                 train_interrupted_and_resumed)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# relative L2 error allowed against the float32 reference: logits, all new-module gradients together,
# and each gradient tensor alone
TOLERANCES = {"fp32": {"logits": 1e-4, "grads": 1e-4, "grad_each": 1e-3},
              "bf16": {"logits": 3e-2, "grads": 5e-2, "grad_each": 1e-1}}
SHARPEN = 8.0
BACKENDS = registry("attention").names()


def cuda_models(name: str, seed: int = 0, device: str = "cuda"):
    """(CPU float32 model, its copy on CUDA): tiny backbone with sharpened attention, random new modules,
    backend ``name`` with its default configuration. (``device``: another device for the copy, e.g. to check a
    test's own code on a CPU.)"""
    reason = getattr(registry("attention").get(name), "unavailable_reason", lambda: "")()
    if reason:
        pytest.skip(f"attention {name!r}: {reason}")
    cfg = tiny_config()
    cfg.attention = ComponentRef(name)
    model = randomize_new_modules(concept.build(cfg), seed=seed).eval()
    with torch.no_grad():
        for n, p in model.backbone.named_parameters():
            if "q_proj" in n or "k_proj" in n:
                p.mul_(SHARPEN)
    return model, copy.deepcopy(model).to(device)


def relative(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / max(float(ref.norm()), floor))


def new_module_grads(model, logits, ids, valid) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    next_token_loss(logits, ids, valid).backward()
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def run_cuda(model, ids, mask, keep, concept_ids, dtype: str, device: str = "cuda"):
    """The CUDA model's logits on the batch, under bf16 autocast for ``dtype == "bf16"``."""
    dev = [t.to(device) for t in (ids, mask, keep, concept_ids)]
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        return model(dev[0], attention_mask=dev[1], keep=dev[2], concept_ids=dev[3]).logits


def reference(model):
    """The padded batch, the reference's concept ids, its logits and gradients (CPU, float32)."""
    ids, mask, keep = padded_batch()
    valid = mask.bool()
    with torch.no_grad():
        concept_ids = model.decide(shallow_states(model, ids, valid), valid, keep)[3]
    ref = reference_logits(model, ids, attention_mask=mask, keep=keep)[0]
    return ids, mask, keep, valid, concept_ids, ref, new_module_grads(model, ref, ids, valid)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_the_naive_reference_on_cuda(backend, dtype):
    cpu, gpu = cuda_models(backend)
    ids, mask, keep, valid, concept_ids, ref, ref_grads = reference(cpu)
    logits = run_cuda(gpu, ids, mask, keep, concept_ids, dtype)
    assert_logits_match(f"{backend} {dtype}", logits, ref, valid, TOLERANCES[dtype])
    grads = new_module_grads(gpu, logits, ids.to("cuda"), valid.to("cuda"))
    assert_gradients_match(f"{backend} {dtype}", grads, ref_grads, TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "chunked", "flex"])
def test_the_deep_block_matches_the_naive_reference_on_cuda(backend, dtype):
    deep_block_case(backend, dtype)


def deep_block_case(backend: str, dtype: str, device: str = "cuda") -> None:
    """A static layout's deep stack over its block (``packing.DeepBlock``, each row's tail right after its own
    concepts; a budget that never binds on this batch, 1.0) against the naive reference: logits and gradients, as
    above, and the deep stack run on T slots (the layout would be 2T)."""
    cpu, gpu = cuda_models(backend, device=device)
    cpu.max_ratio = gpu.max_ratio = 1.0
    assert gpu.plans_deep_block()
    ids, mask, keep, valid, concept_ids, ref, ref_grads = reference(cpu)
    widths = []
    hook = gpu.deep[0].register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    try:
        logits = run_cuda(gpu, ids, mask, keep, concept_ids, dtype, device)
    finally:
        hook.remove()
    assert widths == [ids.shape[1]]
    assert_logits_match(f"{backend} {dtype} deep block", logits, ref, valid, TOLERANCES[dtype])
    grads = new_module_grads(gpu, logits, ids.to(device), valid.to(device))
    assert_gradients_match(f"{backend} {dtype} deep block", grads, ref_grads, TOLERANCES[dtype])


def assert_logits_match(label: str, logits, ref, valid, tol: dict) -> None:
    """The logits at real tokens, finite and within ``tol["logits"]`` of the reference's (CPU float32)."""
    logits = logits.float().cpu()
    assert torch.isfinite(logits[valid]).all(), f"{label}: non-finite logits at real tokens"
    err = relative(logits[valid], ref[valid])
    assert err <= tol["logits"], (f"{label}: logits differ from the naive reference by {err:.2e} "
                                  f"(allowed {tol['logits']:.0e})")


def assert_gradients_match(label: str, grads: dict, ref_grads: dict, tol: dict) -> None:
    """The new modules' gradients (CPU), all together within ``tol["grads"]`` of the reference's, each tensor
    within ``tol["grad_each"]`` (relative to the larger of its norm and 1e-3 of the whole's)."""
    assert set(grads) == set(ref_grads)
    flat, ref_flat = (torch.cat([g[n].flatten() for n in sorted(ref_grads)]) for g in (grads, ref_grads))
    err = relative(flat, ref_flat)
    assert err <= tol["grads"], f"{label}: gradients differ by {err:.2e} (allowed {tol['grads']:.0e})"
    floor = 1e-3 * float(ref_flat.norm())
    worst = max((relative(grads[n], ref_grads[n], floor), n) for n in ref_grads)
    assert worst[0] <= tol["grad_each"], f"{label}: the gradient of {worst[1]} differs by {worst[0]:.2e}"


def test_bf16_tolerance_separates_a_wrong_rule():
    """Negative control: the bf16 output on this GPU is outside the bf16 tolerance of a wrong reference
    (positions numbered by packed index): agreement within that tolerance above is not vacuous."""
    cpu, gpu = cuda_models("chunked")
    ids, mask, keep = padded_batch()
    valid = mask.bool()
    with torch.no_grad():
        concept_ids = cpu.decide(shallow_states(cpu, ids, valid), valid, keep)[3]
        wrong = reference_logits(cpu, ids, attention_mask=mask, keep=keep, deep_positions="packed-index")[0]
        logits = run_cuda(gpu, ids, mask, keep, concept_ids, "bf16").float().cpu()
    err = relative(logits[valid], wrong[valid])
    assert err > TOLERANCES["bf16"]["logits"], f"a wrong rule is only {err:.2e} away: the bf16 tolerance cannot see it"


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_matches_teacher_forcing_on_cuda(backend):
    cpu, _ = cuda_models(backend)
    model = mix_decisions(cpu).to("cuda")  # about 30% of the tokens emit a concept
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 13, 1)]
    gen = assert_decoding_matches_teacher_forcing(model, prompts, 16, atol=1e-4)
    decisions = [k for row in gen.keep for k in row]
    assert 0 < sum(decisions) < len(decisions)  # both kinds of step happen


def test_decoding_with_other_policies_on_cuda():
    for policy in ("fixed", "threshold"):
        cfg = tiny_config(policy=POLICIES[policy], attention="chunked")
        model = mix_decisions(randomize_new_modules(concept.build(cfg))).eval().to("cuda")
        assert_decoding_matches_teacher_forcing(model, [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3]], 12, atol=1e-4)


def precision() -> dict:
    """bf16 explicitly where the training config has a ``dtype`` (else CUDA's default bf16 autocast)."""
    return {"dtype": "bf16"} if "dtype" in {f.name for f in dataclasses.fields(TrainConfig)} else {}


@pytest.mark.parametrize("attention", ["chunked", "auto"])
def test_bf16_training_resumes_exactly_on_cuda(corpus, tmp_path, attention):  # noqa: F811
    built = tmp_path / "built"
    concept.save(concept.build(BuildConfig(
        backbone=ComponentRef("tiny-llama", {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1, "intermediate": 64}),
        split="1,2,1", vocabulary=ComponentRef("embedding", {"size": 32}), attention=ComponentRef(attention))), built)
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_three_runs(built, tmp_path, small(data=str(corpus), device="cuda", **precision()))
    finally:
        torch.use_deterministic_algorithms(False)
    ops = sorted({str(w.message).split(" does not have a deterministic")[0] for w in caught
                  if "deterministic" in str(w.message)})
    straight, rerun, resumed = (losses(tmp_path / n) for n in ("straight", "again", "resumed"))
    spread = max(abs(a - b) for a, b in zip(straight, rerun))
    assert straight == rerun, (f"two uninterrupted bf16 runs differ (max |Δloss| {spread:.2e}): not deterministic "
                               f"here; ops without a deterministic kernel: {ops or 'none reported'}")
    gap = max(abs(a - b) for a, b in zip(straight, resumed))
    assert straight == resumed, f"the resumed run's losses differ from the uninterrupted run's (max |Δloss| {gap:.2e})"
    a, b = concept.load(tmp_path / "straight").to("cuda"), concept.load(tmp_path / "resumed").to("cuda")
    ids = torch.randint(0, 256, (1, 20), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=0, atol=0)


def train_three_runs(built, tmp_path, config) -> None:
    """Two uninterrupted runs (the determinism control) and one stopped after step 3 and resumed."""
    for name in ("straight", "again"):
        Trainer.start(built, tmp_path / name, copy.deepcopy(config)).train()
    train_interrupted_and_resumed(built, tmp_path / "resumed", copy.deepcopy(config))


# -- --compile: CUDA graphs (reduce-overhead) ---------------------------------------------------------------
def per_stack(choice: str) -> int:
    """Layers a stack of the compiled tests' model: two under ``model``, so that each stack's second layer is a second
    call of its nested compile region (stamped out from the first from torch 2.13; traced again and compared with it
    under 2.11, the GPU image's, where the fused adapters' ``autograd.Function`` failed that comparison in a training
    step), which a stack of one layer never makes."""
    return 2 if choice == "model" else 1


def compiled_forward_errors(device: str = "cuda", choice: str = "on", grad_mode=torch.no_grad) -> dict[str, float]:
    """The largest relative error of a compiled no-grad forward's logits / shallow states / deep outputs against
    eager's, over three calls (cudagraph trees warm up, record, replay), each kept until all three ran (``model``: each
    call's outputs copied out of the graphs' memory: else reading the first after the third raises), and the CUDA
    graphs recorded by the third call (``recorded_again``: 0, a replay) and skipped in all."""
    count_cudagraph_recordings()
    skips = cudagraph_skips()
    model = streaming_model(per_stack(choice)).to(device)
    compiled = compile_model(copy.deepcopy(model), choice)
    ids = [batch(seed).to(device) for seed in range(3)]
    with grad_mode():
        assert 0 < int(model(ids[0]).keep.sum()) < ids[0].numel()  # (the middle stack runs: concepts and a tail)
        eager = [streaming_forward(model, x) for x in ids]
        fast, recorded = [], []
        for x in ids:
            fast.append(streaming_forward(compiled, x))
            recorded.append(cudagraph_recordings())
    errors = {name: max(relative(b[i], a[i]) for a, b in zip(eager, fast))
              for i, name in enumerate(("logits", "shallow", "hidden"))}
    return {**errors, "recorded_again": recorded[2] - recorded[1],
            "skipped": cudagraph_skips() - skips}


@pytest.mark.parametrize("choice,grad_mode", [("on", torch.no_grad), ("model", torch.no_grad),
                                              ("model", torch.inference_mode)],
                         ids=["on", "model", "model-inference-mode"])
def test_compiled_no_grad_forward_equals_eager_on_cuda(choice, grad_mode):
    """``on``: one CUDA graph per layer; ``model``: the whole forward one CUDA graph (inductor, its length policy's
    Triton scan inside, two layers a stack: :func:`per_stack`), its outputs copied out (``WholeForward``), none
    skipped, the third call a replay."""
    errors = compiled_forward_errors(choice=choice, grad_mode=grad_mode)
    recorded_again, skipped = errors.pop("recorded_again"), errors.pop("skipped")
    assert max(errors.values()) <= TOLERANCES["fp32"]["logits"], f"compiled forward vs eager: {errors}"
    if choice == "model":
        assert skipped == 0, "inductor skipped CUDA graphs for the no-grad forward (its log says why)"
        assert recorded_again == 0, "the third no-grad forward recorded its CUDA graph again"


def test_compile_auto_is_the_gpu_choice_on_cuda():
    """``--compile auto`` on this CUDA device: compiled, the kit's choice (``model`` where this torch compiles layer
    regions, the GPU image's 2.11 included), decided for the device the model was moved to after it was compiled on
    the CPU (as ``concept.load(..., compile="auto")`` compiles it); nothing compiled here (the choice's own tests
    run it)."""
    from concept.compiled import compiled_choice, gpu_choice, settle

    model = compile_model(streaming_model(), "auto")
    assert compiled_choice(model) == "auto"
    settle(model.to("cuda"), torch.device("cuda"))
    assert compiled_choice(model) == gpu_choice() != "off", model.compile_reason


def bf16_on_load_case(device: str = "cuda"):
    """A built model given ``dtype="auto"`` (``concept.load``'s, the inference commands' default) and moved to
    ``device``: (the fp32 model's logits on the padded batch there, the auto model's, its batch mask, the auto model)."""
    from concept.precision import use_dtype

    _, fp32 = cuda_models("auto", device=device)
    model = use_dtype(copy.deepcopy(fp32), "auto")
    ids, mask, keep = (t.to(device) for t in padded_batch())
    with torch.no_grad():
        return (fp32(ids, attention_mask=mask, keep=keep).logits, model(ids, attention_mask=mask, keep=keep).logits,
                mask.bool(), model)


def test_dtype_auto_runs_bf16_on_cuda():
    """On CUDA ``auto`` is bf16: the frozen base stored in bf16 at the first call, the logits bf16 within bf16's
    tolerance of the fp32 model on the same device, and decoding equal to teacher forcing within it."""
    from concept.precision import frozen_base

    ref, out, valid, model = bf16_on_load_case()
    assert out.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in frozen_base(model).values())
    err = relative(out[valid].float(), ref[valid])
    assert 0 < err <= TOLERANCES["bf16"]["logits"], f"bf16 logits {err:.2e} from fp32's"
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3]]
    gen = model.generate(prompts, max_new_tokens=8, output_logits=True)
    assert gen.logits.dtype == torch.bfloat16
    for b, p in enumerate(prompts):
        seq = torch.tensor([p + gen.tokens[b]], device="cuda")
        keep = torch.tensor([gen.keep[b] + [False]], device="cuda")
        with torch.no_grad():
            forced = model(seq, keep=keep).logits[0, len(p) - 1:len(p) - 1 + len(gen.tokens[b])]
        err = relative(gen.logits[b, :len(gen.tokens[b])].float(), forced.float())
        assert err <= TOLERANCES["bf16"]["logits"], f"bf16 decoding {err:.2e} from bf16 teacher forcing"


def test_training_batches_reach_cuda_without_a_host_sync(corpus, tmp_path):  # noqa: F811
    """``Trainer.batch`` on CUDA (``concept.syncs.to_device``: pinned memory, a non-blocking copy): no
    synchronisation call, so the host queues the next step while the device runs the one before. The control: the
    same batch moved with a plain ``.to("cuda")`` (pageable memory) is counted, ``cudaStreamSynchronize``."""
    from concept.profiling import profile_call

    concept.save(streaming_model(), tmp_path / "built")
    trainer = Trainer.start(tmp_path / "built", tmp_path / "run", small(data=str(corpus), device="cuda", steps=4,
                                                                         eval_every=100, checkpoint_every=100))
    trainer.batch(0)  # (the caching host allocator's first pinned blocks)
    assert profile_call(lambda: trainer.batch(1), "cuda")["host_syncs"] == 0
    pageable = trainer.train_data.batch(2, trainer.config.batch)
    synced = profile_call(lambda: {k: v.to("cuda") for k, v in pageable.items()}, "cuda")["host_syncs"]
    assert synced >= len(pageable), f"the control: {synced} syncs for {len(pageable)} pageable copies"


def evaluation_syncs(batches: int, device: str = "cuda") -> int:
    """Host syncs of a held-out evaluation (``concept.diagnostics.evaluate``, no controls) of ``batches`` host batches
    on ``device``: the sums stay there and each batch arrives through ``to_device``."""
    from concept.diagnostics import evaluate
    from concept.profiling import profile_call

    model = streaming_model().to(device)
    data = [{"input_ids": (ids := batch(seed)), "attention_mask": torch.ones_like(ids),
             "document_ids": torch.tensor([[0] * 10 + [1] * 14, [0] * 24])} for seed in range(batches)]
    evaluate(model, data[:1], controls=False)  # (warm-up: the pinned blocks, the device scan's first compile)
    return profile_call(lambda: evaluate(model, data, controls=False), device)["host_syncs"]


def test_an_evaluation_stops_the_host_only_after_its_last_batch_on_cuda():
    """Four batches of a held-out evaluation sync as often as one: nothing is read back per batch (the batches pinned
    and copied without waiting, the sums on the device), so the host queues the next batch's forward while the device
    runs this one."""
    one, four = evaluation_syncs(1), evaluation_syncs(4)
    assert four == one, f"{one} host syncs for one batch, {four} for four"


def compiled_generation(device: str = "cuda", choice: str = "on"):
    """(eager, compiled) greedy generations of a few prompts: the compiled prefill's stacks record the KV caches,
    then the compiled static step decodes."""
    model = streaming_model().to(device)
    compiled = compile_model(copy.deepcopy(model), choice)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    return tuple(m.generate(prompts, max_new_tokens=6, output_logits=True) for m in (model, compiled))


def test_compiled_generation_equals_eager_on_cuda():
    eager, fast = compiled_generation()
    assert fast.tokens == eager.tokens and fast.keep == eager.keep
    err = relative(fast.logits, eager.logits)
    assert err <= TOLERANCES["fp32"]["logits"], f"compiled generation's logits differ from eager's by {err:.2e}"


def served_replies(device: str = "cuda", choice: str = "on") -> tuple:
    """(eager generation's text, each of three requests' replies, the CUDA graphs recorded by the second and third):
    ``concept serve --compile``'s engine over a compiled model, each request from a thread of its own (as the server's
    request threads), one prompt size."""
    import threading

    from concept.serving import Engine

    count_cudagraph_recordings()
    model = streaming_model().to(device)
    engine = Engine(compile_model(copy.deepcopy(model), choice), "m")
    ids, settings = [1, 2, 3, 4, 5, 6, 7, 8], {"max_new_tokens": 6, "stop_strings": (), "do_sample": False, "seed": None}
    replies, recorded = [], []
    for i in range(3):
        asking = threading.Thread(target=lambda: replies.append(engine.run(ids, settings)))
        asking.start()
        asking.join()
        recorded.append(cudagraph_recordings())
    eager = concept.generate(model, [ids], tokenizer=engine.tokenizer, max_new_tokens=6).texts[0]
    return eager, [r.text for r in replies], recorded[-1] - recorded[0]


def test_served_requests_replay_the_decoding_graphs_recorded_once_on_cuda():
    """The server's requests decode in its one thread, so torch's CUDA-graph trees (per thread) recorded by the first
    request are replayed by the next, each from another request thread: none recorded again, replies as eager's."""
    from tests.conftest import in_a_fresh_process

    # (a fresh process: it compiles in the engine's thread, which torch 2.11 survives only in a process of its own)
    eager, replies, recorded_again = in_a_fresh_process("tests.test_cuda:served_replies", timeout=600)
    assert replies == [eager] * 3
    assert recorded_again == 0, f"the later requests recorded {recorded_again} CUDA graphs again"


def compiled_training_rows(corpus, folder, device: str = "cuda", choice: str = "on", steps: int = 3,
                           grad_accum: int = 1):
    """(eager, compiled) rows of ``steps`` bf16 training steps of the default streaming build (LoRA in every
    stack); the first step calibrates the NULL bias with a no-grad forward."""
    count_cudagraph_recordings()
    concept.save(streaming_model(per_stack(choice)), folder / "built")
    rows = []
    for name in ("off", choice):
        trainer = Trainer.start(folder / "built", folder / name, small(
            data=str(corpus), device=device, steps=steps, eval_every=100, checkpoint_every=100, log_every=1,
            compile=name, grad_accum=grad_accum, **precision()))
        rows.append([trainer.train_step() | {"recorded": cudagraph_recordings()} for _ in range(steps)])
    return rows


@pytest.mark.parametrize("choice,grad_accum", [("on", 1), ("model", 1), ("model", 2)],
                         ids=["on", "model", "model-accumulated"])
def test_compiled_training_steps_equal_eager_on_cuda(corpus, tmp_path, choice, grad_accum):  # noqa: F811
    """``model``: the training forward and its backward as CUDA graphs (``WholeForward.cuda_graphs``), none skipped
    (inductor counts a skip and says why in its log); accumulated: the weights keep ``.grad`` buffers of their own
    (the second micro-batch's forward reuses the first's graph memory: ``tests/test_graph_memory.py``)."""
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    eager, fast = compiled_training_rows(corpus, tmp_path, choice=choice, steps=4 if grad_accum > 1 else 3,
                                         grad_accum=grad_accum)
    if choice == "model":
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips, "inductor skipped CUDA graphs"
        # (the last step replays what the steps before recorded: a static input at a new address, e.g. the adapters'
        # casts, WholeForward.cast_adapters, would make the trees record again at every step, silently)
        assert fast[-1]["recorded"] == fast[-2]["recorded"], "CUDA graphs recorded again in a steady step"
    tol = TOLERANCES["bf16"]
    for a, b in zip(eager, fast):
        assert b["loss"] == pytest.approx(a["loss"], rel=tol["logits"]), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=tol["grads"]), (a, b)
        assert abs(b["ratio"] - a["ratio"]) <= 0.05, (a, b)  # (bf16 may move a boundary or two)
