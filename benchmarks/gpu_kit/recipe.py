"""The training recipe the kit measures (`setup`) and trains with (`quality`).

It is `make demo`'s (the Makefile's ``DEMO_TRAIN``: the default build, i.e. split 4,18,8 on
SmolLM2 at 0.125 concepts per token, ``--seq-len 128 --lr 3e-3 --lr-new 3e-3``, warm-up 10% of
the steps) on a GPU-sized batch. The dry run (CPU, no GPU) uses the tiny random backbone with the
same recipe on a tiny batch, so that every stage runs in seconds.
"""
from __future__ import annotations

import dataclasses

DEMO = {"lr": 3e-3, "lr_new": 3e-3, "target_ratio": 0.125}
DEMO_SEQ_LEN = 128
WARMUP_FRACTION = 0.1  # the demo: 3 warm-up steps of 30
GPU_BATCH = 128  # 16,384 tokens per step
DRY_BATCH = 2
DRY_SEQ_LEN = 32
# the dry run's backbone: the tiny random Llama (plugins/backbones/tiny_llama.py), a split that fits its 8 layers
DRY_BACKBONE = "tiny-llama"
DRY_SPLIT = "2,4,2"
DRY_VOCABULARY = 64  # concept ids: with the default 4096 the tiny model's concept head would outweigh its layers
# the dry run's text (small, so that reading it costs nothing): one package of this project's own sources (Python
# only: concept/ also holds the offline tasks' JSONL) and one page of prose
DRY_DATA = "concept/streaming"
DRY_DOMAINS = ("code=plugins", "prose=docs/policies.md")
GPU_DOMAINS = ("stdlib", "pydoc")  # held-out code and prose (the frontier labels them code / prose)


def data(dry: bool) -> str | None:
    """The training text: the default (the Python standard library) on the GPU."""
    from .common import ROOT

    return str(ROOT / DRY_DATA) if dry else None


def domains(dry: bool) -> tuple[str, ...]:
    from .common import ROOT

    return tuple(f"{d.split('=')[0]}={ROOT / d.split('=')[1]}" for d in DRY_DOMAINS) if dry else GPU_DOMAINS


def seq_len(dry: bool) -> int:
    return DRY_SEQ_LEN if dry else DEMO_SEQ_LEN


def batch(dry: bool) -> int:
    return DRY_BATCH if dry else GPU_BATCH


def warmup(steps: int) -> int:
    return max(1, round(WARMUP_FRACTION * steps))


def build_config(dry: bool):
    """The default build (`concept build` with no options), or its tiny stand-in for the dry run."""
    from concept import BuildConfig, ComponentRef

    if dry:
        return BuildConfig(backbone=ComponentRef(DRY_BACKBONE), split=DRY_SPLIT,
                           vocabulary=ComponentRef("embedding", {"size": DRY_VOCABULARY}))
    return BuildConfig()


def build_args(dry: bool) -> list[str]:
    """``concept build`` / ``concept frontier`` options that give :func:`build_config`'s backbone and vocabulary."""
    return ["--backbone", DRY_BACKBONE, "--build-set", f"vocabulary.size={DRY_VOCABULARY}"] if dry else []


def dtype_flag_supported() -> bool:
    """Whether ``concept train`` takes ``--dtype`` (and the training config a ``dtype``): then the kit
    asks for bf16 explicitly; otherwise training relies on its bf16 autocast on CUDA."""
    import click

    from concept.train_config import TrainConfig
    from concept_cli.train_cmd import train

    help_text = train.get_help(click.Context(train, info_name="train"))
    return "--dtype" in help_text and "dtype" in {f.name for f in dataclasses.fields(TrainConfig)}


def precision(dry: bool) -> dict:
    """The training-config fields that set the precision: bf16 on the GPU where the option exists."""
    return {"dtype": "bf16"} if not dry and dtype_flag_supported() else {}


def train_config(dry: bool, steps: int, batch_size: int, baseline: str | None = None, device: str = "auto", **extra):
    """The recipe as a ``TrainConfig`` (``baseline``: None, "pruned" or "dense")."""
    from concept.train_config import TrainConfig

    fields = dict(steps=steps, seq_len=seq_len(dry), batch=batch_size, lr=DEMO["lr"], lr_new=DEMO["lr_new"],
                  warmup=warmup(steps), target_ratio=DEMO["target_ratio"], baseline=baseline, device=device,
                  data=data(dry), **precision(dry), **extra)
    return TrainConfig(**fields)
