"""The pack's xformers decision (benchmarks/gpu_pack.py): a wheel whose extensions were built for another torch
is packed when its attention operators call torch's own kernels, and left out otherwise (with the reason)."""
import json
import zipfile

import pytest

from benchmarks import gpu_pack


def fake_wheel(folder, torch_built: str, dispatches_to_torch: bool):
    path = folder / "xformers-0.0.35-py39-none-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("xformers/cpp_lib.json", json.dumps({"version": {"cuda": 1208, "torch": torch_built}}))
        if dispatches_to_torch:
            z.writestr("xformers/ops/fmha/torch_attention_compat.py", "")
    return path


@pytest.mark.parametrize("torch_built,dispatches,packed,reason", [
    ("2.11.0+cu130", False, True, "was built for torch 2.11.0+cu130"),
    ("2.10.0+cu128", True, True, "for `setup` to try them with a real call"),
    ("2.10.0+cu128", False, False, "so its kernels would not load"),  # negative control: an older wheel
])
def test_xformers_is_packed_when_its_kernels_can_run_on_the_image(tmp_path, monkeypatch, torch_built, dispatches,
                                                                   packed, reason):
    monkeypatch.setattr(gpu_pack, "TARGET", {**gpu_pack.TARGET, "torch": "2.11", "cuda": "13.0"})
    monkeypatch.setattr(gpu_pack, "download", lambda requirement: fake_wheel(tmp_path, torch_built, dispatches))
    decision = gpu_pack.xformers_decision()
    assert (decision["pack"] is not None) == packed and reason in decision["reason"]
