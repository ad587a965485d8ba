"""The device scan's Triton kernels compiled ahead of time for NVIDIA GPUs, on a machine with no GPU.

Triton compiles a kernel to a cubin with no driver: its front end (TTIR, TTGIR, LLVM IR, PTX) and its
bundled ``ptxas``, for a target named by hand (``GPUTarget("cuda", 90, 32)``: the H100). The interpreter
(``tests/device_scan_cases.py``) runs the kernels' Python in numpy and never compiles them, so it does not
see what only the compiler refuses (a loop-carried value that changes type, a constexpr branch that does
not type-check); this module compiles what the ops really launch.

Every variant comes from the ops themselves: :func:`launches` calls each op
(``concept.streaming.scan_kernels``) on CPU tensors with its launch recorded instead of run (the kernel, its
arguments and constants, ``ROWS`` as ``rows_per_program`` chooses on CUDA), and :func:`build` hands them to
Triton's own argument binder, as ``JITFunction.run`` does on a GPU: the same signature (pointer dtypes,
``i32`` / ``i64`` integers, an integer 1 made a constant), the same alignment hints, the same options.
:func:`sass_report` reads the registers, the spills (local-memory loads and stores: ``LDL`` / ``STL``) and
the loop over T from the cubin (Triton's bundled ``cuobjdump``).

``python -m tests.scan_kernel_builds [--arch 90 80] [--sass KERNEL]`` prints the report as JSON (the GPU
image's Triton is checked the same way from a throwaway venv: ``docs/benchmarks.md``). ``tests/
test_scan_kernel_builds.py`` checks it in the default suite.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

from concept.streaming import gap
from concept.streaming.scan_choice import rows_per_program
from tests.device_scan_cases import intervals

# the shapes and parameters the ops are called with: each integer in each of Triton's specialisation classes
# (1: a constant; a multiple of 16: an alignment hint; other) somewhere, and `none` limits (2**62, which the ops
# clamp to T + 1: no i64 integer reaches a kernel)
SHAPES = {
    "demo batch 128x128": dict(B=128, T=128, max_run=3, min_chunk=2, max_chunk=5, threshold=0.7),
    "one row 8k": dict(B=1, T=8192, max_run=gap.UNBOUNDED, min_chunk=1, max_chunk=gap.UNBOUNDED, threshold=1.0),
    "odd 5x23": dict(B=5, T=23, max_run=1, min_chunk=3, max_chunk=16, threshold=0.5),
}


def kernels():
    from concept.streaming import scan_kernels  # Triton compiled (not the interpreter): the module's kernels
    return scan_kernels


@contextlib.contextmanager
def recorded(into: list):
    """Inside, the ops' launches are recorded in ``into`` (kernel, arguments, keyword arguments: the constants
    as ``_launch`` passes them, ``ROWS`` as ``rows_per_program`` chooses on CUDA) instead of run."""
    module = kernels()
    saved = module.wrap_triton, module.rows_per_program

    class Launch:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **constants: into.append((self.kernel, args, constants))

    module.wrap_triton, module.rows_per_program = Launch, lambda device: rows_per_program("cuda")
    try:
        yield
    finally:
        module.wrap_triton, module.rows_per_program = saved


def op_calls(B, T, max_run, min_chunk, max_chunk, threshold) -> dict:
    """Every op call the policies make, per variant of its switches: (name, thunk)."""
    ops, g = kernels(), torch.Generator().manual_seed(0)
    valid = torch.ones(B, T, dtype=torch.bool)
    bound = intervals((B, T), T, g)
    unsure, p = torch.rand(B, T, generator=g) > 0.5, torch.rand(B, T, generator=g)
    calls = {}
    for reset in (valid, None):
        tag = "reset" if reset is not None else "no reset"
        calls[f"null tracker, {tag}"] = lambda r=reset: ops.null_tracker_scan(valid, r, bound, max_run)
        calls[f"chunk, {tag}"] = lambda r=reset: ops.chunk_scan(valid, r, unsure, min_chunk, max_chunk)
        calls[f"chunk tracked, {tag}"] = lambda r=reset: ops.tracked_chunk_scan(valid, r, bound, min_chunk,
                                                                                  max_chunk)
        for dtype in (torch.float32, torch.float64):
            calls[f"threshold {str(dtype)[6:]}, {tag}"] = lambda r=reset, d=dtype: ops.threshold_scan(
                valid, r, p.to(d), threshold, max_run)
    return calls


def launches() -> dict:
    """Every distinct kernel variant the ops launch on CUDA over :data:`SHAPES`: name -> (kernel, args, constants).
    Distinct: Triton's own specialisation key (signature, constants, alignment hints) differs."""
    seen, found = set(), {}
    for shape, params in SHAPES.items():
        for call, thunk in op_calls(**params).items():
            record = []
            with recorded(record):
                thunk()
            (launch,) = record
            key = specialisation(*launch, arch=90)[1:]
            if key not in seen:
                seen.add(key)
                found[f"{call} ({shape})"] = launch
    return found


@functools.cache
def _binder(kernel, arch: int):
    """Triton's argument binder for ``kernel`` on ``sm_<arch>`` (what ``JITFunction.create_binder`` makes for
    the GPU it runs on), with the target and its backend."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    return target, backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def _binding(kernel, args, constants, arch):
    target, backend, binder = _binder(kernel, arch)
    bound, specialization, options = binder(*args, **constants)
    options, signature, constexprs, attrs = kernel._pack_args(backend, constants, bound, specialization, options)
    return target, options, signature, constexprs, attrs


def specialisation(kernel, args, constants, arch=90) -> tuple:
    """(kernel name, signature, constants, alignment hints) as Triton's binder makes them for this launch."""
    _, _, signature, constexprs, attrs = _binding(kernel, args, constants, arch)
    return (kernel.__name__, tuple(signature.items()), tuple(sorted((k, v) for k, v in constexprs.items())),
            tuple(sorted((k, repr(v)) for k, v in attrs.items())))


def build(kernel, args, constants, arch: int = 90):
    """The launch compiled for ``sm_<arch>`` as ``JITFunction.run`` would on that GPU (Triton's cache applies)."""
    from triton.compiler import ASTSource
    target, options, signature, constexprs, attrs = _binding(kernel, args, constants, arch)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _tool(name: str) -> str:
    return getattr(triton.knobs.nvidia, name).path


def sass(compiled) -> list[str]:
    """The cubin's SASS, one instruction a line: ``<offset> <instruction>`` (Triton's bundled ``cuobjdump``)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([_tool("cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout
    found = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", text)
    return [f"{int(at, 16):04x} {instruction}" for at, instruction in found]


def resources(compiled) -> dict:
    """The kernel's registers per thread and its local memory, the stack frame included (bytes): what a spill
    would use (``cuobjdump -res-usage``, milliseconds where the SASS takes a second)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([_tool("cuobjdump"), "-res-usage", str(path)], capture_output=True, text=True,
                              check=True).stdout
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return {"registers": int(usage["REG"]), "local_bytes": int(usage["STACK"]) + int(usage["LOCAL"])}


def loop_shape(lines: list[str]) -> dict:
    """The loop over T (the instructions from a backward branch's target to it; the longest, where the compiler
    split it into an unrolled loop and a remainder loop): its instructions, global loads and stores, spill
    instructions, calls (a 64-bit division's slow path), where the loads sit (instructions from the top),
    and per load the instructions until the first one that reads its value (the fewer, the more of the load's
    latency a warp waits out)."""
    at = {int(line.split()[0], 16): i for i, line in enumerate(lines)}
    loops = [(at[int(m.group(1), 16)], i) for i, line in enumerate(lines)
             if (m := re.search(r"\bBRA\s+0x([0-9a-f]+)", line))
             and int(m.group(1), 16) in at and at[int(m.group(1), 16)] < i]
    if not loops:
        return {"loops": 0}
    top, end = max(loops, key=lambda loop: loop[1] - loop[0])
    body = [line.split(None, 1)[1] for line in lines[top:end + 1]]
    loads = [i for i, ins in enumerate(body) if re.search(r"\bLDG\b", ins)]
    waits = []
    for i in loads:
        target = re.search(r"LDG\S*\s+(R\d+)", body[i]).group(1)
        reads = [j for j in range(i + 1, len(body))
                 if re.search(rf"[ ,\[-]{target}\b", body[j].split(",", 1)[-1] if "," in body[j] else "")]
        waits.append(reads[0] - i if reads else None)
    return {"loops": len(loops), "instructions": len(body), "loads": len(loads), "load_at": loads,
            "to_first_read": waits,
            "stores": sum(bool(re.search(r"\bSTG\b", ins)) for ins in body),
            "spills": sum(bool(re.search(r"\b(LDL|STL)\b", ins)) for ins in body),
            "calls": sum(calls_away(line) for line in lines[top:end + 1])}


def calls_away(line: str) -> bool:
    """Whether a SASS line (``<offset> <instruction>``) calls a subroutine (a 64-bit division's slow path, placed
    after the kernel's end), not just past the loop's back branch (``CALL.REL.NOINC`` one or two instructions
    ahead: how ptxas leaves a loop on sm_80)."""
    at, instruction = line.split(None, 1)
    if "CALL" not in instruction:
        return False
    target = re.search(r"\b0x([0-9a-f]+)", instruction)
    return not (target and 0 < int(target.group(1), 16) - int(at, 16) <= 0x20)


def sass_report(compiled) -> dict:
    """:func:`resources`, the spill instructions (``LDL`` / ``STL``), and the loop over T (:func:`loop_shape`)."""
    lines = sass(compiled)
    return {**resources(compiled), "spills": sum(bool(re.search(r"\b(LDL|STL)\b", line)) for line in lines),
            "instructions": len(lines), "loop": loop_shape(lines)}


def report(archs=(90,)) -> dict:
    found = launches()
    out = {"triton": triton.__version__, "variants": {}}
    for name, launch in found.items():
        kernel, args, constants = launch
        _, signature, constexprs, _ = specialisation(*launch)
        names = kernel.arg_names
        entry = {"kernel": kernel.__name__, "signature": dict(signature),
                 "constants": {names[path[0]]: value for path, value in constexprs}}
        for arch in archs:
            try:
                entry[f"sm_{arch}"] = sass_report(build(*launch, arch=arch))
            except Exception as exc:  # noqa: BLE001  (the report says which variant failed and why)
                entry[f"sm_{arch}"] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        out["variants"][name] = entry
    return out


# -- the negative control: a kernel the interpreter runs and the compiler refuses ------------------------------


@triton.jit
def threshold_kernel_float32_sum(valid_ptr, reset_ptr, p_ptr, threshold_ptr, keep_ptr, total_ptr, run_ptr, B, T,
                                 max_run, HAS_RESET: tl.constexpr, ROWS: tl.constexpr):
    """``scan_kernels.threshold_kernel`` with one line changed: the running sum starts as float32 whatever p's
    dtype. With float64 p the loop re-assigns it a float64, which the compiler refuses (a loop-carried value
    changes type); numpy, the interpreter, promotes it and decides exactly as the right kernel."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    inside = rows < B
    start = rows.to(tl.int64) * T
    threshold = tl.load(threshold_ptr)
    total = tl.zeros([ROWS], dtype=tl.float32)  # the bug (the right kernel: threshold.dtype)
    run = tl.zeros([ROWS], dtype=tl.int32)
    for t in range(T):
        if HAS_RESET:
            fresh = tl.load(reset_ptr + start + t, mask=inside, other=0) != 0
            total = tl.where(fresh, 0.0, total)
            run = tl.where(fresh, 0, run)
        live = tl.load(valid_ptr + start + t, mask=inside, other=0) != 0
        summed = total + tl.load(p_ptr + start + t, mask=inside, other=0.0)
        keep = live & ((summed >= threshold) | (run >= max_run))
        tl.store(keep_ptr + start + t, keep, mask=inside)
        total = tl.where(live, tl.where(keep, 0.0, summed), total)
        run = tl.where(live, tl.where(keep, 0, run + 1), run)
    tl.store(total_ptr + rows, total, mask=inside)
    tl.store(run_ptr + rows, run.to(tl.int64), mask=inside)


@triton.jit
def divides_in_its_loop(x_ptr, out_ptr, T, width):
    """A loop that decodes each element with a 64-bit division, as the tracked kernels' loops did until 2026-11-28
    (their allowance as one int64, ``lo * width + hi + 1``): the negative control of the loop's ``calls``."""
    total = tl.zeros([1], dtype=tl.int64)
    for t in range(T):
        total += tl.load(x_ptr + t) // width
    tl.store(out_ptr + tl.arange(0, 1), total)


def division_launch(T: int = 128) -> tuple:
    """:func:`divides_in_its_loop`'s launch on int64 inputs (width an int32, promoted to int64 by the division)."""
    x, out = torch.zeros(T, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    return divides_in_its_loop, (x, out, T, T + 3), {}


def broken_threshold_launch(valid, reset, p, threshold: float, max_run: int) -> tuple:
    """The op ``threshold_scan``'s launch with the broken kernel (recorded from the op, the kernel swapped)."""
    record = []
    with recorded(record):
        kernels().threshold_scan(valid, reset, p, threshold, max_run)
    (_, args, constants), = record
    constants = {name: value for name, value in constants.items() if name != "UNROLL"}  # its loop: one token a step
    return threshold_kernel_float32_sum, args, constants


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capabilities (90: H100)")
    parser.add_argument("--sass", metavar="VARIANT", help="print this variant's SASS for sm_<first arch> instead")
    parser.add_argument("--unroll", type=int, help="tokens per loop iteration instead of the ops' UNROLL "
                        "(1: the loop as it was before the unrolling, one token an iteration)")
    args = parser.parse_args(argv)
    if args.unroll:
        kernels().UNROLL = args.unroll
    if args.sass:
        print("\n".join(sass(build(*launches()[args.sass], arch=args.arch[0]))))
        return 0
    print(json.dumps(report(tuple(args.arch)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
