"""A click command whose options are made from option dataclasses (``concept.options``) only when click
needs them."""
from __future__ import annotations

import click


class DeferredOptions(click.Command):
    """A command with options made from a dataclass (``concept.options``) the first time click needs its
    parameters (to parse or for --help), placed after the parameter named ``after``: the modules that
    declare them (``concept.train_config``, the families' build options) read the installed families'
    entry points, which importing the CLI should not."""

    def __init__(self, *args, make_options, after: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.make_options, self.after = make_options, after

    def get_params(self, ctx):
        if self.make_options is not None:
            at = [p.name for p in self.params].index(self.after) + 1
            self.params[at:at] = self.make_options()
            self.make_options = None
        return super().get_params(ctx)
