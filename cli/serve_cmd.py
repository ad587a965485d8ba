"""``concept serve``: an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models)."""
from __future__ import annotations

from pathlib import PurePath

import click

from concept.config import COMPILE_CHOICES, COMPILE_HELP, DEFAULT_COMPILE

from .load_options import dtype_option, merge_lora_option
from .output import quiet_progress_bars, status
from .renamed import renamed


@click.command()
@click.argument("run", metavar="RUN_DIR")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--model-name", default=None, help="The model's id in the API (default: the folder's name).")
@renamed("--max-new-tokens", "max_tokens", old=("--max-tokens",), type=int, default=16, show_default=True,
          help="New tokens of a request that gives no max_tokens (OpenAI's default is 16).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--compile", "compile_", type=click.Choice(COMPILE_CHOICES), default=DEFAULT_COMPILE, show_default=True,
              is_flag=False, flag_value="on", help=COMPILE_HELP + " Serving: as concept generate's, every request "
                                                                   "decoded in the server's one decoding thread.")
@dtype_option()
@merge_lora_option()
def serve(run, host, port, model_name, max_tokens, device, compile_, dtype, merge_lora):
    """Serve a model (a run, an export folder or a hub id) with OpenAI's API: GET /v1/models, POST
    /v1/completions and /v1/chat/completions (the backbone's chat template), streamed with "stream": true
    (server-sent events). Requests are served one at a time in arrival order, in one decoding thread;
    concurrent ones wait. --compile decodes each step as one graph (CUDA graphs on CUDA, recorded once).
    temperature 0 is greedy. Errors are 4xx JSON bodies in OpenAI's shape. Needs the serve extra:
    pip install 'concept[serve]'.

    \b
    concept serve runs/m1-train --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "m1-train", "prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'
    """
    # lazy: the library (torch) loads only when the command runs; --help stays instant
    import concept
    from concept.distributed import pick_device
    from concept.errors import ConceptError

    try:
        # lazy: the serve extra (fastapi, uvicorn) is optional, and torch loads only when the command runs
        from concept.serving import create_app
        import uvicorn
    except ImportError as exc:
        raise ConceptError(f"concept serve needs the serve extra ({exc.name} is missing): pip install 'concept[serve]'") from None
    if max_tokens < 1:
        raise click.BadParameter(f"must be >= 1, got {max_tokens}", param_hint="--max-new-tokens")
    quiet_progress_bars()
    status("loading", str(run))
    model = concept.load(run, compile=compile_, dtype=dtype, merge_lora=merge_lora).to(pick_device(device))
    name = model_name or PurePath(str(run).rstrip("/")).name
    app = create_app(model, name, default_max_tokens=max_tokens)
    status("serving", f"{name} on http://{host}:{port}/v1 (one request at a time; Ctrl-C stops)")
    uvicorn.run(app, host=host, port=port, log_level="warning")
