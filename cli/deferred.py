"""A click command whose options are made from option dataclasses (``concept.options``) only when click
needs them."""
from __future__ import annotations

import click

from .help_groups import GroupedHelp

HELPING = "concept.helping"  # ctx.meta key: this invocation asks for --help
CHOSEN = "concept.options"  # ctx.meta key: which options this invocation has (``choose``)


class DeferredOptions(GroupedHelp):
    """A command with options made from a dataclass (``concept.options``) the first time click needs its
    parameters (to parse or for --help), placed after the parameter named ``after``: the modules that
    declare them (``concept.train_config``, the families' build options) read the installed families'
    entry points, which importing the CLI should not.

    ``make_options(key)``: the options for ``key``, which ``choose(words, helping)`` picks from the command line
    (``concept train RUN``: the name of RUN's family, whose options alone join the core's). By default ``key`` is
    ``third_party``: with --help, only the options of the core and the library's own families (a third-party
    family is not imported to list its options: one that imports torch or fails to import would make --help slow
    or broken); otherwise every family's. --help lists them in sections by owner (:class:`GroupedHelp`)."""

    def __init__(self, *args, make_options, after: str, choose=None, refuse=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.make_options, self.after = make_options, after
        self.choose = choose or (lambda words, helping: not helping)
        self.refuse = refuse  # (flag, key) -> why an option the command lacks for ``key`` is refused, or None
        self.declared = list(self.params)  # the command's own parameters
        self.made: dict = {}  # key -> the options made

    def parse_args(self, ctx, args):
        words = args[:args.index("--")] if "--" in args else args
        ctx.meta[HELPING] = any(word in ctx.help_option_names for word in words)
        ctx.meta[CHOSEN] = self.choose(list(words), ctx.meta[HELPING])
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:  # e.g. another family's option: say whose it is
            why = self.refuse(exc.option_name, ctx.meta[CHOSEN]) if self.refuse else None
            if why is None:
                raise
            # lazy: the library loads only when a command runs
            from concept.errors import ConfigError

            raise ConfigError([why]) from None

    def get_params(self, ctx):
        key = ctx.meta.get(CHOSEN, not ctx.meta.get(HELPING, False))
        if key not in self.made:
            self.made[key] = self.make_options(key)
        at = [p.name for p in self.declared].index(self.after) + 1
        self.params = [*self.declared[:at], *self.made[key], *self.declared[at:]]
        return super().get_params(ctx)
