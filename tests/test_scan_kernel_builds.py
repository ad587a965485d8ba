"""The device scan's Triton kernels compile for the H100 (sm_90) and the A100 (sm_80) on this CPU machine.

``tests/test_device_scan.py`` runs the kernels in Triton's interpreter (numpy), which never compiles them.
Here the kernel variants the ops launch on CUDA (``tests/scan_kernel_builds.py``: recorded from the ops
themselves, bound by Triton's own binder: each switch, pointer dtype, integer class, ``ROWS`` as
``rows_per_program`` chooses, ``UNROLL``) are compiled to cubins with Triton's bundled ``ptxas``: each
compiles, spills nothing in its loop over T and keeps within a register bound. The default suite compiles each
switch combination for the H100 (10) and two for the A100 (the largest loop, the float64 sums): about 17 s
cold on the 2-core machine, 7 s from Triton's cache; the ``slow`` test compiles every variant (30: each
integer class too) for both.

The negative controls: a kernel whose running sum changes type in its loop, which the interpreter runs and
decides right (``tests/device_scan_cases.py``, checked in ``tests/test_device_scan.py``), is refused here; a
kernel held to 24 registers spills in its loop, and the check says so.
"""
from __future__ import annotations

import pytest

from concept.streaming import device_scan

pytestmark = [
    pytest.mark.skipif(not device_scan.AVAILABLE, reason="triton is not installed"),
    pytest.mark.skipif(device_scan.interpreted(), reason="TRITON_INTERPRET=1: Triton's kernels are interpreted here, "
                                                         "not compiled (unset it to compile them ahead of time)"),
]

# per thread: 30-48 for the untracked kernels and, since their allowances unpack with a shift, the tracked ones;
# more means the loop grew (spills are checked apart)
REGISTERS = 128


@pytest.fixture(scope="module")
def builds():
    import triton
    try:
        triton.knobs.nvidia.ptxas.path, triton.knobs.nvidia.cuobjdump.path
    except RuntimeError as exc:  # a Triton build without its bundled NVIDIA tools
        pytest.skip(f"Triton's bundled ptxas / cuobjdump are not found ({exc}): nothing to compile with")
    from tests import scan_kernel_builds
    return scan_kernel_builds


@pytest.fixture(scope="module")
def launched(builds):
    return builds.launches()


def test_the_variants_cover_every_switch_dtype_and_integer_class(builds, launched):
    """What the ops launch over the shapes: each kernel with and without document starts, the chunk rule tracked
    and not, threshold's float32 and float64 sums, one program per row, and each integer class Triton
    specialises on (a 1 made a constant, an int32; no int64: a limit of `none` reaches the kernel as T + 1)."""
    seen = {builds.specialisation(*launch) for launch in launched.values()}
    assert len(seen) == len(launched) >= 20
    kinds = {(kernel.__name__, constants["HAS_RESET"], constants.get("TRACKED"))
             for kernel, _, constants in launched.values()}
    assert kinds == {(name, reset, tracked) for reset in (True, False) for name, tracked in
                     [("null_tracker_kernel", None), ("chunk_kernel", True), ("chunk_kernel", False),
                      ("threshold_kernel", None)]}
    assert all(constants["ROWS"] == 1 and constants["UNROLL"] == builds.kernels().UNROLL
               for _, _, constants in launched.values())
    types = {(name, arg, kind) for name, signature, _, _ in seen for arg, kind in signature}
    assert {("threshold_kernel", "p_ptr", "*fp32"), ("threshold_kernel", "p_ptr", "*fp64"),
            ("chunk_kernel", "unsure_ptr", "*u1"), ("chunk_kernel", "bound_ptr", "*i64"),
            ("null_tracker_kernel", "bound_ptr", "*i64"),
            ("null_tracker_kernel", "B", "constexpr"), ("null_tracker_kernel", "max_run", "i32"),
            ("null_tracker_kernel", "max_run", "constexpr"), ("chunk_kernel", "min_chunk", "constexpr"),
            ("chunk_kernel", "max_chunk", "i32"), ("threshold_kernel", "max_run", "constexpr")} <= types
    # every limit is an int32, `none` included (the ops clamp it to T + 1): no 64-bit compare in a loop
    assert not {(name, arg) for name, arg, kind in types if kind == "i64"}, types


def check_builds(builds, launches, arch):
    """Each compiles, with no spill in its loop over T: no local memory at all (a spill is stored there), or, where
    ptxas keeps a value in it (Triton 3.6 does, 8 bytes, for `threshold` on one row of 8k tokens), none of the
    loop's instructions touch it (the SASS read only then: a second a kernel)."""
    for name, launch in launches.items():
        compiled = builds.build(*launch, arch=arch)
        usage = builds.resources(compiled)
        if usage["local_bytes"]:
            loop = builds.loop_shape(builds.sass(compiled))
            assert loop.get("spills") == 0 and loop["loads"] > 0, (name, usage, loop)
        assert 0 < usage["registers"] <= REGISTERS, (name, usage)


def first_shape(builds, launched) -> dict:
    """One variant per switch combination (the ten of the first shape: int32 integers)."""
    shape = next(iter(builds.SHAPES))
    return {name: launch for name, launch in launched.items() if f"({shape})" in name}


def test_every_switch_compiles_for_the_h100_without_spills(builds, launched):
    chosen = first_shape(builds, launched)
    assert len(chosen) == 10
    check_builds(builds, chosen, 90)


def test_each_kernel_compiles_for_the_a100(builds, launched):
    chosen = {name: launch for name, launch in first_shape(builds, launched).items()
              if name.startswith(("null tracker, reset", "threshold float64, no reset"))}
    assert len(chosen) == 2
    check_builds(builds, chosen, 80)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 80])
def test_every_launched_variant_compiles_without_spills(builds, launched, arch):
    """Every variant (each integer class too: a row of 8k tokens with `none` bounds, B = 1 and ``max_run`` = 1
    made constants) for the H100 and the A100: about a second a compile."""
    check_builds(builds, launched, arch)


def test_negative_control_a_type_error_the_interpreter_runs_is_refused(builds):
    """The kernel whose running sum starts as float32: compiled for float32 p (no type change) it builds; for
    float64 p the compiler refuses it, where the interpreter decides as the right kernel
    (``tests/test_device_scan.py``'s report: ``interpreter_runs_the_broken_kernel``)."""
    import torch
    from triton.compiler.errors import CompilationError
    valid = torch.ones(3, 7, dtype=torch.bool)
    builds.build(*builds.broken_threshold_launch(valid, valid, torch.rand(3, 7), 0.7, 3))
    with pytest.raises(CompilationError, match="Loop-carried variable total"):
        builds.build(*builds.broken_threshold_launch(valid, valid, torch.rand(3, 7, dtype=torch.float64), 0.7, 3))


def test_the_tracked_loops_are_32_bit_compares_without_a_division(builds, launched):
    """The tracked kernels' loops over a row of 8k tokens (the 8k forward's scan, one program): no call (a 64-bit
    division's slow path) and at most 40 instructions a token (2026-11-28: 31, from 72 while each token's
    allowance was decoded by a division in the loop). Negative control: a loop with a 64-bit division calls."""
    chosen = {name: launch for name, launch in launched.items()
              if name.startswith(("null tracker", "chunk tracked")) and "(one row 8k)" in name}
    assert len(chosen) == 4
    for name, (kernel, args, constants) in chosen.items():
        loop = builds.loop_shape(builds.sass(builds.build(kernel, args, constants)))
        assert loop["calls"] == 0 and loop["instructions"] <= 40 * constants["UNROLL"], (name, loop)
    control = builds.loop_shape(builds.sass(builds.build(*builds.division_launch())))
    assert control["calls"] > 0, control


def test_negative_control_spills_in_the_loop_are_seen(builds, launched):
    """The null tracker (32-40 registers) held to 24 by ptxas (``maxnreg``) spills in its loop: the check fails."""
    kernel, args, constants = launched[next(name for name in launched if name.startswith("null tracker, reset"))]
    with pytest.raises(AssertionError, match="spills"):
        check_builds(builds, {"held to 24 registers": (kernel, args, {**constants, "maxnreg": 24})}, 90)
