"""The ``concept`` command group, its top-level error handling and the console-script entry point.

Every :class:`concept.errors.ConceptError` raised by a command is a problem with the user's
input or environment, never a bug: it is printed as ``error: <message>`` on stderr and the
process exits with the error's ``exit_code`` (2 for config / unknown-name errors). The
heavy ``concept`` package (torch) is imported only when a command runs, so ``--help`` and
``--version`` stay instant.
"""
from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

import click

from .bench_cmd import bench
from .build_cmd import build
from .chat_cmd import chat
from .eval_cmd import eval_
from .export_cmd import export
from .frontier_cmd import frontier
from .generate_cmd import generate
from .inspect_cmd import inspect
from .lm_eval_cmd import lm_eval_
from .output import print_error
from .plugins_cmd import plugins
from .renamed import ARGV
from .serve_cmd import serve
from .train_cmd import train


def _version() -> str:
    try:
        return version("concept")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


class ConceptGroup(click.Group):
    """A click group that turns user-facing errors into one line on stderr and an exit code."""

    def parse_args(self, ctx: click.Context, args: list[str]):
        words = args[:args.index("--")] if "--" in args else args
        ctx.meta[ARGV] = tuple(words)  # (a renamed option's old spelling: cli.renamed)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:  # Ctrl-C: every command exits 130, as a shell expects (what was written is kept)
            print_error("interrupted (Ctrl-C)")
            ctx.exit(130)
        except MemoryError:
            print_error(f"out of memory ({ctx.invoked_subcommand or 'the command'}); lower --batch or --seq-len, "
                        f"or free memory (nothing was published)")
            ctx.exit(1)
        except Exception as exc:
            # lazy: only a failing command needs it (start-up imports nothing of the library)
            from concept.errors import ConceptError, one_line
            from concept.fs import disk_errno, disk_message

            code = disk_errno(exc)  # a full disk, a file-size limit, a quota (also inside torch / safetensors errors)
            if code is not None:
                where = os.path.dirname(exc.filename) if isinstance(exc, OSError) and exc.filename else "the output folder"
                print_error(disk_message(code, where or "."))
                ctx.exit(1)
            if isinstance(exc, OSError):  # e.g. no permission to write the output folder
                print_error(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}")
                ctx.exit(1)
            if out_of_memory(exc):  # torch's allocators: CUDA out of memory, a CPU allocation refused
                print_error(one_line(f"out of memory ({ctx.invoked_subcommand or 'the command'}): {exc}", 240)
                            + "; lower --batch or --seq-len, or free memory")
                ctx.exit(1)
            if not isinstance(exc, ConceptError):
                raise
            print_error(str(exc))
            ctx.exit(getattr(exc, "exit_code", 1))


def out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: ``torch.OutOfMemoryError`` (CUDA), or the CPU allocator's RuntimeError."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and any(
        s in str(exc) for s in ("can't allocate memory", "not enough memory", "CUDA out of memory"))


@click.group(cls=ConceptGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), "--version", "-V", prog_name="concept", message="%(prog)s %(version)s")
def cli() -> None:
    """Compress a pretrained LLM's token stream into discrete concept tokens inside the model.

    Data goes to stdout, status to stderr; --json prints machine-readable JSON only.
    """


cli.add_command(plugins)
cli.add_command(build)
cli.add_command(inspect)
cli.add_command(train)
cli.add_command(eval_)
cli.add_command(lm_eval_)
cli.add_command(export)
cli.add_command(generate)
cli.add_command(chat)
cli.add_command(serve)
cli.add_command(bench)
cli.add_command(frontier)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``concept = concept_cli.main:main``)."""
    cli.main(args=argv, prog_name="concept")


if __name__ == "__main__":
    main()
