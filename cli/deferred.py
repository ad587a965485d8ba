"""A click command whose options are made from option dataclasses (``concept.options``) only when click
needs them."""
from __future__ import annotations

from .help_groups import GroupedHelp

HELPING = "concept.helping"  # ctx.meta key: this invocation asks for --help


class DeferredOptions(GroupedHelp):
    """A command with options made from a dataclass (``concept.options``) the first time click needs its
    parameters (to parse or for --help), placed after the parameter named ``after``: the modules that
    declare them (``concept.train_config``, the families' build options) read the installed families'
    entry points, which importing the CLI should not.

    ``make_options(third_party)``: with --help, only the options of the core and the library's own families
    (a third-party family is not imported to list its options: one that imports torch or fails to import
    would make --help slow or broken); otherwise every family's, so that a third-party run's are read. --help
    lists them in sections by owner (:class:`GroupedHelp`)."""

    def __init__(self, *args, make_options, after: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.make_options, self.after = make_options, after
        self.declared = list(self.params)  # the command's own parameters
        self.made: dict[bool, list] = {}  # third_party -> the options made

    def parse_args(self, ctx, args):
        words = args[:args.index("--")] if "--" in args else args
        ctx.meta[HELPING] = any(word in ctx.help_option_names for word in words)
        return super().parse_args(ctx, args)

    def get_params(self, ctx):
        third_party = not ctx.meta.get(HELPING, False)
        if third_party not in self.made:
            self.made[third_party] = self.make_options(third_party)
        at = [p.name for p in self.declared].index(self.after) + 1
        self.params = [*self.declared[:at], *self.made[third_party], *self.declared[at:]]
        return super().get_params(ctx)
