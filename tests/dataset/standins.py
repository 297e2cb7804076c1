"""Scripted hsx stand-ins on 127.0.0.1: real HTTP, answers chosen by the test, so the
dataset runner meets faults a real server produces only by chance."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: (status, headers, body): a JSON-able body, bytes sent as they are, or a
#: :class:`Trickled` or :class:`Flood` body (a hostile server's).
Reply = tuple[int, dict[str, str], Any]


@dataclass(frozen=True)
class Trickled:
    """A body announced whole (``Content-Length``) and sent a byte every ``every_s``
    seconds: each read is in time, the whole answer never is."""

    data: bytes
    every_s: float = 1.0


@dataclass(frozen=True)
class Flood:
    """``size`` bytes of filler, announced by ``Content-Length`` when ``declared``, else
    sent until the client hangs up (an HTTP/1.0 body ends when the connection does)."""

    size: int
    declared: bool = True


MODEL = {
    "id": "tiny",
    "object": "model",
    "layer_ids": [1, 2],
    "hidden_size": 4,
    "dtype": "float32",
    "max_model_len": 64,
    "storage_backend": "file",
    "codecs": ["raw"],
    "default_codec": "raw",
}


def stored(body: dict[str, Any]) -> Reply:
    """What hsx answers when every prompt's object is durable."""
    objects = []
    for index, prompt in enumerate(body["prompts"]):
        ids = prompt["token_ids"]
        digest = hashlib.sha256(prompt["custom_id"].encode()).hexdigest()
        objects.append(
            {"index": index, "key": f"hsx/t/by-id/{digest[:2]}/{digest}.safetensors",
             "uri": "file:///x", "num_tokens": len(ids), "shape": [len(ids), 2, 4],
             "bytes": 100 + len(ids), "sha256": digest, "status": "created"}
        )  # fmt: skip
    tokens = sum(o["num_tokens"] for o in objects)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    served = {name: MODEL[name] for name in ("layer_ids", "dtype", "hidden_size", "codecs")}
    answer = {"id": "ext-standin", "model": MODEL["id"], **served, "objects": objects}
    answer["usage"] = usage
    return 200, {}, answer


def size_of(body: Trickled | Flood) -> int:
    return len(body.data) if isinstance(body, Trickled) else body.size


def pieces(body: Trickled | Flood) -> Iterator[bytes]:
    """A trickle byte by byte; a flood 64 kB at a time."""
    if isinstance(body, Trickled):
        for at in range(len(body.data)):
            yield body.data[at : at + 1]
        return
    for at in range(0, body.size, 64 * 1024):
        yield b" " * min(64 * 1024, body.size - at)


class QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-answer (a run stopping) is not the test's stderr."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class Scripted:
    """An hsx stand-in on 127.0.0.1 whose /extract answers come from ``script``."""

    def __init__(self, script: Callable[[dict[str, Any]], Reply]) -> None:
        self.script = script
        self.bodies: list[dict[str, Any]] = []
        self.tokenized: list[dict[str, Any]] = []
        self.objects: dict[str, bytes] = {}
        #: The ``GET /v1/models`` card (a test may add provenance, change the model).
        self.model: dict[str, Any] = dict(MODEL)
        self.tokenize: Callable[[dict[str, Any]], Reply] = lambda body: (404, {}, {})
        #: Body bytes of Trickled and Flood answers written before the client hung up
        #: (the kernel's socket buffers take a few MB of them unread).
        self.streamed = 0
        self.closing = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/objects/"):
                    data = owner.objects.get(self.path.removeprefix("/objects/"))
                    if data is None:
                        self.reply(404, {}, {"error": {"type": "not_found"}})
                        return
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif self.path == "/v1/models":
                    self.reply(200, {}, {"object": "list", "data": [owner.model]})
                else:
                    self.reply(200, {}, {"version": "0.1.0", "vllm": "0.32.0"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":  # vLLM's shape: {"model", "prompt"|"messages"}
                    owner.tokenized.append(body)
                    self.reply(*owner.tokenize(body))
                    return
                owner.bodies.append(body)
                self.reply(*owner.script(body))

            def reply(self, status: int, headers: dict[str, str], body: Any) -> None:
                if isinstance(body, Trickled | Flood):
                    self.stream(status, body)
                    return
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def stream(self, status: int, body: Trickled | Flood) -> None:
                """The body in pieces, until it ends, the client hangs up, or the
                stand-in closes."""
                trickled = isinstance(body, Trickled)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if trickled or body.declared:
                    self.send_header("Content-Length", str(size_of(body)))
                self.end_headers()
                try:
                    for piece in pieces(body):
                        if owner.closing.is_set():
                            break
                        self.wfile.write(piece)
                        self.wfile.flush()
                        owner.streamed += len(piece)
                        if isinstance(body, Trickled):  # the fault: a byte a second
                            owner.closing.wait(body.every_s)
                except OSError:  # the client hung up
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def prompts(self) -> int:
        return sum(len(b["prompts"]) for b in self.bodies)

    def close(self) -> None:
        self.closing.set()  # a trickle still being sent stops
        self.server.shutdown()
        self.server.server_close()
