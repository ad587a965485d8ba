"""``concept generate``: text from a trained run, with online compression and three KV caches."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

import click

from concept.config import COMPILE_CHOICES, COMPILE_HELP, DEFAULT_COMPILE

from .load_options import dtype_option, merge_lora_option
from .output import human_bytes, json_safe, print_concepts, quiet_progress_bars, status, stdout
from .renamed import renamed

# what a run's decoding can show, by view: the streaming family's (and a baseline's) concept marks and MTP heads,
# the planner-executor's plan (``Family.decodes``)
VIEWS = {"concepts": "concepts to show (the streaming family's)", "mtp": "MTP heads to decode with",
         "plan": "plan to show (only planner-executor runs write one)"}
BASELINE_VIEWS = ("concepts", "mtp")  # a dense / pruned baseline (no concepts: --show-concepts says so)


def read_prompts(prompts: tuple[str, ...], prompt_file: str | None) -> list[str]:
    """--prompt values, then the prompts of --prompt-file: one per non-empty line, or for a
    ``.jsonl`` file one JSON string or object with a "prompt" (or "text") field per line."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.errors import ConceptError

    out = list(prompts)
    if prompt_file is None:
        return out
    if prompt_file == "-":
        stdin = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else sys.stdin  # bytes: a clear error if not UTF-8
        data, name = stdin.read(), "stdin"
        data = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    else:
        path = Path(prompt_file)
        if path.is_dir():
            raise ConceptError(f"--prompt-file {prompt_file} is a folder; pass a text file with one prompt per line")
        if not path.is_file():
            raise ConceptError(f"--prompt-file {prompt_file}: no such file")
        try:
            data, name = path.read_bytes(), str(path)
        except OSError as exc:
            raise ConceptError(f"--prompt-file {prompt_file}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConceptError(f"--prompt-file {prompt_file}: {name} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                           f"convert it to UTF-8") from None
    if name.endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConceptError(f"{name}, line {n}: not JSON ({exc.msg})") from None
            prompt = item if isinstance(item, str) else (item.get("prompt", item.get("text")) if isinstance(item, dict) else None)
            if not isinstance(prompt, str):
                raise ConceptError(f'{name}, line {n}: expected a JSON string or an object with a "prompt" field')
            out.append(prompt)
    else:
        out.extend(line for line in text.splitlines() if line.strip())
    return out


def unescape(text: str) -> str:
    r"""``\n``, ``\t`` and ``\\`` typed on a command line -> newline, tab, backslash."""
    return text.replace("\\\\", "\0").replace("\\n", "\n").replace("\\t", "\t").replace("\0", "\\")


def sampling_settings(max_new_tokens, temperature, top_k, top_p, repetition_penalty, stop, seed) -> dict:
    """CLI sampling options -> GenerationSettings fields. ``--temperature 0`` (the default) is greedy;
    a positive temperature, --top-k or --top-p turn sampling on."""
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    from concept.errors import ConfigError
    from concept.options import finite

    for flag, value in (("--temperature", temperature), ("--top-p", top_p), ("--repetition-penalty", repetition_penalty)):
        if value is not None and not finite(value):  # (NaN compares false: it would pass as greedy)
            raise ConfigError([f"{flag}: must be a finite number, got {value}"])
    sample = (temperature is not None and temperature > 0) or top_k is not None or top_p is not None
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ConfigError(["--top-k / --top-p sample, but --temperature 0 means greedy; drop one of them"])
    if temperature is not None and temperature < 0:
        raise ConfigError([f"--temperature: must be >= 0 (0: greedy), got {temperature}"])
    settings = dict(max_new_tokens=max_new_tokens, do_sample=sample, repetition_penalty=repetition_penalty,
                    stop_strings=tuple(unescape(s) for s in stop), seed=seed)
    if sample:
        settings.update(temperature=temperature or 1.0, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p)
    return settings


def kv_summary(kv: dict) -> dict:
    saved = kv["dense_bytes"] / kv["bytes"] if kv["bytes"] else float("nan")
    return {**kv, "dense_over_concept": round(saved, 3)}


@click.command()
@click.argument("run", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option("--prompt", "-p", "prompts", multiple=True, help="A prompt (repeatable).")
@click.option("--prompt-file", type=click.Path(allow_dash=True),
              help="One prompt per non-empty line ('-': stdin); a .jsonl file holds one JSON string or "
                   '{"prompt": ...} object per line.')
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=None, help="0 or unset: greedy; > 0: sample at this temperature.")
@click.option("--top-k", type=int, default=None, help="Sample from the k most likely tokens.")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling: the smallest set with this total probability.")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True, help="> 1 discourages repeats.")
@click.option("--stop", multiple=True, help=r"Stop string (repeatable; \n and \t escapes work). The text is cut before it.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the token sampler.")
@click.option("--mtp", type=click.Choice(["verify", "confadapt"]), default=None,
              help="Multi-token decoding with the run's MTP heads (--length-policy mtp): verify = drafts checked in "
              "one forward (output = greedy), confadapt = confident drafts kept unchecked (lossy). Greedy only.")
@click.option("--mtp-tau", type=float, default=0.9, show_default=True,
              help="confadapt: keep drafted tokens while the heads' top-1 probability is at least this.")
@renamed("--batch", "batch_size", old=("--batch-size",), type=int, default=8, show_default=True,
         help="Prompts generated together.")
@click.option("--show-concepts", is_flag=True, help="Print prompt and output with the tokens that emitted a concept highlighted (styled on a "
              "terminal, between [[ ]] in a pipe or file).")
@click.option("--show-plan", is_flag=True, help="Planner-executor runs: print each prompt's plan (type by type, its "
              "concept ids) before the text.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--compile", "compile_", type=click.Choice(COMPILE_CHOICES), default=DEFAULT_COMPILE,
              show_default=True, is_flag=False, flag_value="on", help=COMPILE_HELP + " Generation: the prompt's forward (prompts left-padded "
                                                                 "to a multiple of 64 tokens) and each decoding step, one "
                                                                 "graph over static KV caches (CUDA graphs on CUDA); not "
                                                                 "with --mtp (eager).")
@dtype_option()
@merge_lora_option()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt (JSON lines).")
def generate(run, prompts, prompt_file, max_new_tokens, temperature, top_k, top_p, repetition_penalty, stop, seed,
             mtp, mtp_tau, batch_size, show_concepts, show_plan, device, compile_, dtype, merge_lora, as_json):
    """Generate text from a trained run (the streaming model, a planner-executor or a dense baseline).

    \b
    concept generate runs/m1-train --prompt "def fibonacci(n):" --max-new-tokens 64
    concept generate runs/m1-train -p "import os" --temperature 0.8 --top-p 0.95 --seed 0 --show-concepts
    concept generate runs/m1-train --prompt-file prompts.txt --json
    concept generate runs/mtp-train -p "def f(x):" --mtp verify          # same text, fewer forwards
    concept generate runs/pe-cont --prompt-file p.txt --show-plan          # the plan, then the text
    """
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    import concept
    from concept.builder import read_run, read_train, run_kind
    from concept.diagnostics import render_concepts
    from concept.tokens import encode_text
    from concept.distributed import pick_device
    from concept.errors import ConceptError, ConfigError
    from concept.families import family
    from concept.families import names as family_names
    from concept.generation import TextStream, settings_from
    from concept.generation import generate as run_generate
    from concept.tokens import tokenizer_for

    quiet_progress_bars()
    texts = read_prompts(prompts, prompt_file)
    if not texts and prompt_file is not None:
        raise click.UsageError(f"--prompt-file {prompt_file} holds no prompt (it is empty or only blank lines); "
                               f"put one prompt per line in it, or pass --prompt TEXT")
    if not texts:
        raise click.UsageError("give a prompt: --prompt TEXT or --prompt-file FILE")
    if batch_size < 1:
        raise ConfigError([f"--batch: must be >= 1, got {batch_size}"])
    settings = settings_from(None, {**sampling_settings(max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                                                        stop, seed), "mtp": mtp, "mtp_tau": mtp_tau})
    record = read_run(run)  # a clear error for a folder that is not a run
    train = read_train(run)
    kind = run_kind(record, train)
    views = family(kind).decodes if kind in family_names() else BASELINE_VIEWS  # what its decoding can show
    wrong = [(flag, view) for flag, view, given in (("--show-concepts", "concepts", show_concepts), ("--mtp", "mtp", mtp),
                                                    ("--show-plan", "plan", show_plan)) if given and view not in views]
    if wrong:
        raise ConfigError([f"{flag}: {run} is a {kind} run, which has no {VIEWS[view]}; drop it"
                           for flag, view in wrong])
    where = pick_device(device)  # (an unusable device: before anything is loaded)
    status("loading", str(run))
    model = concept.load(run, compile=compile_, dtype=dtype, merge_lora=merge_lora).to(where)
    if train is None and kind in family_names():
        status("warning:", f"{run} was built but never trained: its concept modules are untrained, so the text "
                           f"shows the mechanics, not the quality (train it with `concept train {run}`)")
    tokenizer = tokenizer_for(model)
    encoded = [encode_text(tokenizer, t) for t in texts]
    empty = [i + 1 for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise ConceptError(f"prompt {', '.join(map(str, empty))} is empty; give at least one character of text")

    stream = not as_json and not show_concepts and not show_plan and len(texts) == 1
    status("generating", f"{len(texts)} prompt{'s' * (len(texts) != 1)}, {'sampling' if settings.do_sample else 'greedy'}, "
                         f"{kind} {'baseline' if kind not in family_names() else 'model'} ...")
    for start in range(0, len(texts), batch_size):
        batch = encoded[start:start + batch_size]
        streamer = TextStream(tokenizer, settings.stop_strings) if stream else None
        began = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # prompt i samples with seed + i, whatever --batch groups it with
            seeded = dataclasses.replace(settings, seed=None if settings.seed is None else settings.seed + start)
            out = run_generate(model, batch, settings=seeded, tokenizer=tokenizer, streamer=streamer)
        seconds = time.perf_counter() - began
        for w in caught:
            status("warning:", str(w.message))
        for b, ids in enumerate(batch):
            index = start + b
            kv = kv_summary(out.kv[b])
            keep = out.keep[b] if out.keep is not None else None
            if as_json:
                click.echo(json.dumps(json_safe({
                    "prompt": texts[index], "text": out.texts[b], "tokens": out.tokens[b],
                    "finish_reason": out.finish_reasons[b], "prompt_tokens": len(ids), "new_tokens": len(out.tokens[b]),
                    "concept_positions": None if keep is None else [t for t, k in enumerate(keep) if k],
                    "forwards": out.steps, "kv": kv, **({"plan": out.plans[b]} if out.plans else {})}), allow_nan=False))
                continue
            if show_plan:
                if len(texts) > 1:
                    stdout.print(f"[dim]── prompt {index + 1} ──[/]")
                stdout.print("[bold]plan[/] " + "  ".join(f"{p['type']}: {p['ids']}" for p in out.plans[b]))
            if streamer is not None:
                streamer.finish(out.texts[b])
                click.echo()
            elif show_concepts:
                if len(texts) > 1:
                    stdout.print(f"[dim]── prompt {index + 1} ──[/]")
                print_concepts(render_concepts(tokenizer, ids + out.tokens[b], keep))
            else:
                if len(texts) > 1 and not show_plan:
                    stdout.print(f"[dim]── prompt {index + 1} ──[/]")
                click.echo(out.texts[b])
            concepts = "" if keep is None else f", {kv['concepts']} concepts / {len(keep)} tokens"
            if out.plans:
                concepts = f", plan of {sum(len(p['ids']) for p in out.plans[b])} concepts for {len(ids)} prompt tokens"
            status("done", f"prompt {index + 1}: {len(out.tokens[b])} tokens ({out.finish_reasons[b]}){concepts}; "
                           f"KV {human_bytes(kv['bytes'])} vs dense {human_bytes(kv['dense_bytes'])}")
        new_tokens = sum(map(len, out.tokens))
        per_forward = f", {new_tokens / max(1, out.steps):.2f} tokens per forward" if settings.mtp else ""
        status("speed", f"{new_tokens / seconds:.1f} new tokens/s over {len(batch)} prompt(s){per_forward}")
