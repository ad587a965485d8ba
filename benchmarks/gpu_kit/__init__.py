"""The GPU kit: what a session lent a GPU machine runs, prepared on the CPU machine (docs/gpu.md).

``make gpu-pack`` (``benchmarks/gpu_pack.py``) fills ``.gpukit/`` with what the bare GPU machine
lacks, split into call folders that each fit one device call. ``python -m benchmarks.gpu_kit
STAGE...`` runs the stages there, most decisive first: ``setup``, ``exact``, ``speed``,
``quality``; ``report`` (back on the CPU machine) writes their results into the docs. ``--dry``
runs every stage on the CPU with the tiny random backbone, in seconds, so the kit does not rot.
"""
