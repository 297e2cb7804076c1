"""``hsx dataset run|verify|export``: argument parsing and exit codes.

Exit codes: 0 done (every row decided; malformed rows count as decided), 1 a run that
stopped or left retryable failures (run it again), or a verify that found problems,
2 bad input or options (one line on stderr, nothing written). Whatever else goes wrong
is one line on stderr and exit 1, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

# The dataset modules (httpx, pydantic models, datasets) load only when a dataset
# command runs, so ``hsx serve`` needs none of the ``dataset`` extra.


def user_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad input or options: one line, exit 2."""
    from pydantic import ValidationError

    from service.dataset.endpoints import EndpointError
    from service.dataset.estimate import EstimateError
    from service.dataset.export import ExportError
    from service.dataset.inputs import InputError
    from service.dataset.manifest import FingerprintMismatchError
    from service.dataset.model_choice import ParityError
    from service.dataset.session import RunError
    from service.dataset.store import OutputError

    return (
        InputError,
        EndpointError,
        FingerprintMismatchError,
        RunError,
        OutputError,
        EstimateError,
        ExportError,
        ParityError,
        FileNotFoundError,
        ValidationError,
        ValueError,
    )


def add_parser(commands: Any) -> None:
    """Register ``hsx dataset`` on the ``hsx`` subcommands."""
    dataset = commands.add_parser("dataset", help="whole datasets: run, verify, export")
    sub = dataset.add_subparsers(dest="dataset_command", required=True)
    _run_parser(sub.add_parser("run", help="extract every row of INPUT (resumable)"))
    verify = sub.add_parser("verify", help="check every object of a run's manifest")
    verify.add_argument("output", help="the run's --output")
    _common(verify)
    _verify_checks(verify)
    verify.set_defaults(func=_cmd_verify)
    export = sub.add_parser("export", help="write a run in a trainer's layout")
    export.add_argument("output", help="the run's --output")
    export.add_argument(
        "dest", help="a new directory (trainer layouts), or a new JSONL file (openai-batch)"
    )
    export.add_argument(
        "--format",
        choices=["speculators", "specforge", "modelopt", "eagle", "openai-batch"],
        default="speculators",
        help="a trainer's layout (docs/trainers.md, Trainer layouts), or OpenAI Batch "
        "API output lines",
    )
    export.add_argument(
        "--storage-url",
        default=None,
        help="openai-batch: the server's HSX_STORAGE__URL, so each line's uri is the "
        "object's storage URI (default: ENDPOINT/objects/KEY)",
    )
    export.add_argument(
        "--allow-partial",
        action="store_true",
        help="export the ok rows of a run that still has undecided rows",
    )
    _layout_options(export)
    _common(export)
    export.set_defaults(func=_cmd_export)


def _layout_options(export: argparse.ArgumentParser) -> None:
    export.add_argument(
        "--specforge-layout",
        choices=["eagle3", "dflash"],
        default="eagle3",
        help="specforge: EAGLE-3 (three aux layers and the normed last layer) or "
        "DFlash/Domino (aux layers only)",
    )
    export.add_argument(
        "--aux-layers",
        default=None,
        metavar="IDS",
        help="comma-separated aux layers in the trainer's ids (the decoder layer whose "
        "output is taken: hsx id minus one); default: the trainer's own for the model "
        "(DFlash: every layer the run holds below the last)",
    )
    export.add_argument(
        "--model",
        default=None,
        metavar="PATH_OR_HF_ID",
        help="the served model: its final norm, layer count and vocabulary size "
        "(default: the run's, only as a Hugging Face id or a directory whose weights "
        "SHA-256 is the run's)",
    )
    export.add_argument(
        "--compress", action="store_true", help="specforge: gzip each file (.ckpt.gz)"
    )
    export.add_argument(
        "--vocab-map",
        type=int,
        default=None,
        metavar="N",
        help="also write d2t/t2d of an N-token draft vocabulary from the supervised "
        "tokens (speculators' d2t-N.npy and t2d-N.npy, ModelOpt's d2t.pt)",
    )


def _common(parser: argparse.ArgumentParser, many: bool = False) -> None:
    parser.add_argument(
        "--endpoint",
        action="append" if many else "store",
        required=True,
        help="hsx base URL" + (" (repeat to share the work)" if many else ""),
    )
    parser.add_argument("--api-key", default=None, help="API key (default: $HSX_API_KEY)")
    parser.add_argument(
        "--s3-endpoint-url",
        default=None,
        help="S3-compatible endpoint of an s3:// output; the other S3 settings come from "
        "HSX_STORAGE__S3__* as for the server's objects (e.g. ADDRESSING_STYLE=path)",
    )


def _verify_checks(verify: argparse.ArgumentParser) -> None:
    verify.add_argument(
        "--parity",
        type=int,
        default=0,
        metavar="K",
        help="recompute K sampled rows with transformers and compare each layer "
        "(writes parity.json into the output)",
    )
    verify.add_argument(
        "--parity-model",
        default=None,
        metavar="PATH_OR_HF_ID",
        help="the served model for --parity and token drift (default: the served name, "
        "only as a Hugging Face id or a directory whose weights SHA-256 is the run's)",
    )
    verify.add_argument("--parity-seed", type=int, default=0, help="seed of the samples")
    verify.add_argument("--parity-device", choices=["cpu", "cuda"], default="cpu")
    verify.add_argument(
        "--parity-tolerance",
        type=float,
        default=None,
        help="largest relative error of a layer (default: by the run's dtype and codec)",
    )
    verify.add_argument(
        "--token-drift",
        type=int,
        default=None,
        metavar="K",
        help="re-render K sampled messages rows with the model's chat template "
        "(default: --parity's K; 0: off)",
    )
    verify.add_argument(
        "--allow-mixed-provenance",
        action="store_true",
        help="accept a run whose objects carry different hsx.provenance.* metadata",
    )


def checks_of(args: argparse.Namespace) -> Any:
    """verify's Checks from ``hsx dataset verify`` arguments."""
    from service.dataset.verify import Checks

    if args.parity < 0 or (args.token_drift or 0) < 0:
        raise ValueError("--parity and --token-drift take a count >= 0")
    return Checks(
        parity=args.parity,
        parity_model=args.parity_model,
        parity_seed=args.parity_seed,
        parity_device=args.parity_device,
        parity_tolerance=args.parity_tolerance,
        drift=args.token_drift,
        allow_mixed_provenance=args.allow_mixed_provenance,
    )


def _run_parser(run: argparse.ArgumentParser) -> None:
    run.add_argument("input", help="JSONL, JSON, Parquet, or a save_to_disk directory")
    _common(run, many=True)
    run.add_argument("--output", required=True, help="directory or s3://bucket/prefix")
    run.add_argument(
        "--loss",
        choices=["none", "assistant", "last_turn", "all"],
        default=None,
        help="default: none; assistant with --regenerate",
    )
    run.add_argument("--codec", default=None, help="raw, fp8, bf16, lossless (server's default)")
    run.add_argument("--layers", default=None, help="comma-separated subset of layer ids")
    run.add_argument("--max-tokens", type=int, default=1)
    run.add_argument("--include-output-tokens", action="store_true")
    regen = run.add_argument_group("regeneration (on-policy data in one pass)")
    regen.add_argument(
        "--regenerate",
        action="store_true",
        help="replace every assistant turn of each messages row with the target's own "
        "answer, turn by turn, and store the conversation's states as generated",
    )
    regen.add_argument(
        "--regenerate-max-tokens", type=int, default=256, help="tokens per turn (256)"
    )
    regen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    regen.add_argument("--top-p", type=float, default=1.0)
    regen.add_argument("--seed", type=int, default=0, help="with each row's custom_id")
    run.add_argument("--max-length", type=int, default=None, help="default: the server's")
    run.add_argument(
        "--on-long",
        choices=["skip", "truncate"],
        default="skip",
        help="over --max-length: skip the row, or truncate token-id rows",
    )
    run.add_argument("--concurrency", type=int, default=4, help="requests per endpoint")
    run.add_argument("--batch-size", type=int, default=8, help="prompts per request")
    run.add_argument("--retries", type=int, default=8)
    run.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    run.add_argument("--max-consecutive-errors", type=int, default=10)
    run.add_argument(
        "--shard",
        default=None,
        help="I/N: the rows whose custom_id hashes to I (default: from a Slurm array's "
        "SLURM_ARRAY_TASK_ID or a Kubernetes Indexed Job's JOB_COMPLETION_INDEX)",
    )
    run.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="shard count (speculators' flag): with --rank I, the same as --shard I/N; "
        "alone, the count of a JOB_COMPLETION_INDEX (or set WORLD_SIZE)",
    )
    run.add_argument(
        "--rank", type=int, default=None, metavar="I", help="this shard (needs --world-size)"
    )
    run.add_argument("--id-column", default="custom_id")
    run.add_argument("--force", action="store_true", help="continue a run of other settings")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument(
        "--estimate",
        action="store_true",
        help="print projected tokens, bytes and time; write nothing",
    )
    run.set_defaults(func=_cmd_run)


def options_of(args: argparse.Namespace) -> Any:
    """RunOptions from ``hsx dataset run`` arguments; the shard from the flags, else from
    the launcher's environment (said on stderr when there is one)."""
    from service.dataset.launch import resolve_shard
    from service.dataset.options import RunOptions

    choice = resolve_shard(args.shard, args.world_size, args.rank, os.environ)
    options = RunOptions(
        input=args.input,
        endpoints=args.endpoint,
        output=args.output,
        api_key=args.api_key or os.environ.get("HSX_API_KEY"),
        loss=args.loss or ("assistant" if args.regenerate else "none"),
        regenerate=_regenerate_of(args),
        codec=args.codec,
        layers=[int(p) for p in args.layers.split(",")] if args.layers else None,
        max_tokens=args.max_tokens,
        include_output_tokens=args.include_output_tokens,
        max_length=args.max_length,
        on_long=args.on_long,
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        retries=args.retries,
        request_timeout=args.request_timeout,
        max_consecutive_errors=args.max_consecutive_errors,
        shard=choice.shard,
        id_column=args.id_column,
        force=args.force,
        progress=not args.no_progress,
        s3_endpoint_url=args.s3_endpoint_url,
    )
    chosen = choice.describe()  # once the options hold (a shard out of range is refused)
    if chosen is not None:
        print(f"hsx dataset: {chosen}", file=sys.stderr, flush=True)
    return options


def _regenerate_of(args: argparse.Namespace) -> Any:
    """``--regenerate``'s settings, or None without it (its sampling flags then unused)."""
    if not args.regenerate:
        return None
    from service.dataset.options import RegenerateSettings

    return RegenerateSettings(
        max_tokens=args.regenerate_max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )


def _guarded(work: Any) -> int:
    from pydantic import ValidationError

    try:
        return int(work())
    except user_errors() as exc:
        if isinstance(exc, ValidationError):
            message = "; ".join(_field_error(e) for e in exc.errors())
        else:
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"hsx dataset: error: {message}", file=sys.stderr)
        return 2
    except Exception as exc:  # not the user's doing: one line, exit 1 (state may be written)
        from service.dataset.runner import describe

        print(f"hsx dataset: error: {describe(exc)}", file=sys.stderr)
        return 1


def _field_error(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else str(error["msg"])


def _s3(settings: Any, args: argparse.Namespace) -> Any:
    """The S3 settings of an output: ``HSX_STORAGE__S3__*`` (read into ``settings``, as
    for the server's objects), with ``--s3-endpoint-url`` over its endpoint."""
    s3 = settings.storage.s3
    if args.s3_endpoint_url is not None:
        s3 = s3.model_copy(update={"endpoint_url": args.s3_endpoint_url})
    return s3


def _cmd_run(settings: Any, args: argparse.Namespace) -> int:
    def work() -> int:
        from service.dataset.estimate import estimate_async
        from service.dataset.session import run_dataset_async

        options = options_of(args).model_copy(update={"s3": _s3(settings, args)})
        if args.estimate:
            print(asyncio.run(estimate_async(options)).text())
            return 0
        summary = asyncio.run(run_dataset_async(options))
        print(summary.model_dump_json(indent=2))
        return 0 if summary.complete else 1

    return _guarded(work)


def _cmd_verify(settings: Any, args: argparse.Namespace) -> int:
    def work() -> int:
        from service.dataset.verify import verify_async

        key = args.api_key or os.environ.get("HSX_API_KEY")
        checks = checks_of(args)
        report = asyncio.run(
            verify_async(args.output, args.endpoint, key, s3=_s3(settings, args), checks=checks)
        )
        print(report.text())
        return 0 if report.ok else 1

    return _guarded(work)


def _cmd_export(settings: Any, args: argparse.Namespace) -> int:
    def work() -> int:
        from service.dataset.export import export_openai_batch_async

        if args.format == "openai-batch":
            lines = asyncio.run(
                export_openai_batch_async(
                    args.output,
                    args.dest,
                    args.endpoint,
                    s3=_s3(settings, args),
                    allow_partial=args.allow_partial,
                    storage_url=args.storage_url,
                )
            )
            print(f"exported {lines} Batch API output lines to {args.dest}")
            return 0
        return _export_layout(settings, args)

    return _guarded(work)


def _export_layout(settings: Any, args: argparse.Namespace) -> int:
    from service.dataset.export_record import MANIFEST, ExportOptions
    from service.dataset.trainer_export import export_async

    options = ExportOptions(
        format=args.format,
        specforge_layout=args.specforge_layout,
        aux_layers=_ids(args.aux_layers, "--aux-layers"),
        model=args.model,
        compress=args.compress,
        vocab_map=args.vocab_map,
        api_key=args.api_key or os.environ.get("HSX_API_KEY"),
        s3=_s3(settings, args),
        allow_partial=args.allow_partial,
    )
    done = asyncio.run(export_async(args.output, args.dest, args.endpoint, options))
    line = f"exported {done.samples} samples to {args.dest}"
    if done.left_out:
        line += f" ({len(done.left_out)} rows with non-finite values left out: {MANIFEST})"
    print(line)
    return 0


def _ids(text: str | None, flag: str) -> list[int] | None:
    """A comma-separated list of ints; ValueError (exit 2) naming ``flag``."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, not {text!r}") from None
