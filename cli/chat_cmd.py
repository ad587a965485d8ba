"""``concept chat``: a conversation with a model in the terminal (the backbone's chat template, streamed)."""
from __future__ import annotations

import sys

import click

from concept.config import COMPILE_CHOICES, COMPILE_HELP, DEFAULT_COMPILE

from .load_options import dtype_option, merge_lora_option
from .generate_cmd import sampling_settings
from .output import quiet_progress_bars, status

COMMANDS = {"/exit": "leave (also /quit, Ctrl-D)", "/reset": "forget the conversation (the system message stays)"}


@click.command()
@click.argument("run", metavar="RUN_DIR")
@click.option("--system", default=None, help="The system message (default: the chat template's own, if any).")
@click.option("--message", "-m", default=None,
              help="One-shot: send this message, print the reply to stdout and exit (for scripts).")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="At most this many tokens a reply.")
@click.option("--temperature", type=float, default=None, help="0 or unset: greedy; > 0: sample at this temperature.")
@click.option("--top-k", type=int, default=None, help="Sample from the k most likely tokens.")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling: the smallest set with this total probability.")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True, help="> 1 discourages repeats.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the token sampler.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--compile", "compile_", type=click.Choice(COMPILE_CHOICES), default=DEFAULT_COMPILE, show_default=True,
              is_flag=False, flag_value="on", help=COMPILE_HELP + " Chat: as concept generate's.")
@dtype_option()
@merge_lora_option()
def chat(run, system, message, max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed, device, compile_, dtype,
         merge_lora):
    """Chat with a model (a run, an export folder or a hub id): each line you type is a user turn, the reply
    is streamed token by token. The prompt is the backbone's chat template (SmolLM2-Instruct's
    <|im_start|> turns); a backbone without one gets plain "User: ... / Assistant:" lines. Old turns are
    dropped when the conversation outgrows the context. Typed commands: /reset, /exit.

    \b
    concept chat runs/m1-train
    concept chat runs/m1-train --system "You are terse." --temperature 0.7
    concept chat exports/m1 --message "Write a haiku about Python."      # one reply on stdout
    printf 'hi\\nand then?\\n' | concept chat runs/m1-train                 # one user turn per line
    """
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    import concept
    from concept import chat as chats
    from concept.distributed import pick_device
    from concept.generation import TextStream, generate, settings_from
    from concept.tokens import tokenizer_for

    quiet_progress_bars()
    settings = settings_from(None, sampling_settings(max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                                                     (), seed))
    status("loading", str(run))
    model = concept.load(run, compile=compile_, dtype=dtype, merge_lora=merge_lora).to(pick_device(device))
    tokenizer = tokenizer_for(model)
    if not chats.has_template(tokenizer):
        status("note", "this backbone has no chat template: plain 'User: ... / Assistant:' turns")
    stops = chats.stop_strings(tokenizer)
    limit = getattr(model.backbone.config, "max_position_embeddings", None)
    history = [{"role": "system", "content": system}] if system else []

    def reply(text: str) -> None:
        nonlocal history
        history.append({"role": "user", "content": text})
        kept, ids = chats.fit(tokenizer, history, limit, settings.max_new_tokens)
        if len(kept) < len(history):
            status("note", f"the conversation outgrew the context: {len(history) - len(kept)} old turns dropped")
            history = kept
        stream = TextStream(tokenizer, stops)
        out = generate(model, [ids], settings=settings, tokenizer=tokenizer, streamer=stream, stop_strings=stops)
        stream.finish(out.texts[0])
        click.echo()
        history.append({"role": "assistant", "content": out.texts[0]})

    if message is not None:
        reply(message)
        return
    interactive = sys.stdin.isatty()
    if interactive:
        status("chat", "type a message; " + "; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    stdin = click.get_text_stream("stdin")
    while True:
        if interactive:
            click.echo(click.style("you> ", bold=True), nl=False, err=True)
        line = stdin.readline()
        if not line:  # EOF (Ctrl-D)
            break
        text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            history = history[:1] if system else []
            status("reset", "the conversation starts again")
            continue
        if text.strip():
            reply(text)
