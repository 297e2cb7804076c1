"""The options of ``hsx dataset run`` (and of :func:`service.dataset.run_dataset`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.config import S3StorageSettings
from service.masks import LossMode

if TYPE_CHECKING:  # httpx loads with the run, not with the options
    from service.client import ExtractOptions
    from service.dataset.batch_api import RunRequest


class RegenerateSettings(BaseModel):
    """``--regenerate``: each conversation's assistant turns replaced by the target's own
    answers (``regenerate`` on ``/extract``), with these sampling settings per turn."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(256, ge=1, description="Tokens each turn may generate.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0: greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = Field(0, ge=0, le=(1 << 63) - 1, description="With each row's custom_id.")


class RunOptions(BaseModel):
    """One run: an input, the endpoints that share it, where its state goes."""

    model_config = ConfigDict(extra="forbid")

    input: str = Field(description="JSONL, JSON, Parquet file or a save_to_disk directory.")
    endpoints: list[str] = Field(min_length=1, description="hsx base URLs sharing the work.")
    output: str = Field(description="Directory or s3://bucket/prefix for the run's state.")
    api_key: str | None = None
    loss: LossMode = "none"
    codec: str | None = Field(None, description="Sent as the request's codec when given.")
    layers: list[int] | None = Field(None, description="Sent as the request's layers.")
    max_tokens: int = Field(1, ge=1)
    include_output_tokens: bool = False
    regenerate: RegenerateSettings | None = Field(
        None, description="Regenerate every assistant turn (messages rows only)."
    )
    max_length: int | None = Field(
        None, ge=1, description="Longest prompt in tokens (default: the server's limit)."
    )
    on_long: Literal["skip", "truncate"] = "skip"
    concurrency: int = Field(4, ge=1, description="Requests in flight per endpoint.")
    batch_size: int = Field(8, ge=1, description="Prompts per request.")
    retries: int = Field(8, ge=0, description="Retries of a prompt after transient errors.")
    request_timeout: float = Field(
        600.0, gt=0, description="Deadline of one request, its whole answer included (s)."
    )
    max_consecutive_errors: int = Field(
        10, ge=1, description="Errors in a row after which an endpoint is dropped."
    )
    shard: tuple[int, int] | None = Field(None, description="(index, count): this shard only.")
    id_column: str = "custom_id"
    metadata: dict[str, str] = Field(default_factory=dict)
    force: bool = False
    progress: bool = True
    s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint of an s3:// output (over s3.endpoint_url)."
    )
    s3: S3StorageSettings = Field(
        default_factory=S3StorageSettings,
        description="S3 settings of an s3:// output, as the server's objects take them "
        "(the CLI reads HSX_STORAGE__S3__*): region, addressing style, retries, checksums.",
    )
    backoff_base_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _shard_in_range(self) -> RunOptions:
        if self.shard is not None:
            index, count = self.shard
            if count < 1 or not 0 <= index < count:
                raise ValueError(f"shard {index}/{count}: need 0 <= I < N")
        return self

    def endpoint_urls(self) -> list[str]:
        return [url.rstrip("/") for url in self.endpoints]

    def s3_settings(self) -> S3StorageSettings:
        """``s3`` with ``s3_endpoint_url`` in it when given."""
        if self.s3_endpoint_url is None:
            return self.s3
        return self.s3.model_copy(update={"endpoint_url": self.s3_endpoint_url})

    def extract_options(self) -> ExtractOptions:
        """Every request's fields besides its prompts."""
        from service.client import ExtractOptions

        return ExtractOptions(
            max_tokens=self.max_tokens,
            include_output_tokens=self.include_output_tokens,
            metadata=self.metadata,
            loss=self.loss,
            codec=self.codec,
            layers=self.layers,
            regenerate=None if self.regenerate is None else self.regenerate.model_dump(),
        )

    def run_request(self, model: str | None = None) -> RunRequest:
        """What every request of the run carries besides its prompt, which an OpenAI
        Batch API line's body must agree with (``model``: the served one, once known)."""
        from service.dataset.batch_api import RunRequest

        return RunRequest(
            max_tokens=self.max_tokens,
            include_output_tokens=self.include_output_tokens,
            loss=self.loss,
            codec=self.codec,
            layers=tuple(self.layers) if self.layers is not None else None,
            metadata=dict(self.metadata),
            model=model,
        )

    def shard_name(self) -> str | None:
        """The shard's directory under the output (``shard-00001-of-00004``)."""
        if self.shard is None:
            return None
        return f"shard-{self.shard[0]:05d}-of-{self.shard[1]:05d}"


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` as a pair; ValueError otherwise (``service.dataset.launch`` resolves
    ``--shard``, ``--world-size``/``--rank`` and the launcher's environment)."""
    from service.dataset.launch import parse_shard as parse

    return parse(text)
