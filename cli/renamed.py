"""Options renamed for consistency across commands (docs/cli.md, "Naming rules"): the new spelling is shown
in --help; the old one still parses, hidden, for one release, with a note on stderr saying the new name."""
from __future__ import annotations

import click

ARGV = "concept.argv"  # ctx.meta key: the command line's words after ``concept``


class RenamedOption(click.Option):
    """A ``click.Option`` that also accepts ``old`` spellings, left out of --help; using one prints
    ``note: --old is now --new`` on stderr (the value is taken all the same)."""

    def __init__(self, param_decls, *, old: tuple[str, ...] = (), **attrs):
        super().__init__([*param_decls, *old], **attrs)
        self.old = tuple(old)

    def get_help_record(self, ctx):
        shown = self.opts
        self.opts = [o for o in shown if o not in self.old]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = shown

    def get_error_hint(self, ctx):
        return " / ".join(f"'{o}'" for o in self.opts if o not in self.old)

    def handle_parse_result(self, ctx, opts, args):
        used = _spelling(self.old, ctx)
        if used is not None:
            new = max((o for o in self.opts if o not in self.old), key=len)
            click.echo(f"note: {used} is now {new} (the old name goes away in the next release)", err=True)
        return super().handle_parse_result(ctx, opts, args)


def _spelling(old: tuple[str, ...], ctx: click.Context) -> str | None:
    """The old spelling on this command line, if one was used."""
    words = ctx.meta.get(ARGV, ())  # (set by the ``concept`` group: cli.main)
    return next((w.split("=", 1)[0] for w in words if w.split("=", 1)[0] in old), None)


def renamed(*param_decls: str, old: tuple[str, ...], **attrs):
    """``click.option`` whose ``old`` spellings still parse, hidden from --help."""
    return click.option(*param_decls, cls=RenamedOption, old=old, **attrs)

