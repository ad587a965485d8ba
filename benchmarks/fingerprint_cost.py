"""What fingerprinting a backbone folder costs (``concept.fingerprint.of_backbone``), against a full SHA-256
of its weights: ``python -m benchmarks.fingerprint_cost FOLDER`` (e.g. the SmolLM2 cache folder,
``~/.cache/concept/smollm2-135m-instruct-q4_1``). Best of 5 (3 for the full hash), page cache warm."""
from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

from concept import fingerprint


def best(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def full_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main(folder: Path) -> None:
    weights = sorted(folder.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in weights)
    sampled = best(lambda: fingerprint.of_backbone(folder), 5)
    full = best(lambda: [full_sha256(p) for p in weights], 3)
    print(f"{folder}: {size / 2**20:.1f} MiB of safetensors")
    print(f"of_backbone (whole folder; header + {fingerprint.SAMPLES} x {fingerprint.BLOCK} B per file): "
          f"{sampled * 1000:.1f} ms")
    print(f"full SHA-256 of the safetensors files: {full * 1000:.0f} ms")


if __name__ == "__main__":
    main(Path(sys.argv[1]).expanduser())
