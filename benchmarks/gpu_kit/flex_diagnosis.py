"""The flex diagnosis (issue 40): what makes FlexAttention's deep-attention kernel 30-60x slower than its
block sparsity allows, one cause at a time.

On one H100 (2026-11-26) the `flex` kernel took 2.42 ms per deep layer at T = 8192, r = 0.125, while dense
causal attention (cuDNN) took 0.21 ms and the BlockMask is 90 % sparse. Here the deep attention call alone
runs at that point (SmolLM2's deep attention: 9 query heads, 3 KV heads, head_dim 64; bf16; concepts evenly
spaced; the same q, k, v for every variant), timed by CUDA events (the median of ``--reps`` >= 20 calls after
warm-up) and by its device time in a CUDA graph of 10 calls (``graphed``: as the compiled forward, one CUDA graph,
runs it; events around one call also time its launch from the host, which for FlexAttention's compiled call was
about as long as its kernel on the H200, 2026-11-27), ranked by the CUDA-graph times, each variant checked against
the dense-mask reference:

| variant | what changes against `today` |
|---|---|
| `sdpa-causal` | dense causal SDPA (cuDNN / flash): the yardstick |
| `today` | FlexAttention as the backend called it before issue 40: compiled with ``dynamic=True``, the six-tensor ``mask_mod`` |
| `static` | compiled with ``dynamic=False`` |
| `ranges` | the ``mask_mod`` reading three precomputed int32 per query row (the backend's ``mask = "ranges"``) |
| `ranges-static` | both: what the `flex` backend runs today with ``dynamic = "static"`` |
| `mask-per-call` | `ranges-static` with the BlockMask built inside every call (a forward builds it once for all its deep layers) |
| `floor` | the same BlockMask, its partial blocks computed as full (``mask_mod`` True): the kernel's floor for this sparsity, not exact |
| `dense-causal` | FlexAttention with a causal BlockMask (should be within about 2x of `sdpa-causal`) |
| `repeat-kv` | `ranges-static` with K and V repeated to the 9 query heads instead of ``enable_gqa`` |
| `tiles-64` | `ranges-static` with ``kernel_options`` BLOCK_M = BLOCK_N = 64 |
| `blocks-64` | `ranges-static` over 64-slot blocks (``block = 64``) and 64 x 64 tiles: 17 % fewer pairs at 8k |
| `tiles-128-warps-8` | `ranges-static` with ``kernel_options`` BLOCK_M = BLOCK_N = 128, 8 warps, 2 stages |
| `rows-safe` | `ranges-static` with ``ROWS_GUARANTEED_SAFE`` (true of this rule: every row has a key) |
| `tma` | `ranges-static` with ``USE_TMA`` (Hopper's tensor memory accelerator; experimental in torch 2.11) |
| `cascade` | the `cascade` backend (dense kernels, merged by log-sum-exp) |
| `gathered-sdpa` | no FlexAttention: each query block's KV blocks (those the BlockMask visits, padded to the most any visits: a static width) gathered, then one SDPA call over all query blocks with the rule's mask over the gathered keys (the query heads of a KV head folded into the query rows: no K/V repeated); what a block-sparse kernel made of SDPA's masked kernel costs |

The report names the fastest exact FlexAttention variant (``closes_the_gap``) and the `flex` backend settings
that give it (``adopt``: ``mask``, ``dynamic``, ``block``, ``kernel_options``). Variants run in ``VARIANTS``' order (the
decisive ones first, not the table's) and the run stops starting new ones at ``--budget-s`` (60 s of device
time by default, each variant's compilation included; the one-time set-up before them, the reference and the
backend's BlockMask built twice, is not in it); the JSON is rewritten after every variant, so an interrupted
run keeps what it measured. The BlockMask is built as the backend builds it (``flex.build_block_mask``:
eagerly at 8k tokens); on 2026-11-27 its compiled build (``_compile=True``) took 55.7 s of the 60 and was
compiled again for every variant's new ``mask_mod``, so one variant was measured.

    python -m benchmarks.gpu_kit.flex_diagnosis --out flex.json            # on a GPU
    python -m benchmarks.gpu_kit.flex_diagnosis --dry --out flex.json      # on the CPU: T = 128, fp32, eager, a check

``--dry`` runs every variant on the CPU, FlexAttention eagerly (no compile), at T = 128 in float32, timed by
the host clock: it checks that each variant builds, runs and is exact, not how fast it is. The speed stage
runs it (``in_stage``) after its benchmark suites, with what they left (``DIAGNOSIS_SHARE`` of its budget at
least).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
GPU_T, DRY_T, RATIO = 8192, 128, 0.125
BUDGET_S = 60.0  # the variants' budget (the one-time set-up before them is not in it)
STARTUP_S = 10.0  # the process's start (torch, the reference, the BlockMask), before the variants' budget starts
# decisive first (a budget that runs out cuts the least; each FlexAttention variant compiles anew, 2.6 s static,
# 11 s with symbolic shapes on the H200): the yardstick, what the compiled forward runs (`ranges` with static
# shapes: `--compile model` compiles the whole forward static), the variant without FlexAttention, the kernel's
# floor for this sparsity, the tiles; then the dense kernels' path, the eager backend's default (`ranges`,
# symbolic shapes on CUDA), FlexAttention on a dense mask, the old mask, the rest
VARIANTS = ("sdpa-causal", "ranges-static", "gathered-sdpa", "floor", "blocks-64", "tiles-128-warps-8", "cascade",
            "ranges", "dense-causal", "tiles-64", "today", "static", "rows-safe", "tma", "repeat-kv", "mask-per-call")
GRAPH_CALLS = 10  # calls of a variant captured in one CUDA graph (``graphed``)
FLEX_SETTINGS = {  # the `flex` backend's options that reproduce a variant (what ``adopt`` names)
    "today": {"mask": "rule", "dynamic": "dynamic"}, "static": {"mask": "rule", "dynamic": "static"},
    "ranges": {"mask": "ranges", "dynamic": "dynamic"}, "ranges-static": {"mask": "ranges", "dynamic": "static"},
    "mask-per-call": {"mask": "ranges", "dynamic": "static"},
    "tiles-64": {"mask": "ranges", "dynamic": "static", "kernel_options": {"BLOCK_M": 64, "BLOCK_N": 64}},
    "blocks-64": {"mask": "ranges", "dynamic": "static", "block": 64, "kernel_options": {"BLOCK_M": 64, "BLOCK_N": 64}},
    "tiles-128-warps-8": {"mask": "ranges", "dynamic": "static",
                          "kernel_options": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}},
    "rows-safe": {"mask": "ranges", "dynamic": "static", "kernel_options": {"ROWS_GUARANTEED_SAFE": True}},
    "tma": {"mask": "ranges", "dynamic": "static", "kernel_options": {"USE_TMA": True}},
}
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # relative L2 error against the dense-mask reference


def block_counts(block_mask, block: int, L: int, needed: float | None = None) -> dict:
    """Partial and full KV blocks per query block of a BlockMask, against causal attention's; with ``needed``
    (the pairs the rule allows), the pairs its blocks compute over those (``computed_over_needed``: the
    kernel's work over the ideal's at this block size)."""
    q_blocks = -(-L // block)
    partial = float(block_mask.kv_num_blocks.float().mean())
    full = float(block_mask.full_kv_num_blocks.float().mean()) if block_mask.full_kv_num_blocks is not None else 0.0
    causal = (q_blocks + 1) / 2
    counts = {"block": block, "q_blocks": q_blocks, "partial_per_q_block": round(partial, 2),
              "full_per_q_block": round(full, 2), "causal_per_q_block": round(causal, 2),
              "sparsity": round(1 - (partial + full) / q_blocks, 4)}
    if needed:
        counts["computed_over_needed"] = round((partial + full) * q_blocks * block * block / needed, 3)
    return counts


def gathered_blocks(block_mask, allowed, block: int, group: int, dtype):
    """For ``gathered-sdpa``: per query block, the KV blocks ``block_mask`` visits (partial, then full), padded to the
    most any visits (a static width W): their indices [nq, W], and the rule over the gathered keys (``allowed`` [1,
    L, L], the dense one-pass mask) as SDPA's additive mask [nq, 1, group x block, W x block], repeated for the
    ``group`` query heads of a KV head folded into the query rows (the padding masked out). Built once, as a
    forward would build it once for its deep layers."""
    import torch

    parts = [(block_mask.kv_num_blocks[0, 0], block_mask.kv_indices[0, 0])]
    if block_mask.full_kv_num_blocks is not None:
        parts.append((block_mask.full_kv_num_blocks[0, 0], block_mask.full_kv_indices[0, 0]))
    nq = parts[0][0].shape[0]
    lists = [torch.cat([indices[j, : int(counts[j])] for counts, indices in parts]) for j in range(nq)]
    width = max(len(blocks) for blocks in lists)
    idx = torch.zeros(nq, width, dtype=torch.long, device=allowed.device)
    used = torch.zeros(nq, width, dtype=torch.bool, device=allowed.device)
    for j, blocks in enumerate(lists):
        idx[j, : len(blocks)], used[j, : len(blocks)] = blocks, True
    L = allowed.shape[-1]
    rule = allowed[0].view(nq, block, L // block, block)[torch.arange(nq, device=idx.device)[:, None], :, idx]
    rule = (rule & used[:, :, None, None]).permute(0, 2, 1, 3).reshape(nq, 1, block, width * block)
    additive = torch.zeros(rule.shape, dtype=dtype, device=rule.device).masked_fill_(~rule, float("-inf"))
    return idx, additive.repeat(1, 1, group, 1)


def gathered_attention(q, k, v, scale: float, idx, mask, block: int):
    """Attention [1, H, L, hd] of each query block over its gathered KV blocks (:func:`gathered_blocks`): one SDPA
    call, batch = query blocks, heads = KV heads, each KV head's query heads stacked in its query rows."""
    import torch.nn.functional as F

    _, H, L, d = q.shape
    Hk, (nq, width) = k.shape[1], idx.shape
    group = H // Hk
    qb = q[0].view(Hk, group, nq, block, d).permute(2, 0, 1, 3, 4).reshape(nq, Hk, group * block, d)
    kb, vb = (t[0].view(Hk, L // block, block, d)[:, idx].reshape(Hk, nq, width * block, d).transpose(0, 1)
              for t in (k, v))
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)  # [nq, Hk, group x block, d]
    return out.view(nq, Hk, group, block, d).permute(1, 2, 0, 3, 4).reshape(1, H, L, d)


def build(name: str, layout, q, k, v, scale: float, dry: bool):
    """The call a variant times (``fn() -> [B, L, H, hd]`` or [B, H, L, hd]), and whether it must be exact."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    from concept.attention import sdpa
    from concept_plugins.attention.cascade import CascadeBackend
    from concept_plugins.attention.flex import FlexConfig, FlexPattern, build_block_mask

    compile_ = not dry
    L = layout.length
    if name == "sdpa-causal":
        return (lambda: sdpa(q, k, v, scale, is_causal=True)), False
    if name == "cascade":
        plan = CascadeBackend().plan(layout)
        return (lambda: plan(q, k, v, scale)), True
    if name == "gathered-sdpa":
        from concept.packing import allowed
        block = 128
        block_mask = FlexPattern(layout, FlexConfig(compile=compile_, block=block)).block_mask
        idx, mask = gathered_blocks(block_mask, allowed(layout.meta, layout.meta), block, q.shape[1] // k.shape[1],
                                    q.dtype)

        def fn():
            return gathered_attention(q, k, v, scale, idx, mask, block)
        fn.details = {"gathered_width": idx.shape[1], "pairs_computed": idx.numel() * block * block}
        return fn, True
    if name == "dense-causal":
        causal = build_block_mask(lambda b, h, i, j: j <= i, 1, L, q.device, 128, compile_)
        flex = torch.compile(flex_attention, dynamic=False) if compile_ else flex_attention
        return (lambda: flex(q, k, v, block_mask=causal, scale=scale, enable_gqa=True)), False
    settings = dict(FLEX_SETTINGS.get(name, FLEX_SETTINGS["ranges-static"]))
    config = FlexConfig(compile=compile_, **settings)
    if name == "mask-per-call":
        return (lambda: FlexPattern(layout, config)(q, k, v, scale)), True
    plan = FlexPattern(layout, config)
    if name == "repeat-kv":
        k_full, v_full = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        return (lambda: plan(q, k_full, v_full, scale)), True
    if name == "floor":
        bm = plan.block_mask
        plan.block_mask = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                                   bm.full_kv_indices, BLOCK_SIZE=bm.BLOCK_SIZE,
                                                   mask_mod=lambda b, h, i, j: i >= 0)
        return (lambda: plan(q, k, v, scale)), False
    return (lambda: plan(q, k, v, scale)), True


def timed(fn, device, reps: int, warmup: int = 3) -> dict:
    """The first call (compiles included), ``warmup`` more calls, then ``reps`` calls: the median and spread in
    ms (CUDA events on a GPU, the host clock on the CPU)."""
    import torch

    cuda = device.type == "cuda"
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize(device)
    first_s = time.perf_counter() - start
    for _ in range(warmup):
        fn()
    spans = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            spans.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            spans.append(1e3 * (time.perf_counter() - t))
    return {"ms": statistics.median(spans), "spread_ms": [min(spans), max(spans)], "reps": reps,
            "first_call_s": round(first_s, 3)}, out


def graphed(fn, device, reps: int, calls: int = None) -> dict:
    """The variant's device time a call as the compiled forward runs it, in a CUDA graph (under ``--compile model``
    a no-grad forward is one: no host between its kernels): ``calls`` calls captured once, after two on a side
    stream (as ``torch.cuda.graph`` asks), the graph replayed ``reps`` times between CUDA events; the median replay
    over ``calls``. A single call timed by events (``ms``) also waits for its launch from the host: FlexAttention's
    compiled call has some 0.2 ms of host work (its guards and wrappers) around a kernel of about as long (the
    H200, 2026-11-27: 0.367 ms by events, 0.17 ms of device time), SDPA's eager call almost none, so events rank
    variants by their host time too. ``graph_failed`` (and no ``graph_ms``) where a call cannot be captured (a host
    sync in it)."""
    import torch

    calls = calls or GRAPH_CALLS
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        spans = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize(device)
            spans.append(a.elapsed_time(b) / calls)
        del graph
    except Exception as exc:  # a variant that cannot be captured keeps its event time
        try:
            torch.cuda.synchronize(device)
        except Exception:  # (a capture that failed may leave its error to the next call: not this row's event time)
            pass
        return {"graph_failed": f"{type(exc).__name__}: {exc}"[:300]}
    return {"graph_ms": statistics.median(spans), "graph_spread_ms": [min(spans), max(spans)], "graph_calls": calls}


def timing_key(rows) -> str:
    """What the rows are compared by: ``graph_ms`` (device time in a CUDA graph, :func:`graphed`) where every one
    of them has it, else ``ms`` (CUDA events around a call; the host clock on a CPU)."""
    rows = list(rows)
    return "graph_ms" if rows and all("graph_ms" in r for r in rows) else "ms"


def against_dense(row: dict, dense: dict, ideal: float) -> dict:
    """A variant's speed-up over dense causal SDPA (``dense``: the `sdpa-causal` row) and its fraction of the ideal,
    by their device times in a CUDA graph where both have one (:func:`timing_key`), else by their event times."""
    key = timing_key((dense, row))
    speedup = dense[key] / row[key]
    return {"speedup_vs_dense": speedup, "fraction_of_ideal": speedup / ideal, "compared_by": key}


def timer_text(found: dict) -> str:
    """How a concluded variant (``fastest_exact``, ``closes_the_gap``) was timed, for a sentence after its ms."""
    return " in a CUDA graph" if found.get("timed_by") == "graph_ms" else ""


def device_busy(fn, device) -> dict:
    """Device-busy time of one call, where the project has a profiler helper (``concept.profiling``, issue 39):
    the seam for the common way of reporting it; nothing otherwise."""
    try:
        from concept.profiling import profile_call
    except ImportError:
        return {}
    try:
        prof = profile_call(fn, device)
    except Exception as exc:  # a profiler problem must not lose the timings
        return {"device_busy_error": f"{type(exc).__name__}: {exc}"[:200]}
    return {k: prof[k] for k in ("device_busy_s", "kernel_launches") if k in prof}


def relative_error(out, ref, layout) -> float:
    real = layout.meta.valid
    if out.shape[1] != ref.shape[1]:  # [B, H, L, hd] -> [B, L, H, hd]
        out = out.transpose(1, 2)
    a, b = out.float()[real], ref.float()[real]
    return float((a - b).norm() / b.norm())


def diagnose(dry: bool, out_path: Path | None, budget_s: float = BUDGET_S, reps: int = 25,
             variants: tuple = VARIANTS) -> dict:
    import torch

    from concept.flops import deep_pairs, evenly_spaced_keep
    from concept.packing import pack
    from concept_plugins.attention.flex import FlexConfig, FlexPattern
    from concept_plugins.attention.sdpa import DenseMaskPattern

    set_up = time.monotonic()
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    T = DRY_T if dry else GPU_T
    reps = 2 if dry else max(20, reps)
    keep = evenly_spaced_keep(T, RATIO)[None].to(device)
    layout = pack(keep, torch.ones_like(keep))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, T, HEAD_DIM, generator=g).to(device, dtype)
    k, v = (torch.randn(1, KV_HEADS, T, HEAD_DIM, generator=g).to(device, dtype) for _ in range(2))
    scale = HEAD_DIM ** -0.5
    needed = deep_pairs(keep[0].cpu())
    ideal = (T * (T + 1) / 2) / needed
    with torch.no_grad():
        reference = DenseMaskPattern(layout)(q, k, v, scale)
        builds = []
        for _ in range(2):  # the backend's build (flex.build_block_mask: eager at this length), first and again
            start = time.perf_counter()
            block_mask = FlexPattern(layout, FlexConfig(compile=not dry)).block_mask
            if not dry:
                torch.cuda.synchronize(device)
            builds.append(time.perf_counter() - start)
    report = {"dry": dry, "device": str(device), "gpu": torch.cuda.get_device_name(0) if not dry else None,
              "torch": torch.__version__, "T": T, "ratio": RATIO, "dtype": str(dtype).removeprefix("torch."),
              "heads": [HEADS, KV_HEADS, HEAD_DIM], "ideal_speedup": ideal,
              "block_mask": {**block_counts(block_mask, 128, layout.length, needed),
                             "first_build_s": round(builds[0], 3), "build_s": round(builds[1], 4)},
              "block_mask_64": block_counts(FlexPattern(layout, FlexConfig(compile=not dry, block=64)).block_mask, 64,
                                            layout.length, needed),
              "timer": "host clock" if dry else "cuda events; each variant's device time in a CUDA graph too",
              "budget_s": budget_s, "variants": [], "skipped": []}
    tolerance = TOLERANCE[report["dtype"]]
    dense = None
    begin = time.monotonic()  # the variants' budget: the one-time set-up above is not in it
    report["setup_s"] = round(begin - set_up, 1)
    for name in variants:
        if time.monotonic() - begin > budget_s:
            report["skipped"].append({"variant": name, "reason": f"the diagnosis's budget ({budget_s:.0f} s) ran out"})
            continue
        row = {"variant": name}
        try:
            with torch.no_grad():
                fn, must_be_exact = build(name, layout, q, k, v, scale, dry)
                timing, out = timed(fn, device, reps, warmup=0 if dry else 3)
                if not dry:  # its device time in a CUDA graph, as the compiled forward runs it
                    timing.update(graphed(fn, device, reps))
            row.update(timing)
            row.update(getattr(fn, "details", {}))
            err = relative_error(out, reference, layout)
            row.update(error=err, exact=err <= tolerance if must_be_exact else None)
            if name == "sdpa-causal":
                dense = row
            if not dry and name in ("sdpa-causal", "today", "ranges-static", "cascade"):
                with torch.no_grad():
                    row.update(device_busy(fn, device))
        except Exception as exc:  # a variant torch refuses here is a finding, not a failed diagnosis
            row["failed"] = f"{type(exc).__name__}: {exc}"[:400]
        if dense and "ms" in row:
            row.update(against_dense(row, dense, ideal))
        report["variants"].append(row)
        report["seconds"] = round(time.monotonic() - begin, 1)
        if out_path is not None:
            write(out_path, report)
    report.update(conclude(report))
    if out_path is not None:
        write(out_path, report)
    return report


def conclude(report: dict) -> dict:
    """The fastest exact FlexAttention variant, how it compares with `today`, dense and the ideal, and the
    backend settings that give it."""
    rows = {r["variant"]: r for r in report["variants"] if "ms" in r}
    exact = [r for r in rows.values() if r.get("exact")]
    key = timing_key(exact)  # (device time in a CUDA graph where every exact variant has it)
    fastest = min(exact, key=lambda r: r[key]) if exact else None
    fastest_exact = fastest and {"variant": fastest["variant"], "ms": fastest[key], "timed_by": key,
                                 "speedup_vs_dense": fastest.get("speedup_vs_dense")}
    flex = [r for name, r in rows.items() if name in FLEX_SETTINGS and r.get("exact")]
    if not flex:
        return {"closes_the_gap": None, "adopt": None, "fastest_exact": fastest_exact, "ranked_by": key}
    key = timing_key(flex)
    best = min(flex, key=lambda r: r[key])
    today = rows.get("today")
    against_today = timing_key((today, best)) if today else None
    found = {"variant": best["variant"], "ms": best[key], "timed_by": key,
             "speedup_vs_dense": best.get("speedup_vs_dense"), "fraction_of_ideal": best.get("fraction_of_ideal"),
             "times_faster_than_today": today[against_today] / best[against_today] if today else None,
             "meets_the_target": (best.get("speedup_vs_dense") or 0) >= 5.0}
    return {"closes_the_gap": found, "adopt": FLEX_SETTINGS[best["variant"]], "fastest_exact": fastest_exact,
            "ranked_by": key}


def write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=float) + "\n")
    tmp.replace(path)


def markdown(report: dict) -> str:
    """The diagnosis as a table for docs/benchmarks.md."""
    bm = report.get("block_mask", {})
    lines = [f"Flex diagnosis (`benchmarks/gpu_kit/flex_diagnosis.py`): deep attention alone at T = {report['T']}, "
             f"r = {report['ratio']}, {report['dtype']}, heads {report['heads']}, {report['timer']}; BlockMask "
             f"{bm.get('partial_per_q_block')} partial + {bm.get('full_per_q_block')} full KV blocks per query block "
             f"(causal: {bm.get('causal_per_q_block')}); ideal {report['ideal_speedup']:.2f}x dense.", "",
             "Each variant's ms by CUDA events around one call (its host launch included), and its device time a call in "
             "a CUDA graph of calls (no host between kernels, as the compiled forward runs it: `graphed`); the speed-up "
             "over dense compares the CUDA-graph times where both have one.", "",
             "| variant | ms | ms in a CUDA graph | speed-up over dense | of ideal | exact (rel. error) | first call s |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for r in report["variants"]:
        if "failed" in r:
            lines.append(f"| `{r['variant']}` | – | – | – | – | failed: {r['failed'][:120]} | – |")
            continue
        exact = "–" if r.get("exact") is None else ("yes" if r["exact"] else "**no**")
        su, fr = r.get("speedup_vs_dense"), r.get("fraction_of_ideal")
        graph = f"{r['graph_ms']:.3f}" if "graph_ms" in r else ("failed" if "graph_failed" in r else "–")
        lines.append(f"| `{r['variant']}` | {r['ms']:.3f} | {graph} | {'–' if su is None else f'{su:.2f}x'} | "
                     f"{'–' if fr is None else f'{100 * fr:.0f}%'} | {exact} ({r['error']:.1e}) | {r['first_call_s']:.1f} |")
    for s in report.get("skipped", []):
        lines.append(f"| `{s['variant']}` | skipped: {s['reason']} | | | | | |")
    best = report.get("closes_the_gap")
    if best:
        lines += ["", f"Fastest exact FlexAttention variant: `{best['variant']}` ({best['ms']:.3f} ms{timer_text(best)}"
                  + (f", {best['speedup_vs_dense']:.2f}x dense" if best.get("speedup_vs_dense") else "")
                  + (f", {best['times_faster_than_today']:.1f}x `today`" if best.get("times_faster_than_today") else "")
                  + f"); the `flex` settings that give it: `{json.dumps(report['adopt'])}`."]
    fastest = report.get("fastest_exact")
    if fastest and (not best or fastest["variant"] != best["variant"]):
        lines += ["", f"Fastest exact deep attention of all the variants: `{fastest['variant']}` "
                      f"({fastest['ms']:.3f} ms{timer_text(fastest)}"
                  + (f", {fastest['speedup_vs_dense']:.2f}x dense" if fastest.get("speedup_vs_dense") else "") + ")."]
    return "\n".join(lines)


def in_stage(stage) -> dict:
    """The speed stage's hook, after its suites: the diagnosis in its own process (a hung compile cannot take
    the stage with it), with what is left of the stage's budget (at most BUDGET_S; its start-up, the reference
    and the BlockMask's build come on top, ``STARTUP_S``). Returns its report (or why there is none)."""
    from .common import kit_env, python_cmd, read_json, run_logged

    out = stage.work / "flex_diagnosis.json"
    out.unlink(missing_ok=True)
    budget = min(BUDGET_S, stage.remaining() - STARTUP_S)
    if budget < 10:
        stage.skip("the flex diagnosis", f"{stage.remaining():.0f} s left in the stage")
        return {}
    cmd = python_cmd("-m", "benchmarks.gpu_kit.flex_diagnosis", "--out", str(out), "--budget-s", f"{budget:.0f}",
                     *(["--dry"] if stage.dry else []))
    run = run_logged(stage, cmd, env=kit_env(stage.work, stage.dry),
                     deadline=time.monotonic() + STARTUP_S + budget + 10)
    report = read_json(out) or {}
    if run["returncode"] and not report.get("variants"):
        stage.problem(f"the flex diagnosis failed (exit code {run['returncode']}; see the log)")
    for row in report.get("variants", []):
        if row.get("exact") is False:
            stage.problem(f"flex diagnosis: variant {row['variant']} is not exact (relative error {row['error']:.1e})")
    if report.get("closes_the_gap"):
        best = report["closes_the_gap"]
        stage.say(f"flex diagnosis: fastest exact variant {best['variant']} ({best['ms']:.3f} ms{timer_text(best)})")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_kit.flex_diagnosis", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON report (rewritten after every variant)")
    p.add_argument("--dry", action="store_true", help="on the CPU, T = 128, eagerly: a check, not a measurement")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop starting variants after this many seconds")
    p.add_argument("--reps", type=int, default=25, help="timed calls per variant (at least 20 on a GPU)")
    args = p.parse_args(argv)
    import torch

    if not args.dry and not torch.cuda.is_available():
        print("error: no CUDA device: pass --dry to check the diagnosis on the CPU", file=sys.stderr)
        return 2
    if args.dry:
        torch.set_num_threads(1)
    report = diagnose(args.dry, args.out, args.budget_s, args.reps)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
