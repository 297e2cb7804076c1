"""The ``hsx`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from service import __version__
from service.config import Settings


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


def _cmd_serve(_settings: Settings, _args: argparse.Namespace) -> int:
    print("hsx serve is not implemented yet (see the README's status).", file=sys.stderr)
    return 2


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
    make.add_argument("--kind", choices=["llama", "nemotron-h"], default="llama")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_cmd_make_model)
    commands.add_parser("serve", help="Start the HTTP service.").set_defaults(func=_cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    settings = Settings()
    return int(args.func(settings, args))
