"""A mutation check you can re-run (``make mutate``): small deliberate bugs in the model, the packing rule,
the attention backends, the position schemes, decoding, checkpointing and the filesystem rule, each
applied to the source alone, with the tests that must catch it. Every mutation must be caught (its tests
fail); a mutation whose text no longer matches the source is reported as stale (update it here).

    .venv/bin/python -m tests.mutate                 # all, a table on stdout, exit 1 unless every one is caught
    .venv/bin/python -m tests.mutate --only packing  # the mutations whose name contains "packing"
    .venv/bin/python -m tests.mutate --list

The source files are changed in place, one mutation at a time, and always restored (also after Ctrl-C);
a copy of each file being mutated sits in ``.mutate-backup/`` while it is, so that a run killed with
``kill -9`` is undone by the next run before it starts.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BACKUP = REPO / ".mutate-backup"
BEGIN, END = "<!-- mutate:begin -->", "<!-- mutate:end -->"


@dataclass
class Mutation:
    name: str
    file: str
    old: str  # must occur exactly once in the file
    new: str
    tests: list[str]  # pytest arguments that must fail once the mutation is in place


EQUIVALENCE = "tests/test_equivalence.py"
MUTATIONS = [
    # the one-pass rule (concept/packing.py) and the layout every backend reads
    Mutation("packing: tails see every earlier element, concepts their segment's tails", "concept/packing.py",
             "ok = earlier & (keep_j | (~keep_i & same_seg)) & same_doc & k.valid[:, None, :]",
             "ok = earlier & (keep_j | same_seg | ~keep_i) & same_doc & k.valid[:, None, :]",
             [EQUIVALENCE, "-k", "one_pass_matches_naive and sdpa"]),
    Mutation("packing: documents packed in a row see each other", "concept/packing.py",
             "ok = earlier & (keep_j | (~keep_i & same_seg)) & same_doc & k.valid[:, None, :]",
             "ok = earlier & (keep_j | (~keep_i & same_seg)) & k.valid[:, None, :]",
             [EQUIVALENCE, "-k", "packed_documents and sdpa"]),
    Mutation("packing: concept ranks do not restart at a new document", "concept/packing.py",
             "concept_rank = index - torch.cummax(index * first, dim=1).values",
             "concept_rank = index.expand_as(first)",
             ["tests/test_positions.py"]),
    Mutation("packing: the deep block reads its tail from the layout's tail start, not its rank", "concept/packing.py",
             "src = torch.where(is_concept, slot, C + (slot - concepts).clamp(max=max(T - 1, 0)))",
             "src = torch.where(is_concept, slot, C + slot.clamp(max=max(T - 1, 0)))",
             ["tests/test_deep_block.py"]),
    Mutation("deep block: a prefill's cache keeps the block's records by the layout's slots",
             "concept/streaming/decoding.py",
             "self.cache.adopt(valid, out.layout, out.deep_sequence)",
             "self.cache.adopt(valid, out.layout)",
             ["tests/test_deep_block.py", "-k", "prefill"]),
    # the backends' own copies of the rule
    Mutation("flex: a tail sees every earlier tail", "plugins/attention/flex.py",
             "tail_lo = torch.where(is_concept, slot + 1, first)",
             "tail_lo = torch.where(is_concept, slot + 1, torch.zeros_like(slot) + boundary)",
             [EQUIVALENCE, "-k", "one_pass_matches_naive and flex"]),
    Mutation("static budget: auto gives a policy without a tracker the tracked rule", "concept/streaming/budget.py",
             "return TRACKED if tracks_documents(policy) else UNTRACKED", "return TRACKED",
             ["tests/test_default_budget.py", "-k", "without_a_per_document_tracker"]),
    Mutation("ratio controller: its quantile without the interpolation weight", "concept/streaming/ratio.py",
             "return values.lerp_(ordered.gather(-1, ranks.ceil_().long()), weights).squeeze_(-1)",
             "return values.squeeze_(-1)",
             ["tests/test_torch_versions.py", "-k", "quantile"]),
    Mutation("torch versions: a region asks torch 2.11 for the reuse limit it lacks", "concept/compiled.py",
             'limit = {"max_reuse_entries": REGION_REUSE} if "max_reuse_entries" in inspect.signature(mark).parameters else {}',
             'limit = {"max_reuse_entries": REGION_REUSE}',
             ["tests/test_torch_versions.py", "-k", "reuse_limit"]),
    Mutation("torch versions: the layer regions on for every torch", "concept/compiled.py",
             "return setting != \"0\" if setting else torch_release() >= REGIONS_FROM",
             "return setting != \"0\"",
             ["tests/test_torch_versions.py", "-k", "tested_in"]),
    Mutation("traced adapters: the autograd.Function traced into the graph", "concept/lora.py",
             "matmuls = lora_matmuls if torch.compiler.is_compiling() else LoraMatmuls.apply",
             "matmuls = LoraMatmuls.apply",
             ["tests/test_fused_lora.py", "-k", "traced_the"]),
    Mutation("traced adapters: the scale multiplies the [N, out] product, not the adapter", "concept/lora.py",
             "FOLD_SCALE = True", "FOLD_SCALE = False",
             ["tests/test_fused_lora.py", "-k", "power_of_two"]),
    Mutation("CUDA graphs: accumulated gradients taken from the graphs' memory (no .grad buffers of their own)",
             "concept/train_step.py",
             "self.own_grads = config.grad_accum > 1 and gradients_in_graph_memory(model, device.type)",
             "self.own_grads = False",
             ["tests/test_graph_memory.py", "-k", "accumulated and equals_eager"]),
    Mutation("CUDA graphs: an evaluation-mode forward with gradients in the graphs' memory", "concept/compiled.py",
             "return NO_GRAD_CUDA_GRAPHS if not torch.is_grad_enabled() else self.eager.__self__.training",
             "return NO_GRAD_CUDA_GRAPHS if not torch.is_grad_enabled() else True",
             ["tests/test_compile_model.py", "-k", "cuda_graphs"]),
    Mutation("inference tensors: a tensor's version read where it keeps none", "concept/lazy.py",
             "    return -1 if t.is_inference() else t._version", "    return t._version",
             ["tests/test_adapter_casts.py", "-k", "inference_mode"]),
    Mutation("CUDA graphs: a no-grad forward's outputs returned in the graphs' memory", "concept/compiled.py",
             'return copied_out(out) if kind == "no-grad graphs" else out', "return out",
             ["tests/test_graph_memory.py", "-k", "keep_their_outputs"]),
    Mutation("adapters cast before the graph: B's folded scale applied to its products too", "concept/lora.py",
             "left.append(1.0 if fold else scaling)", "left.append(scaling)",
             ["tests/test_cast_outside.py", "-k", "graphs_cast_no_adapter"]),
    Mutation("adapters cast before the graph: their gradients cast back without the scale", "concept/lora.py",
             "[ctx.scales[i] for i in present], scale_first=True", "[1.0 for i in present], scale_first=True",
             ["tests/test_cast_outside.py", "-k", "bit_for_bit"]),
    Mutation("adapters cast before the graph: each write a new version of the buffers", "concept/lora.py",
             "kept.enter_context(torch.autograd._unsafe_preserve_version_counter(b))", "pass",
             ["tests/test_cast_outside.py", "-k", "two_forwards"]),
    Mutation("flops: a static layout's tail fusion counted over the tail tokens only", "concept/flops.py",
             "deep += fusion * (T if static_slots is not None else T - int(keep.sum()))",
             "deep += fusion * (T - int(keep.sum()))",
             ["tests/test_flops_measured.py", "-k", "bridge"]),
    Mutation("sync stacks: the dispatch counter's frames read outermost first", "concept/profiling.py",
             "python = [_frame_name(f) for f in reversed(stack)]", "python = [_frame_name(f) for f in stack]",
             ["tests/test_profiling.py", "-k", "dispatch_counter"]),
    Mutation("max gap: auto ignores the target ratio", "concept/streaming/gap.py",
             "return max(1, math.ceil(GAP_PER_SPACING / target - 1e-9))", "return 16",
             ["tests/test_max_gap.py"]),
    Mutation("cascade: the tail's parts merged without their log-sum-exps", "plugins/attention/cascade.py",
             "return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse",
             "return (out_a + out_b * torch.isfinite(lse_b)[..., None]) / (1 + torch.isfinite(lse_b)[..., None]), lse",
             ["tests/test_cascade.py", "-k", "tiles_equal_the_dense_mask"]),
    Mutation("cascade: the output handed to the CUDA backward stored [n, H, M, hd] (the H100's bf16 bug)",
             "plugins/attention/cascade.py", "return x.transpose(1, 2).contiguous().transpose(1, 2)",
             "return x.contiguous()", ["tests/test_uninitialised_memory.py", "-k", "cascade-cuda"]),
    Mutation("chunked: a chunk's keys start at the chunk, not at its first segment", "plugins/attention/chunked.py",
             "first = min(first, a)", "first = a",
             [EQUIVALENCE, "-k", "one_pass_matches_naive and chunked"]),
    Mutation("xformers shared prefix: partials merged without their log-sum-exps", "plugins/attention/shared_prefix.py",
             "part_out.to(out.dtype) * torch.exp(part_lse - new)[..., None]", "part_out.to(out.dtype) * 0.5",
             ["tests/test_xformers.py", "-k", "shared_layout_model_matches_naive"]),
    # position schemes
    Mutation("per-type: concepts numbered from 1", "plugins/position_schemes/per_type.py",
             "return rank + self.config.offset", "return rank + self.config.offset + 1",
             [EQUIVALENCE, "-k", "one_pass_matches_naive and per-type and sdpa"]),
    Mutation("compact: the stacks' rules swapped", "plugins/position_schemes/compact.py",
             'return rank if stack == "middle" else pos', 'return pos if stack == "middle" else rank',
             [EQUIVALENCE, "-k", "fp64 and compact and sdpa"]),
    # the model
    Mutation("identity start: the shallow state left out of a concept's input", "concept/streaming/model.py",
             "return h + self.gate.to(e.dtype) * e", "return self.gate.to(e.dtype) * e",
             [EQUIVALENCE, "-k", "one_pass_matches_naive and sdpa and time"]),
    Mutation("identity-scaled: the embedding at its own scale, not the shallow state's", "concept/streaming/model.py",
             "e = e * (rms(h) / rms(e).clamp_min(1e-6)).to(e.dtype)", "e = e",
             ["tests/test_identity_fusion.py", "-k", "identity_scaled"]),
    Mutation("update fusion: the update reaches tails before a document's first concept", "plugins/tail_fusion/update.py",
             "return tail + update * has[..., None].to(tail.dtype)", "return tail + update",
             ["tests/test_identity_fusion.py", "-k", "fusion_one_pass_matches_naive and update"]),
    # the length policies' sequential rules, scanned on the host
    Mutation("host scan: padding advances a row's state", "concept/streaming/host_scan.py",
             "            if live[t]:\n                row[t], state = rule(state, *values)",
             "            k, state = rule(state, *values)\n            row[t] = k and live[t]",
             ["tests/test_host_scan.py", "tests/test_policies.py", "-k", "padding"]),
    Mutation("tracker allowance: a tie at the edge counted as a pass", "concept/streaming/host_scan.py",
             "return margin > 0 if strict else margin >= 0",
             "return margin >= 0",
             ["tests/test_host_scan.py"]),
    Mutation("tracker: the concept count is not reset at a document start", "concept/streaming/host_scan.py",
             "            if fresh is not None and fresh[t]:\n                state = init\n", "",
             ["tests/test_null_policy.py", "-k", "tracker"]),
    # the same rules as Triton kernels (run in the interpreter on CPU)
    Mutation("device scan: padding advances the open chunk", "concept/streaming/scan_kernels.py",
             "count = tl.where(live[u], tl.where(keep, 0, length), count)", "count = tl.where(keep, 0, length)",
             ["tests/test_device_scan.py", "-k", "host_scan"]),
    Mutation("device scan: the tracker's concept count is not reset at a document start",
             "concept/streaming/scan_kernels.py",
             "                run = tl.where(fresh[u], 0, run)\n                concepts = tl.where(fresh[u], 0, concepts)\n",
             "                run = tl.where(fresh[u], 0, run)\n", ["tests/test_device_scan.py", "-k", "host_scan"]),
    # decoding
    Mutation("decoding: the tail is kept when a concept is emitted", "concept/streaming/decoding.py",
             "    cache.deep.drop_tail(keep)\n", "",
             ["tests/test_decoding.py", "-k", "decode_logits_equal_teacher_forcing and sdpa"]),
    Mutation("decoding: concept ranks off by one", "concept/streaming/decoding.py",
             "rank = (num_concepts + s)[:, None]", "rank = (num_concepts + s + 1)[:, None]",
             ["tests/test_decoding.py", "-k", "decode_logits_equal_teacher_forcing and per-type and sdpa"]),
    Mutation("kv cache: a concept drops every row's tail", "concept/kv_cache.py",
             "self.valid &= ~(self.tail & rows[:, None])", "self.valid &= ~self.tail",
             ["tests/test_decoding.py", "-k", "batched_generation_equals_one_by_one"]),
    # checkpointing and resume
    Mutation("resume: the scheduler is not restored", "concept/checkpoint_state.py",
             'self.scheduler.load_state_dict(objects["scheduler"])', "pass",
             ["tests/test_training.py", "-k", "resume_reproduces"]),
    Mutation("resume: the optimizer state is not restored", "concept/checkpoint_state.py",
             "set_optimizer_state_dict(self.model, self.optimizer, objects[\"optimizer\"],",
             "(lambda *a, **k: None)(self.model, self.optimizer, objects[\"optimizer\"],",
             ["tests/test_training.py", "-k", "resume_reproduces"]),
    Mutation("resume: the data read from a cursor the checkpoint does not keep", "concept/training.py",
             "b = self.train_data.batch(index, self.config.batch)",
             "self.cursor = getattr(self, 'cursor', -1) + 1\n        b = self.train_data.batch(self.cursor, "
             "self.config.batch)",
             ["tests/test_training.py", "-k", "resume_reproduces"]),
    Mutation("resume: the ratio controller's state is not restored", "concept/streaming/objectives.py",
             "            self.pi.load_state_dict(state)", "            pass",
             ["tests/test_training.py", "-k", "resume_reproduces"]),
    # precision and the chunked CE
    Mutation("bf16: the frozen base left in fp32 (autocast casts it at every use)", "concept/training.py",
             "    store_frozen_base(model, dtype)  # bf16: cast once here, never inside a step\n", "",
             ["tests/test_bf16.py", "-k", "no_frozen_weight and dense"]),
    Mutation("chunked CE: the ignored targets counted", "concept/losses.py",
             "valid = target != IGNORE", "valid = target == target",
             ["tests/test_head_loss.py", "-k", "every_model_kind and dense"]),
    Mutation("compiled CE: the one-hot left out of the traced gradient", "concept/losses.py",
             "((logits - lse[:, None]).exp() - one_hot.to(logits.dtype)) * scale",
             "(logits - lse[:, None]).exp() * scale",
             ["tests/test_compiled_loss.py", "-k", "equal_the_eager"]),
    Mutation("compiled CE: the streaming model's loss left eager under --compile", "concept/streaming/model.py",
             "head_next_token_loss(states, head, labels, valid, doc, self.compiled_stacks)",
             "head_next_token_loss(states, head, labels, valid, doc)",
             ["tests/test_compile.py", "-k", "no_graph_break"]),
    # the code-only controls read the discrete id alone
    Mutation("code controls: the whole input perturbed, not only the code", "concept/streaming/emission.py",
             "        if isinstance(self.sampler, Mixes):  # e.g. `hidden-projection`, in training and at inference\n",
             "        h = h if perturb_codes is None else torch.zeros_like(h)\n"
             "        if isinstance(self.sampler, Mixes):  # e.g. `hidden-projection`, in training and at inference\n",
             ["tests/test_code_controls.py"]),
    # anti-collapse
    Mutation("revival: the idle counters are not restored on resume", "concept/codes.py",
             "self.idle = {name: [int(v) for v in idle] for name, idle in state[\"idle\"].items()}",
             "pass",
             ["tests/test_code_revival.py", "-k", "resumes_exactly"]),
    Mutation("revival: a used code revived too", "concept/codes.py",
             "torch.where(used > 0, torch.zeros_like(idle), idle + 1)", "idle + 1",
             ["tests/test_code_revival.py", "-k", "revived_every"]),
    Mutation("per-type quota: every type's <EOS> moved by the first type's bias", "concept/planner/model.py",
             "return self.value if self.value.dim() == 0 else self.value[i]",
             "return self.value if self.value.dim() == 0 else self.value[0]",
             ["tests/test_planner_executor.py", "-k", "per_type_quota_holds"]),
    # nothing written is lost
    Mutation("publish: the old folder removed before the new one is in place", "concept/fs.py",
             "    if exchange(new, dest):\n",
             "    if shutil.rmtree(dest) or not os.rename(new, dest):  # (both return None)\n        return\n"
             "    if exchange(new, dest):\n",
             ["tests/test_nothing_lost.py", "-k", "survives_faults"]),
]


def restore_leftovers() -> list[str]:
    """Put back files a killed run left mutated (their copies are in .mutate-backup/)."""
    restored = []
    if BACKUP.is_dir():
        for copy in BACKUP.rglob("*"):
            if copy.is_file():
                target = REPO / copy.relative_to(BACKUP)
                shutil.copy2(copy, target)
                restored.append(str(target.relative_to(REPO)))
        shutil.rmtree(BACKUP)
    return restored


def run_one(m: Mutation, timeout: int) -> dict:
    path = REPO / m.file
    source = path.read_text()
    if source.count(m.old) != 1:
        return {"name": m.name, "file": m.file, "result": "stale", "detail":
                f"the text to mutate occurs {source.count(m.old)} times in {m.file} (once expected)", "seconds": 0.0}
    backup = BACKUP / m.file
    backup.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, backup)
    start = time.perf_counter()
    try:
        path.write_text(source.replace(m.old, m.new))
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            code, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-1:]
        except subprocess.TimeoutExpired:
            code, tail = -1, [f"timed out after {timeout} s"]
    finally:
        path.write_text(source)
        backup.unlink()
    if code == 1:
        result = "caught"
    elif code == 0:
        result = "NOT CAUGHT"
    else:
        result = f"error (pytest exit {code})"  # 5: no test selected; 2-4: pytest could not run
    return {"name": m.name, "file": m.file, "result": result, "detail": tail[0] if tail else "",
            "tests": " ".join(m.tests), "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Apply each deliberate bug and check that the tests catch it.")
    parser.add_argument("--only", default="", help="only the mutations whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutation's tests")
    parser.add_argument("--write", type=Path, help=f"also put the table between {BEGIN} and {END} in this file")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name}  [{m.file}]  tests: {' '.join(m.tests)}")
        return 0
    for name in restore_leftovers():
        print(f"restored {name}, left mutated by an interrupted run", file=sys.stderr)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM restores like Ctrl-C
    rows = []
    for m in chosen:
        print(f"mutating: {m.name} ...", file=sys.stderr, flush=True)
        rows.append(run_one(m, args.timeout))
        print(f"  {rows[-1]['result']} ({rows[-1]['seconds']} s) {rows[-1]['detail']}", file=sys.stderr, flush=True)
    if BACKUP.is_dir() and not any(p.is_file() for p in BACKUP.rglob("*")):
        shutil.rmtree(BACKUP)  # every file restored: the empty folders go too
    caught = sum(r["result"] == "caught" for r in rows)
    table = "\n".join([f"`.venv/bin/python -m tests.mutate` ({time.strftime('%Y-%m-%d')}): {caught} of {len(rows)} "
                       f"mutations caught.", "", "| mutation | file | tests | result | seconds |",
                       "|---|---|---|---|---:|",
                       *(f"| {r['name']} | `{r['file']}` | `{r.get('tests', '')}` | {r['result']} | {r['seconds']} |"
                         for r in rows)])
    print(table)
    if args.write:
        write_block(args.write, table)
    print(f"\n{caught} of {len(rows)} mutations caught", file=sys.stderr)
    return 0 if caught == len(rows) else 1


def write_block(path: Path, block: str) -> None:
    from concept import fs

    try:
        fs.write_atomic(path, fs.replace_marked(path.read_text(), BEGIN, END, block))
    except ValueError as exc:
        raise SystemExit(f"{path} {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
