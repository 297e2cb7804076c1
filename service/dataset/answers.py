"""What a run accepts from a server: a bounded ``/extract`` body, and objects that are
exactly its batch's, under well-formed keys of one namespace.

A server is not trusted to be well-behaved (a proxy, a bug, a hostile host): its
answer is refused (retried like a 5xx, then ``gave_up`` with the reason, never
``ok``) when

- its body is larger than anything hsx answers for the batch (:func:`answer_cap`),
  as :class:`AnswerTooLargeError`: a ``Content-Length`` over the cap before any byte
  of the body is read, a body without one once the cap is passed
  (:class:`CappedTransport`);
- it answers a prompt twice (two objects with one ``index``, or one key for two
  prompts), as ``bad_response``, or
- a key is not an hsx object key (``service.storage.keys.validate_key``: no ``..``,
  no absolute path; then ``.../NAMESPACE/by-id/HH/ID.safetensors``, as a prompt with
  a ``custom_id`` gets, or a dated ``.../NAMESPACE/YYYY/MM/DD/ID.safetensors``), or
  lies outside the run's namespace: the ``{prefix}/{namespace}`` of the run's first
  object (a run sends one API key, so all its objects share one).

A prompt an answer leaves out is the runner's concern (sent again, as an attempt).
The whole-answer deadline (``--request-timeout``) is the runner's too: httpx's
timeout bounds each read, not a body trickled a byte at a time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from service.client import BadResponseError
from service.client.models import ExtractResponse, StoredObject
from service.storage.errors import InvalidKeyError
from service.storage.keys import BY_ID, OBJECT_SUFFIX, validate_key, validate_namespace

#: Bytes of one prompt's entry in an answer, generously: hsx's is ~1 kB plus ~0.2 kB
#: per layer of statistics (a 128-layer model: ~30 kB), a mooncake transfer
#: manifest ~1 kB. 64 kB leaves room for longer keys and new fields.
BYTES_PER_PROMPT = 64 * 1024


def answer_cap(prompts: int) -> int:
    """The most bytes an ``/extract`` answer for ``prompts`` stored prompts may hold
    (one prompt's worth more for the answer's own fields, or an error body)."""
    return BYTES_PER_PROMPT * (prompts + 1)


class AnswerTooLargeError(httpx.RemoteProtocolError):
    """An ``/extract`` body larger than :func:`answer_cap` allows (an ``httpx`` error:
    the runner retries it like a connection that broke)."""


class CappedTransport(httpx.AsyncBaseTransport):
    """A client's transport whose ``/extract`` answers have their bodies cut at ``cap``
    bytes; the rest (connection pool, proxies from the environment) is httpx's own, as
    an ``AsyncClient`` without a transport of its own has it."""

    def __init__(self, cap: int, max_connections: int | None = None) -> None:
        limits = httpx.Limits(max_connections=max_connections)
        self.inner = httpx.AsyncClient(limits=limits)
        self.cap = cap

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; the answer of ``POST /extract`` comes with a capped body.

        Raises :class:`AnswerTooLargeError` when its ``Content-Length`` is over the cap.
        """
        response = await self.inner.send(request, stream=True)
        if not request.url.path.endswith("/extract"):
            return response  # objects (GET /objects/KEY) are as large as their states
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > self.cap:
            await response.aclose()
            raise AnswerTooLargeError(
                f"answer of {int(declared)} bytes (Content-Length) is over the cap of "
                f"{self.cap} bytes for this request",
                request=request,
            )
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_CappedStream(response, self.cap),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


class _CappedStream(httpx.AsyncByteStream):
    """A response's raw body that raises once more than ``cap`` bytes have come."""

    def __init__(self, response: httpx.Response, cap: int) -> None:
        self.response, self.cap = response, cap

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self.response.aiter_raw():
            seen += len(chunk)
            if seen > self.cap:
                raise AnswerTooLargeError(
                    f"answer over the cap of {self.cap} bytes for this request (stopped reading)",
                    request=self.response.request,
                )
            yield chunk

    async def aclose(self) -> None:
        await self.response.aclose()


def key_root(key: str) -> str:
    """``{prefix}/{namespace}`` of an hsx object key (``.../NAMESPACE/by-id/HH/ID``, a
    prompt with a ``custom_id``, or ``.../NAMESPACE/YYYY/MM/DD/ID``, ``.safetensors``);
    ValueError saying what is wrong with any other string."""
    try:
        validate_key(key)
    except InvalidKeyError as exc:
        raise ValueError(str(exc)) from None
    parts = key.split("/")
    if len(parts) >= 4 and parts[-3] == BY_ID:
        namespace = len(parts) - 4
    elif len(parts) >= 5 and all(p.isdigit() for p in parts[-4:-1]):
        namespace = len(parts) - 5
    else:
        namespace = -1
    if namespace < 0 or not parts[-1].endswith(OBJECT_SUFFIX):
        raise ValueError(
            f"not .../NAMESPACE/{BY_ID}/HH/ID{OBJECT_SUFFIX} (nor .../NAMESPACE/YYYY/MM/DD/ID)"
        )
    validate_namespace(parts[namespace])
    return "/".join(parts[: namespace + 1])


class AnswerCheck:
    """The run's checks of a 200's objects; remembers the run's namespace."""

    def __init__(self, root: str | None = None) -> None:
        #: ``{prefix}/{namespace}`` of every object of the run (None: not seen yet).
        self.root = root

    def objects(self, answer: ExtractResponse, status: int = 200) -> dict[int, StoredObject]:
        """The answer's objects by prompt index; :class:`BadResponseError` naming the
        first object that answers a prompt twice or whose key is not the run's. The
        run's namespace is taken from the first answer that passes."""
        by_index: dict[int, StoredObject] = {}
        by_key: dict[str, int] = {}
        roots: dict[str, int] = {}
        for number, obj in enumerate(answer.objects):
            if obj.index in by_index:
                raise BadResponseError(status, f"{status} answering prompt {obj.index} twice")
            if obj.key in by_key:
                raise BadResponseError(
                    status, f"{status} with one key for prompts {by_key[obj.key]} and {obj.index}"
                )
            roots.setdefault(self.root_of(status, number, obj.key), number)
            by_index[obj.index], by_key[obj.key] = obj, obj.index
        if len(roots) > 1:
            (first, _), (other, number) = list(roots.items())[:2]
            raise BadResponseError(
                status, f"{status} whose objects[{number}] is in {other}/, not {first}/"
            )
        if self.root is None and roots:
            self.root = next(iter(roots))  # the run's first answer names its namespace
        return by_index

    def root_of(self, status: int, number: int, key: str) -> str:
        """The key's ``{prefix}/{namespace}``, which must be the run's once it has one."""
        where = f"{status} whose objects[{number}].key {_short(key)}"
        try:
            root = key_root(key)
        except ValueError as exc:
            raise BadResponseError(status, f"{where} is not an hsx object key: {exc}") from None
        if self.root is not None and root != self.root:
            raise BadResponseError(status, f"{where} is outside the run's {self.root}/")
        return root


def first_root(keys: list[str]) -> str | None:
    """The namespace of the first well-formed key (an earlier session's objects)."""
    for key in keys:
        try:
            return key_root(key)
        except ValueError:
            continue
    return None


def _short(text: str) -> str:
    """``text`` quoted, cut at 120 characters: enough for hsx's keys, not a 1 MB string."""
    return repr(text if len(text) <= 120 else text[:117] + "...")
