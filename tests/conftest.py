import os

import pytest
import torch

import concept
from concept import BuildConfig, ComponentRef

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs one pytest worker per core: one thread each, and
    torch.set_num_threads(1)
    for name in ("COLUMNS", "LINES"):  # the worker's 80 x 24 (execnet sets them) would squeeze the CLI's tables
        os.environ.pop(name, None)


@pytest.fixture(scope="session", autouse=True)
def token_shards_in_a_temporary_folder(tmp_path_factory):
    """The tests' token shards (every corpus a test makes gets one) go to a folder of the session, not the
    user's cache (concept.shards; converted backbones stay in the cache)."""
    if not os.environ.get("CONCEPT_DATA_CACHE"):
        os.environ["CONCEPT_DATA_CACHE"] = str(tmp_path_factory.mktemp("token-shards"))


def tiny_config(backbone="tiny-llama", attention="sdpa", positions="time", split="2,2,2", vocab=32,
                policy=("null", {"max_run": 3}), **extra):
    cfg = BuildConfig(
        backbone=ComponentRef(backbone, {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 97}),
        split=split,
        attention=ComponentRef(attention, {"chunked": {"chunk": 4}, "flex": {"compile": False},
                                            "xformers": {"kernel": "reference"}}.get(attention, {})),
        position_scheme=ComponentRef(positions),
        vocabulary=extra.pop("vocabulary", ComponentRef("embedding", {"size": vocab})),
        length_policy=ComponentRef(*policy),
        **{"max_ratio": 0.0, **extra},  # the dynamic layout (the tests that mix ~30% concepts); opt in to a budget
    )
    return cfg


def randomize_new_modules(model, seed=0):
    """New modules start near-trivial (zero type embeddings); perturb them so the tests see them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.new_state_dict().values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: threads only add contention (``pytestmark =
    pytest.mark.usefixtures("one_thread")`` in a module whose tests train or run many tiny models)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models():
    cache = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = randomize_new_modules(concept.build(tiny_config(**kw)))
        return cache[key]

    return get


POLICIES = {
    "null": ("null", {"max_run": 3}),
    "threshold": ("threshold", {"threshold": 1.0, "max_run": 3}),
    "fixed": ("fixed", {"every": 3}),
    "fixed-emit2": ("fixed", {"every": 3, "emit": 2}),  # two concept slots at each boundary
    "entropy": ("entropy", {"min_chunk": 2, "max_chunk": 4}),
    "mtp": ("mtp", {"heads": 3, "min_chunk": 2, "max_chunk": 4}),
    "mtp-untracked": ("mtp", {"heads": 3, "min_chunk": 2, "max_chunk": 4, "track": 0}),
}


def mix_decisions(model):
    """Tune the policy so that about 30% of a random input's tokens emit a concept (both kinds of step)."""
    policy = model.length_policy
    with torch.no_grad():
        x = torch.randint(0, 97, (4, 64), generator=torch.Generator().manual_seed(9))
        out = model(x)
        if hasattr(policy, "keep_logit"):
            policy.null_bias += torch.quantile(policy.keep_logit(out.head_logits, out.shallow).flatten().double(), 0.7).float()
        if hasattr(policy, "confidence"):
            policy.config.tau = float(torch.quantile(policy.confidence(out.shallow).flatten(), 0.4))
    return model


_CACHE = {}


def mixed_model(policy="null", attention="sdpa", positions="time", backbone="tiny-llama", **extra):
    key = (policy, attention, positions, backbone, tuple(sorted((k, str(v)) for k, v in extra.items())))
    if key not in _CACHE:
        cfg = tiny_config(backbone=backbone, attention=attention, positions=positions, policy=POLICIES[policy], **extra)
        _CACHE[key] = mix_decisions(randomize_new_modules(concept.build(cfg))).eval()
    return _CACHE[key]


PACKED_DOC = [[0] * 5 + [1] * 7 + [2] * 4]  # three documents packed in one row of 16 tokens


def assert_packed_documents_equal_separate_rows(model, ids, keep, atol=1e-5):
    """Documents packed in one row (``PACKED_DOC``) give each document's logits alone."""
    doc = torch.tensor(PACKED_DOC)
    with torch.no_grad():
        packed = model(ids, keep=keep, document_ids=doc)
        for d in range(3):
            cols = doc[0] == d
            alone = model(ids[:, cols], keep=keep[:, cols])
            torch.testing.assert_close(packed.logits[:, cols], alone.logits, atol=atol, rtol=0)


def assert_decoding_matches_teacher_forcing(model, prompts, max_new_tokens, atol=1e-5):
    """Step-wise decoding: its decisions are the batched ones on the final sequence, and its logits
    are the teacher-forced one-pass logits with those decisions (on the model's device). Returns the generation."""
    gen = model.generate(prompts, max_new_tokens=max_new_tokens, output_logits=True)
    device = next(model.parameters()).device
    with torch.no_grad():
        for b, p in enumerate(prompts):
            seq = torch.tensor([p + gen.tokens[b]], device=device)
            assert model(seq[:, :-1]).keep[0].tolist() == gen.keep[b]  # step-wise = batched decisions
            forced = model(seq, keep=torch.tensor([gen.keep[b] + [False]], device=device)).logits[0]
            n = len(gen.tokens[b])
            torch.testing.assert_close(gen.logits[b, :n], forced[len(p) - 1:len(p) - 1 + n], atol=atol, rtol=atol)
    return gen


@pytest.fixture
def fresh_dynamo():
    """dynamo with no compiled code and zeroed counters (graphs, breaks, recompiles), and reset again after."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()


WRAP_TRITON_REFUSES = "wrap_triton only works on functions annotated"  # (torch 2.11's, of the interpreter's kernels)


def _fresh_interpreter(argv: list[str], timeout: int, **env):
    """``python ARGV`` in a fresh interpreter at the repository's root (one OpenMP thread, ``env`` added): its result."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, *argv], cwd=root, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), **env})


def _last_json_line(done):
    import json

    return json.loads(done.stdout.strip().splitlines()[-1])


def in_a_fresh_process(function: str, *args, timeout: int = 900):
    """``function(*args)`` (``"module:name"``; JSON arguments and result) run in a fresh interpreter: for a test that
    compiles in a thread other than the main one. torch 2.11 (the GPU image's) crashes a process that compiles in one
    thread and then in another (a segmentation fault in ``FakeTensorMode.__enter__``; torch 2.13 does not), which would
    take the other tests of the worker down with it."""
    import json

    module, name = function.split(":")
    code = f"import json, sys; from {module} import {name}; print(json.dumps({name}(*json.loads(sys.argv[1]))))"
    done = _fresh_interpreter(["-c", code, json.dumps(args)], timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return _last_json_line(done)


def interpreter_report(module: str, skip_on: str | None = None, timeout: int = 900) -> dict:
    """The JSON report (its last line) of ``python -m MODULE`` run in Triton's interpreter on CPU tensors: a
    subprocess, since the interpreter must be chosen before Triton is first imported. ``skip_on``: an error text
    that skips the test instead (a torch that refuses the interpreter's kernels)."""
    done = _fresh_interpreter(["-m", module], timeout, TRITON_INTERPRET="1")
    if done.returncode and skip_on and skip_on in done.stderr:
        pytest.skip("this torch's wrap_triton refuses the interpreter's kernels (torch 2.11, the GPU image's; on the "
                    "GPU they run compiled: the kit's exact stage)")
    assert done.returncode == 0, done.stderr[-3000:]
    return _last_json_line(done)
