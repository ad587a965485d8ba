"""What a lease says of the defaults that wait for a GPU (issue 39), from the stages' JSON (`report` tables it in
``docs/benchmarks.md``, "What the lease says of the defaults").

Each default below stays the cautious choice until a GPU has measured the other one; a verdict is "supported" only
where every piece of its evidence is in this lease's results and agrees, else it names what is missing or against.
It changes nothing itself: the session that reads it makes the change, with the lease's numbers in its commit.

- ``--compile`` (``off``; the candidate ``auto``: compiled on CUDA): every CUDA test of a compiled path passed in
  `exact` (ids with ``compile``: none failed, at least one ran), `setup`'s compiled training beat eager for the
  streaming and the dense model, and `speed`'s compiled 8k forward beat the eager one (the policy deciding on both
  sides where the eager row has it);
- ``--lora-kernel`` (``matmuls``; the candidate ``auto``: the Triton kernels where they run): the kernels' CUDA tests
  passed in `exact` (``tests/test_lora_triton.py``), `setup`'s compiled pair with them beat the pair with the
  matmuls, model for model, and in `speed`'s adapter-cost rows the kernels took less device time than the matmuls
  for every projection shape and row count;
- the deep attention: the flex diagnosis's fastest exact variant of all (a backend to build if it is not
  FlexAttention's) and the `flex` settings of its fastest FlexAttention variant (``adopt``), by the times it ranks by.
"""
from __future__ import annotations

import json

from . import flex_diagnosis


def _tests(exact: dict | None, matches) -> tuple[int, int]:
    """(passed, failed or errors) among `exact`'s tests whose id ``matches``."""
    tests = [t for t in ((exact or {}).get("result") or {}).get("tests", []) if t.get("id") and matches(t["id"])]
    return (sum(t["outcome"] == "passed" for t in tests),
            sum(t["outcome"] in ("failed", "error") for t in tests))


def _tests_evidence(exact: dict | None, what: str, matches) -> tuple[str | None, str | None]:
    """(evidence, problem) of `exact`'s tests of ``what``."""
    if not exact:
        return None, "no `exact` results"
    passed, failed = _tests(exact, matches)
    if failed:
        return None, f"{failed} CUDA test(s) of {what} failed in `exact`"
    if not passed:
        return None, f"no CUDA test of {what} ran in `exact`"
    return f"the {passed} CUDA test(s) of {what} passed in `exact`", None


def _faster(new: dict, old: dict, kinds, what: str) -> tuple[str | None, str | None]:
    """(evidence, problem): ``new``'s tokens/s above ``old``'s for every one of ``kinds``."""
    missing = [k for k in kinds if k not in new or k not in old]
    if missing:
        return None, f"`setup` did not measure {' and '.join(missing)} both ways ({what})"
    ratios = {k: new[k]["tokens_per_s"] / old[k]["tokens_per_s"] for k in kinds}
    said = ", ".join(f"{k} {r:.2f}x" for k, r in ratios.items())
    if min(ratios.values()) <= 1:
        return None, f"{what}: not faster for every model in `setup` ({said})"
    return f"{what}: faster in `setup` ({said})", None


# where each default is declared: the one line a supported verdict changes
DECLARED = {"--compile": "`DEFAULT_COMPILE` in `concept/config.py` (every command's and the Python API's)",
            "--lora-kernel": "`LoraSettings.kernel`'s default in `concept/train_config.py`"}


def _verdict(option: str, now: str, proposed: str, checks: list[tuple[str | None, str | None]]) -> dict:
    evidence = [e for e, _ in checks if e]
    against = [p for _, p in checks if p]
    return {"option": option, "now": now, "proposed": proposed, "supported": not against, "declared": DECLARED[option],
            "evidence": evidence, "against": against}


def compile_verdict(setup: dict | None, exact: dict | None, speed: dict | None) -> dict:
    throughput = ((setup or {}).get("result") or {}).get("throughput") or {}
    compiled = (throughput.get("compiled") or {}).get("models") or {}
    checks = [_tests_evidence(exact, "a compiled path", lambda i: "compile" in i.lower()),
              _faster(compiled, throughput.get("models") or {}, ("streaming", "dense"), "training, compiled against eager")]
    rows = ((speed or {}).get("result") or {}).get("rows") or []
    fast = next((r for r in rows if r.get("suite") == "forward-compiled" and "T=8192" in r["case"]), None)
    slow = next((r for r in rows if r.get("suite") == "forward-decided" and "T=8192" in r["case"]), None) or \
        next((r for r in rows if r.get("suite") == "forward" and "T=8192" in r["case"] and "flex" in r["case"]), None)
    if not (fast and slow):
        checks.append((None, "`speed` has no compiled and eager 8k forward rows to compare"))
    elif fast["concept_s"] < slow["concept_s"]:
        checks.append((f"the compiled 8k forward {slow['concept_s'] / fast['concept_s']:.2f}x the eager one "
                       f"({1000 * fast['concept_s']:.2f} ms against {1000 * slow['concept_s']:.2f})", None))
    else:
        checks.append((None, f"the compiled 8k forward was not faster than the eager one "
                             f"({1000 * fast['concept_s']:.2f} ms against {1000 * slow['concept_s']:.2f})"))
    return _verdict("--compile", "off", "auto", checks)


def lora_kernel_verdict(setup: dict | None, exact: dict | None, speed: dict | None) -> dict:
    compiled = (((setup or {}).get("result") or {}).get("throughput") or {}).get("compiled") or {}
    kernels = (compiled.get("lora_kernel") or {}).get("models") or {}
    checks = [_tests_evidence(exact, "the adapters' Triton kernels", lambda i: i.startswith("tests/test_lora_triton.py")),
              _faster(kernels, compiled.get("models") or {}, ("streaming", "dense"),
                      "compiled training, the Triton kernels against the matmuls")]
    rows = [r for r in ((speed or {}).get("result") or {}).get("rows") or []
            if r.get("suite") == "adapter-cost" and "kernels_device_busy_s_per_projection" in r]
    if not rows:
        checks.append((None, "`speed` has no adapter-cost rows with the Triton kernels"))
    else:
        slower = [r["case"] for r in rows
                  if r["kernels_device_busy_s_per_projection"] >= r["concept_device_busy_s_per_projection"]]
        checks.append((None, f"the kernels took no less device time than the matmuls in {', '.join(slower)}") if slower
                      else (f"the kernels took less device time than the matmuls in all {len(rows)} adapter-cost rows",
                            None))
    return _verdict("--lora-kernel", "matmuls", "auto", checks)


def deep_attention_lines(speed: dict | None) -> list[str]:
    diagnosis = ((speed or {}).get("result") or {}).get("flex_diagnosis") or {}
    if diagnosis.get("variants"):  # (ranked again: a diagnosis of a kit before ``fastest_exact`` has none)
        diagnosis = {**diagnosis, **flex_diagnosis.conclude(diagnosis)}
    fastest, adopt = diagnosis.get("fastest_exact"), diagnosis.get("adopt")
    if not fastest:
        return ["- the deep attention: the flex diagnosis measured no exact variant in this lease"]
    timer = flex_diagnosis.timer_text(fastest) or " by CUDA events"
    lines = [f"- the deep attention: the fastest exact variant is `{fastest['variant']}` ({fastest['ms']:.3f} ms"
             f"{timer}" + (f", {fastest['speedup_vs_dense']:.2f}x dense causal SDPA" if fastest.get("speedup_vs_dense")
                           else "") + ")"]
    if adopt:
        lines.append(f"- `flex`'s settings of its fastest FlexAttention variant: `{json.dumps(adopt)}`")
    return lines


def render(found: dict) -> str:
    """The block: a verdict a line, with its evidence and what is missing or against."""
    setup, exact, speed = (found.get(name) for name in ("setup", "exact", "speed"))
    if not (setup or exact or speed):
        return ""
    lines = ["What this lease's results say of the defaults that wait for a GPU (`benchmarks/gpu_kit/defaults_verdict.py`; "
             "a change is made by the session that reads it, not by `report`):", ""]
    for v in (compile_verdict(setup, exact, speed), lora_kernel_verdict(setup, exact, speed)):
        said = "; ".join(v["evidence"]) or "no evidence"
        lines.append(f"- `{v['option']}` `{v['now']}` -> `{v['proposed']}`: "
                     + (f"**supported** ({said}); the change: {v['declared']}" if v["supported"]
                        else f"not yet: {'; '.join(v['against'])}" + (f" (for it: {said})" if v["evidence"] else "")))
    return "\n".join(lines + deep_attention_lines(speed))
