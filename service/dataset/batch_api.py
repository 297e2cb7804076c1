"""OpenAI Batch API lines as dataset rows, and a run's objects as Batch API output lines.

Input: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}``, the format of ``vllm run-batch``, llm-d's batch
gateway and OpenAI's batch tooling. A line becomes the row the dataset already
supports (``messages``, ``text`` or ``token_ids``, with the line's ``custom_id``), so
the dataset sends hsx the request that row sends; its object is the one the same body
sent to hsx's ``/v1`` route gives (same token ids, same options). Hence the body is
read as that route reads it:

- the prompt: chat ``messages`` (roles ``system``, ``user``, ``assistant``, ``tool``;
  text content, parts joined with newlines as vLLM's renderer joins them), or the
  completion's ``prompt`` (one text or one list of token ids);
- the render: ``/extract`` opens the assistant's turn unless the conversation ends
  with it, so ``add_generation_prompt`` must say the same (its default, true, for a
  conversation ending with the user; false for one ending with the assistant);
  ``continue_final_message``, ``tools``, ``chat_template``, template kwargs,
  ``add_special_tokens`` other than the route's default, ``suffix`` and
  ``truncate_prompt_tokens`` change the tokens and have no ``/extract`` equivalent;
- the run's options, shared by every line (:class:`RunRequest`): ``model`` (when the
  run knows the served one), ``max_tokens``/``max_completion_tokens``, and hsx's extra
  fields ``codec``, ``layers``, ``loss``, ``include_output_tokens``, ``metadata``,
  ``tokens``, ``return``, ``custom_id``: each must be absent or agree with the run;
- what the route refuses (sampling, streaming, logprobs: ``REFUSALS`` of
  ``service.api.openai_protocol``) unless neutral, as the route does;
- what changes only the answer, never the object (``seed``, ``top_p``, ``user``,
  ``return_token_ids``...): accepted and left out;
- anything else: refused, named, never dropped silently.

A line that cannot be read this way is a malformed row whose reason names the row,
its ``custom_id`` and the field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
#: The top-level fields of a Batch API input line.
LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
#: Roles ``/extract`` renders (its ``Message``); a Batch line's others are refused.
ROLES = frozenset({"system", "user", "assistant", "tool"})
#: max_tokens the route uses when the body gives none (vLLM's 16 for completions).
DEFAULT_MAX_TOKENS = {CHAT_URL: 1, COMPLETIONS_URL: 16}


def _absent(value: Any) -> bool:
    return value in (None, False, [], {}, "")


_GREEDY = "hsx generates greedily and cannot honour it"
#: Fields a Batch line may not set though the routes take them: a line's answer is one
#: output row, as in OpenAI's Batch API, which refuses ``stream`` too.
BATCH_ONLY = frozenset({"stream"})
#: Fields the OpenAI routes refuse unless neutral, with the route's reason
#: (``service.api.openai_protocol.REFUSALS``; a test keeps the two lists alike), and
#: ``BATCH_ONLY``'s.
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (_absent, "a Batch line is answered whole, as one output row: no streaming"),
    "n": (lambda v: v in (None, 1), "one choice per prompt only"),
    "best_of": (lambda v: v in (None, 1), "one choice per prompt only"),
    "use_beam_search": (_absent, "beam search is not offered"),
    "logprobs": (_absent, "logprobs are not computed"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not computed"),
    "prompt_logprobs": (lambda v: v is None, "prompt logprobs are not computed"),
    "echo": (_absent, "echo is not offered"),
    "prompt_embeds": (_absent, "hidden states need token ids, not embeddings"),
    "kv_transfer_params": (lambda v: v is None, "set by the server only"),
    "ec_transfer_params": (lambda v: v is None, "set by the server only"),
    "temperature": (lambda v: v in (None, 0), _GREEDY),
    "presence_penalty": (lambda v: v in (None, 0), _GREEDY),
    "frequency_penalty": (lambda v: v in (None, 0), _GREEDY),
    "repetition_penalty": (lambda v: v in (None, 1), _GREEDY),
    "logit_bias": (_absent, _GREEDY),
    "bad_words": (_absent, _GREEDY),
    "allowed_token_ids": (_absent, _GREEDY),
    "stop": (_absent, _GREEDY),
    "stop_token_ids": (_absent, _GREEDY),
    "min_tokens": (lambda v: v in (None, 0), _GREEDY),
    "ignore_eos": (_absent, _GREEDY),
    "structured_outputs": (lambda v: v is None, _GREEDY),
    "response_format": (
        lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
        _GREEDY,
    ),
}
#: Fields that shape only the answer or the scheduling, never the prompt's tokens or
#: the object (the route accepts them; the dataset's answer is the object alone).
ANSWER_ONLY = frozenset(
    {
        "seed", "top_p", "top_k", "min_p", "length_penalty", "watermarking",
        "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
        "user", "priority", "request_id", "session_id", "return_tokens_as_token_ids",
        "return_token_ids", "return_token_offsets", "return_prompt_text", "logprob_token_ids",
        "stream_options", "parallel_tool_calls", "include_reasoning", "thinking_token_budget",
        "repetition_detection", "stream_interval", "cache_salt", "routed_experts_prompt_start",
        "mm_payload", "return_mm_kwargs", "store", "service_tier", "prompt_cache_key",
        "safety_identifier",
    }
)  # fmt: skip
#: Fields that change the rendered tokens and that ``/extract`` cannot express: only
#: their neutral value (the route's default) is accepted.
RENDER_ONLY_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "tools": _absent,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "documents": _absent,
    "chat_template": _absent,
    "chat_template_kwargs": _absent,
    "mm_processor_kwargs": _absent,
    "media_io_kwargs": _absent,
    "reasoning_effort": lambda v: v is None,
    "truncate_prompt_tokens": lambda v: v is None,
    "truncation_side": lambda v: True,  # only with truncate_prompt_tokens
    "suffix": _absent,
    "vllm_xargs": _absent,
}
#: Each route's other fields, read below.
CHAT_FIELDS = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "add_special_tokens"}
)
COMPLETION_FIELDS = frozenset({"prompt", "add_special_tokens"})
RUN_FIELDS = frozenset(
    {"model", "max_tokens", "max_completion_tokens", "codec", "layers", "loss"}
    | {"include_output_tokens", "metadata", "tokens", "return", "custom_id"}
)


@dataclass(frozen=True)
class RunRequest:
    """The fields every request of a run carries besides its prompt (``RunOptions``'),
    which a Batch line's body must agree with; ``model`` None: not checked (the served
    model is known once the run has asked its endpoints)."""

    max_tokens: int = 1
    include_output_tokens: bool = False
    loss: str = "none"
    codec: str | None = None
    layers: tuple[int, ...] | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    model: str | None = None


def is_batch_line(raw: Mapping[str, Any]) -> bool:
    """A row in the Batch API's input shape (``url`` and ``body``, no prompt column)."""
    return raw.get("url") is not None and raw.get("body") is not None


def batch_prompt(raw: Mapping[str, Any], run: RunRequest) -> dict[str, Any]:
    """The dataset prompt of a Batch line (``messages``, ``text`` or ``token_ids``).

    Raises ValueError naming the field that cannot be read as the route reads it.
    """
    extra = sorted(k for k, v in raw.items() if k not in LINE_FIELDS and v is not None)
    if extra:
        raise ValueError(f"fields {extra} are not in a Batch API line ({sorted(LINE_FIELDS)})")
    method = raw.get("method")
    if not isinstance(method, str) or method.upper() != "POST":
        raise ValueError(f"method {method!r}: only POST")
    url = raw["url"]
    if url not in URLS:
        raise ValueError(f"url {url!r}: hsx extracts from {CHAT_URL} or {COMPLETIONS_URL} only")
    body = raw["body"]
    if not isinstance(body, dict):
        raise ValueError(f"body must be an object, not {type(body).__name__}")
    body = {k: v for k, v in body.items() if v is not None}  # JSON null: the default
    own = CHAT_FIELDS if url == CHAT_URL else COMPLETION_FIELDS
    for name, value in body.items():
        if name in own or name in RUN_FIELDS or name in ANSWER_ONLY:
            continue
        if name in REFUSED:
            neutral, reason = REFUSED[name]
            if not neutral(value):
                raise ValueError(f"body.{name}: {reason}")
        elif name in RENDER_ONLY_NEUTRAL:
            if not RENDER_ONLY_NEUTRAL[name](value):
                raise ValueError(
                    f"body.{name}: changes the rendered tokens, and hsx dataset's "
                    "request has no equivalent"
                )
        else:
            raise ValueError(f"body.{name}: unknown to {url}; hsx dataset does not drop fields")
    _check_run_fields(body, url, run, str(raw.get("custom_id")))
    return _chat(body) if url == CHAT_URL else _completion(body)


def _check_run_fields(body: dict[str, Any], url: str, run: RunRequest, custom_id: str) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("body.model must be a string")
    if model is not None and run.model is not None and model != run.model:
        raise ValueError(f"body.model {model!r}: the endpoints serve {run.model!r}")
    given = [n for n in ("max_completion_tokens", "max_tokens") if n in body]
    if given:
        name = given[0]
        value = body[name]
        if type(value) is not int or value < 1:
            raise ValueError(f"body.{name} must be an integer >= 1")
        if value != run.max_tokens:
            raise ValueError(
                f"body.{name} {value} differs from the run's --max-tokens {run.max_tokens} "
                f"(every line of a run shares it: run with --max-tokens {value})"
            )
    elif run.include_output_tokens and DEFAULT_MAX_TOKENS[url] != run.max_tokens:
        default = DEFAULT_MAX_TOKENS[url]
        raise ValueError(
            f"body.max_tokens is absent ({url} generates {default}) and the run stores "
            f"output tokens with --max-tokens {run.max_tokens}: give max_tokens"
        )
    loss = body.get("loss", "none")
    if url == COMPLETIONS_URL and loss not in ("none", "all"):
        raise ValueError(f"body.loss {loss!r} needs a chat request; a completion takes 'all'")
    _same(body, "loss", "none", run.loss, f"--loss {run.loss}")
    outputs = ("" if run.include_output_tokens else "no ") + "--include-output-tokens"
    _same(body, "include_output_tokens", False, run.include_output_tokens, outputs)
    codec = "--codec " + run.codec if run.codec else "no --codec (the server's default)"
    _same(body, "codec", None, run.codec, codec)
    layers = body.get("layers")
    wanted = list(run.layers) if run.layers is not None else None
    if layers != wanted:
        flag = "--layers " + ",".join(map(str, wanted)) if wanted else "no --layers (all)"
        raise ValueError(f"body.layers {layers!r} differs from the run's {flag}")
    _same(body, "metadata", {}, dict(run.metadata), f"metadata {dict(run.metadata)}")
    if body.get("tokens", "all") != "all":
        raise ValueError("body.tokens: hsx dataset stores every token; only 'all'")
    if body.get("return", "storage") != "storage":
        raise ValueError("body.return: hsx dataset stores objects; only 'storage'")
    if "custom_id" in body and body["custom_id"] != custom_id:
        raise ValueError(f"body.custom_id {body['custom_id']!r} is not the line's custom_id")


def _same(body: dict[str, Any], name: str, default: Any, wanted: Any, flag: str) -> None:
    value = body.get(name, default)
    if value != wanted or type(value) is not type(wanted):
        raise ValueError(f"body.{name} {value!r} differs from the run's {flag}")


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("body.messages must be a non-empty list of messages")
    out = [_message(number, message) for number, message in enumerate(messages)]
    if body.get("add_special_tokens", False) is not False:
        raise ValueError("body.add_special_tokens: the chat template writes special tokens")
    if body.get("continue_final_message", False) is not False:
        raise ValueError(
            "body.continue_final_message: hsx dataset stores a final assistant turn whole"
        )
    ends_open = out[-1]["role"] != "assistant"
    opened = body.get("add_generation_prompt", True)
    if opened is not ends_open:
        if ends_open:
            raise ValueError(
                "body.add_generation_prompt false: /extract opens the assistant's turn after "
                f"a conversation ending with {out[-1]['role']!r}"
            )
        raise ValueError(
            "body.add_generation_prompt: the conversation ends with the assistant, which "
            "/extract stores as is; the route would open another assistant turn unless "
            "add_generation_prompt is false (set it)"
        )
    return {"messages": out}


def _message(number: int, message: Any) -> dict[str, str]:
    where = f"body.messages[{number}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or dict is not hashable
        raise ValueError(f"{where}.role {_short(role)}: one of {sorted(ROLES)}")
    others = sorted(k for k, v in message.items() if k not in ("role", "content") and v is not None)
    if others:
        raise ValueError(f"{where}: {others} have no /extract equivalent (role, content only)")
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        strings = [t for t in texts if isinstance(t, str)]
        if not content or len(strings) != len(content):
            raise ValueError(f"{where}.content: text parts only")
        content = "\n".join(strings)  # as vLLM's renderer joins them
    if not isinstance(content, str):
        raise ValueError(f"{where}.content must be text")
    return {"role": role, "content": content}


def _completion(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("add_special_tokens", True) is not True:
        raise ValueError("body.add_special_tokens false: /extract tokenises text with them")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ValueError(
                f"body.prompt holds {len(prompt)} prompts; one per line (one object per row)"
            )
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return {"text": prompt}
    if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        return {"token_ids": list(prompt)}
    raise ValueError("body.prompt must be a non-empty text or list of token ids")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any) -> str:
    """``repr(value)`` cut to 80 characters: a reason names the value, not all of it."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------- output


def storage_uri(storage_url: str, key: str) -> str:
    """The URI the server's storage gives ``key`` (``Storage.uri``), from its
    ``HSX_STORAGE__URL``: ``s3://bucket/prefix/key``, ``file:///root/key``,
    ``mooncake://host:port/key``."""
    from pathlib import Path

    if "://" in storage_url and not storage_url.startswith("file://"):
        return f"{storage_url.rstrip('/')}/{key}"
    root = storage_url.removeprefix("file://")
    return (Path(root).resolve() / key).as_uri()


def transfer_params(record: Any, codec: str, uri: str, local: bool) -> dict[str, Any]:
    """``kv_transfer_params`` of an ``ok`` manifest record, as hsx's OpenAI routes answer
    them (``hidden_states_path`` only where the storage gives a path or an S3 URI)."""
    params: dict[str, Any] = {}
    if local:
        from urllib.parse import unquote, urlparse

        parsed = urlparse(uri)
        params["hidden_states_path"] = unquote(parsed.path) if parsed.scheme == "file" else uri
    params |= {
        "handle": record.key,
        "key": record.key,
        "uri": uri,
        "num_tokens": record.num_tokens,
        "bytes": record.bytes,
        "sha256": record.sha256,
        "codec": codec,
        "num_loss_tokens": record.num_loss_tokens,
    }
    return params


def object_url(endpoint: str, key: str) -> str:
    """Where hsx serves the object (``GET /objects/{key}``)."""
    return f"{endpoint.rstrip('/')}/objects/{quote(key)}"


def output_line(
    custom_id: str, record: Any, model: str, params: dict[str, Any] | None
) -> dict[str, Any]:
    """One Batch API output line: the response for an ``ok`` record (``params``), else
    the error with the record's reason."""
    digest = hashlib.sha256(f"{custom_id}\0{record.key or record.reason}".encode()).hexdigest()
    line: dict[str, Any] = {"id": f"batch_req_{digest[:32]}", "custom_id": custom_id}
    if params is None:
        reason = record.reason or record.status
        code = reason.split(":", 1)[0].strip() or record.status
        line["response"] = None
        line["error"] = {"code": code, "message": reason}
        return line
    body = {
        "id": f"hsx-{digest[:32]}",
        "object": "hsx.extraction",
        "model": model,
        "kv_transfer_params": params,
    }
    line["response"] = {"status_code": 200, "request_id": body["id"], "body": body}
    line["error"] = None
    return line


def dumps_line(line: dict[str, Any]) -> str:
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"
