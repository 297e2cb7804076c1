"""The start of a run: check the input, the endpoints and the output, then run.

Everything that can refuse a run happens here, before anything is written.
"""

from __future__ import annotations

import contextlib
import sys

import httpx

from service.client import AsyncHsxClient
from service.dataset.answers import CappedTransport, answer_cap
from service.dataset.endpoints import ServerInfo, probe_all
from service.dataset.inputs import open_source
from service.dataset.manifest import Fingerprint, Summary, check_fingerprint, check_provenance
from service.dataset.options import RunOptions
from service.dataset.runner import Run
from service.dataset.store import OutputError, RunStore, local_dir, write_problem


class RunError(Exception):
    """The run cannot start (bad options for these servers)."""


async def run_dataset_async(options: RunOptions) -> Summary:
    """Run (or resume) ``options``; the summary is also written to the output.

    Raises InputError, EndpointError, FingerprintMismatchError, RunError or
    OutputError before anything is written.
    """
    source = open_source(options.input, options.id_column)
    directory = local_dir(options.output)
    if directory is not None:  # before any request: a file in the way, no permission
        problem = write_problem(directory)
        if problem is not None:
            raise OutputError(f"--output {options.output}: {problem}")
    root = RunStore(options.output, options.s3_settings())
    timeout = httpx.Timeout(options.request_timeout, connect=10.0)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(root.close)
        clients = [
            await stack.enter_async_context(
                AsyncHsxClient(
                    url,
                    options.api_key,
                    timeout=timeout,
                    # no /extract answer of a batch is larger: a bigger body is refused
                    transport=CappedTransport(
                        answer_cap(options.batch_size), options.concurrency + 4
                    ),
                )
            )
            for url in options.endpoint_urls()
        ]
        info, infos, warnings = await probe_all(clients)
        for warning in warnings:
            print(
                f"hsx dataset: warning: {warning}; continuing without it",
                file=sys.stderr,
                flush=True,
            )
        fingerprint = make_fingerprint(options, info)
        # OpenAI Batch API lines must agree with the run's options and served model.
        source.expect = options.run_request(model=fingerprint.model)
        name = options.shard_name()
        store = root.child(name) if name else root
        await check_fingerprint(store, fingerprint, options.force)
        await check_provenance(store, info.card.provenance, options.force)
        answering = {i.url for i in infos}
        live = [c for c in clients if c.base_url in answering]
        return await Run(options, source, store, fingerprint, live, info.card.provenance).run()


def make_fingerprint(options: RunOptions, info: ServerInfo) -> Fingerprint:
    """The run's fingerprint from its options and what the server serves."""
    card = info.card
    limit = card.max_model_len - options.max_tokens
    if options.max_length is not None and options.max_length > limit:
        raise RunError(
            f"--max-length {options.max_length} is over the server's limit {limit} "
            f"(max_model_len {card.max_model_len} - max_tokens {options.max_tokens})"
        )
    if options.codec is not None and options.codec not in card.codecs:
        raise RunError(f"{info.url} does not offer codec {options.codec!r}")
    return Fingerprint(
        model=card.id,
        layer_ids=options.layers or card.layer_ids,
        hidden_size=card.hidden_size,
        dtype=card.dtype,
        codec=options.codec or card.default_codec,
        tokenizer_sha256=card.tokenizer_sha256,
        chat_template_sha256=card.chat_template_sha256,
        loss=options.loss,
        max_length=options.max_length or limit,
        on_long=options.on_long,
        max_tokens=options.max_tokens,
        include_output_tokens=options.include_output_tokens,
        hsx_version=info.version,
        shard=f"{options.shard[0]}/{options.shard[1]}" if options.shard else None,
        regenerate=None if options.regenerate is None else options.regenerate.model_dump(),
    )
