"""The options of the commands that run a loaded model (``eval``, ``generate``, ``chat``, ``serve``), declared once:
``--dtype``, ``concept.load``'s ``dtype`` (``concept.precision``), ``auto`` by default as ``concept train``'s: bf16 on a
CUDA device, fp32 elsewhere; ``--merge-lora``, ``concept.load``'s ``merge_lora`` (``concept.lora.merge_adapters``)."""
from __future__ import annotations

import click

from concept.config import DEFAULT_DTYPE, DTYPES, INFERENCE_DTYPE_HELP, MERGE_LORA_HELP


def dtype_option():
    return click.option("--dtype", type=click.Choice(DTYPES), default=DEFAULT_DTYPE, show_default=True,
                        help=INFERENCE_DTYPE_HELP)


def merge_lora_option():
    option = click.option("--merge-lora", "merge_lora", is_flag=True, default=False, help=MERGE_LORA_HELP)

    def decorate(command):
        command = option(command)
        # --help (``help_groups.GroupedHelp``): in --dtype's section, found when help is asked for (the training
        # options' declarations load only then: they find the installed families)
        command.__click_params__[-1].help_beside = "--dtype"
        return command
    return decorate
