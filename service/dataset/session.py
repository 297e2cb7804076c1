"""The start of a run: check the input, the endpoints and the output, then run.

Everything that can refuse a run happens here, before anything is written.
"""

from __future__ import annotations

import sys

import httpx

from service.dataset.endpoints import ServerInfo, auth_headers, probe_all
from service.dataset.inputs import open_source
from service.dataset.manifest import Fingerprint, Summary, check_fingerprint
from service.dataset.options import RunOptions
from service.dataset.runner import Run
from service.dataset.store import LocalStore, OutputError, open_store, write_problem


class RunError(Exception):
    """The run cannot start (bad options for these servers)."""


async def run_dataset_async(options: RunOptions) -> Summary:
    """Run (or resume) ``options``; the summary is also written to the output.

    Raises InputError, EndpointError, FingerprintMismatchError, RunError or
    OutputError before anything is written.
    """
    source = open_source(options.input, options.id_column)
    root = open_store(options.output, options.s3_endpoint_url)
    if isinstance(root, LocalStore):  # before any request: a file in the way, no permission
        problem = write_problem(root.root)
        if problem is not None:
            raise OutputError(f"--output {options.output}: {problem}")
    timeout = httpx.Timeout(options.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=options.concurrency * len(options.endpoints) + 4)
    async with httpx.AsyncClient(
        headers=auth_headers(options.api_key), timeout=timeout, limits=limits
    ) as client:
        info, infos, warnings = await probe_all(client, options.endpoint_urls())
        for warning in warnings:
            print(
                f"hsx dataset: warning: {warning}; continuing without it",
                file=sys.stderr,
                flush=True,
            )
        fingerprint = make_fingerprint(options, info)
        name = options.shard_name()
        store = root.child(name) if name else root
        check_fingerprint(store, fingerprint, options.force)
        run = Run(options, source, store, fingerprint, client, [i.url for i in infos])
        return await run.run()


def make_fingerprint(options: RunOptions, info: ServerInfo) -> Fingerprint:
    """The run's fingerprint from its options and what the server serves."""
    limit = info.max_model_len - options.max_tokens
    if options.max_length is not None and options.max_length > limit:
        raise RunError(
            f"--max-length {options.max_length} is over the server's limit {limit} "
            f"(max_model_len {info.max_model_len} - max_tokens {options.max_tokens})"
        )
    if options.codec is not None and options.codec not in info.extra.get("codecs", ["raw"]):
        raise RunError(f"{info.url} does not offer codec {options.codec!r}")
    return Fingerprint(
        model=info.model,
        layer_ids=options.layers or info.layer_ids,
        hidden_size=info.hidden_size,
        dtype=info.dtype,
        codec=options.codec or info.default_codec,
        tokenizer_sha256=info.tokenizer_sha256,
        chat_template_sha256=info.chat_template_sha256,
        loss=options.loss,
        max_length=options.max_length or limit,
        on_long=options.on_long,
        max_tokens=options.max_tokens,
        include_output_tokens=options.include_output_tokens,
        hsx_version=info.version,
        shard=f"{options.shard[0]}/{options.shard[1]}" if options.shard else None,
    )
