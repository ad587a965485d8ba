"""GPU readiness on the CPU: every tensor factory in ``concept/`` and ``plugins/`` builds its tensor on the
device of the data it meets (``device=``), or is a ``*_like``, or is a module's parameter or buffer (moved
by ``.to(device)``), or is on the host on purpose (the allowlist below, each with its reason). A factory
without ``device=`` in code that meets CUDA tensors either fails there ("expected all tensors to be on the
same device") or costs a host-to-device copy per call; on the CPU both go unnoticed, hence this test."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "rand", "randn", "randint",
             "randperm", "eye", "linspace", "logspace", "empty_strided", "tril_indices", "triu_indices", "range"}
REGISTERS = {"Parameter", "register_buffer", "register_parameter", "float", "int"}  # moved with the module, or a number

# (file, function): why its factories without device= are meant to be on the host
ALLOWED = {
    ("concept/conformance.py", "length_policy"): "plugins list --check: a tiny forward on the CPU, on its own random "
                                                  "inputs",
    ("concept/conformance.py", "sampler"): "plugins list --check: a tiny forward on the CPU, on its own random "
                                                  "inputs",
    ("concept/conformance.py", "vocabulary"): "plugins list --check: a tiny forward on the CPU, on its own random "
                                                  "inputs",
    ("concept/conformance.py", "position_scheme"): "plugins list --check: a tiny forward on the CPU, on its own random "
                                                  "inputs",
    ("concept/conformance.py", "attention"): "plugins list --check: a tiny forward on the CPU, on its own random "
                                                  "inputs",
    ("concept/conformance.py", "tail_fusion"): "plugins list --check: a tiny forward on the CPU, on its own random "
                                                  "inputs",
    ("concept/data.py", "PackedSequences._pack"): "the data order: drawn on the host, batches move later",
    ("concept/data.py", "PackedSequences.permutation"): "the data order: drawn on the host, batches move later",
    ("concept/streaming/diagnostics.py", "_control.shuffle"): "a CPU generator (the same draw on every device), "
                                                                 "then .to()",
    ("concept/streaming/diagnostics.py", "_control.random"): "a CPU generator (the same draw on every device), "
                                                                "then .to()",
    ("concept/streaming/diagnostics.py", "_code_control.codes_shuffled"): "a CPU generator (the same draw on every "
                                                                             "device), then .to()",
    ("concept/streaming/diagnostics.py", "ConceptEvaluation.result"): "an empty host-side id histogram and zero sums (no batch)",
    ("plugins/vocabularies/fsq.py", "FSQVocabulary.__init__"): "the fixed grid, registered as buffers (moved with "
                                                               "the module)",
    ("concept/planner/diagnostics.py", "random_plan"): "a CPU generator (the same draw on every device), then .to()",
    ("concept/planner/diagnostics.py", "_PlannedTotals.__init__"): "host-side id histograms of .cpu() values",
    ("concept/syncs.py", "upload"): "Python data staged on the host on purpose (pinned on CUDA), then copied to "
                                    "the device without a wait",
    ("concept/train_step.py", "StepRunner._on_its_way"): "pinned host memory that a step's logged values are "
                                                         "copied into (non-blocking) on CUDA, read later",
    ("concept/export.py", "_compare"): "the export check runs both models on the CPU, where they are loaded",
    ("concept/flops.py", "evenly_spaced_keep"): "FLOP counting: host-side arithmetic, no model data",
    ("concept/flops.py", "deep_keys"): "FLOP counting: host-side arithmetic, no model data",
    ("concept/generation.py", "_multitoken_loop"): "a streamer receives token ids on the host (transformers' "
                                                    "TextStreamer convention)",
    ("concept/planner/model.py", "Plan.from_rows"): "filled element by element on the host, moved once with .to()",
    ("concept/planner/model.py", "PlannerExecutorModel.__init__"): "registered as buffers (moved with the module)",
    ("concept/codes.py", "spherical_kmeans"): "k-means of queries brought to the host (.cpu()), a CPU generator",
    ("concept/codes.py", "CodeRevival._revive"): "CPU-generator draws at a revival step, in its declared host "
                                                 "sync (the same on every device and process); moved with .to()",
    ("concept/codes.py", "KMeansInit._initialise"): "a CPU generator's choice of ids, moved with .to()",
}


def factories_without_device(path: Path) -> list[tuple[str, str, int]]:
    """(function qualname, factory, line) of each ``torch.FACTORY(...)`` call without ``device=`` that is
    not a parameter / buffer being registered."""
    found = []

    def visit(node, stack, registered):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, stack + [child.name], False)
                continue
            here = registered
            if isinstance(child, ast.Call):
                name = child.func.attr if isinstance(child.func, ast.Attribute) else getattr(child.func, "id", "")
                here = registered or name in REGISTERS
                if (isinstance(child.func, ast.Attribute) and child.func.attr in FACTORIES
                        and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch"
                        and not any(k.arg == "device" for k in child.keywords) and not registered):
                    found.append((".".join(stack) or "<module>", child.func.attr, child.lineno))
            visit(child, stack, here)

    visit(ast.parse(path.read_text()), [], False)
    return found


def scan() -> dict[tuple[str, str], list[str]]:
    hits: dict[tuple[str, str], list[str]] = {}
    for folder in ("concept", "plugins"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for function, factory, line in factories_without_device(path):
                hits.setdefault((rel, function), []).append(f"{rel}:{line} torch.{factory}(...) in {function}")
    return hits


def test_every_tensor_factory_names_its_device():
    hits = scan()
    unexplained = [site for key, sites in hits.items() if key not in ALLOWED for site in sites]
    assert not unexplained, ("tensor factories without device= (pass the device of the data they meet, use a "
                             "*_like, or allowlist them here with the reason):\n" + "\n".join(unexplained))


def test_the_allowlist_has_no_stale_entries():
    hits = scan()
    stale = [f"{file}: {function}" for file, function in ALLOWED if (file, function) not in hits]
    assert not stale, "allowlisted functions that no longer build host tensors:\n" + "\n".join(stale)


def test_negative_control_a_missing_device_is_found(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import torch\nfrom torch import nn\n\n"
                      "class M(nn.Module):\n"
                      "    def __init__(self):\n"
                      "        super().__init__()\n"
                      "        self.w = nn.Parameter(torch.zeros(3))\n"
                      "        self.register_buffer('b', torch.ones(2))\n\n"
                      "    def forward(self, x):\n"
                      "        i = torch.arange(x.shape[0])\n"
                      "        j = torch.arange(x.shape[0], device=x.device)\n"
                      "        return x[i] + torch.zeros_like(x) + float(torch.tensor(1.0)) + x[j]\n")
    assert factories_without_device(source) == [("M.forward", "arange", 11)]
