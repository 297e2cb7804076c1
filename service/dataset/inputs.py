"""Input rows: readers for JSONL, JSON, Parquet and ``save_to_disk`` directories, and the
normalisation of each row into one ``/extract`` prompt.

A row becomes a :class:`Row`: its position in the file, its ``custom_id`` (the row's
``custom_id`` column, or ``row-`` + the SHA-256 of its canonical JSON, so the same
content keeps its id across runs and reorderings) and either a prompt or the reason it
is malformed. Conversations come as OpenAI ``messages`` or ShareGPT ``conversations``
(``from``/``value``), mapped as speculators' ``prepare-data`` maps them: ``human`` ->
``user``, ``gpt`` -> ``assistant``, unknown speakers -> ``assistant``. Text that cannot be
sent as UTF-8 (a lone surrogate such as ``"\\ud800"``, valid JSON and common in scraped
dumps) makes its row malformed here, before any request is built. OpenAI Batch API
lines (``custom_id``, ``method``, ``url``, ``body``) become the same rows
(``service.dataset.batch_api``), checked against the run's request options.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.dataset.batch_api import RunRequest, batch_prompt, is_batch_line

#: Columns that hold a prompt, in the order they are looked for.
PROMPT_COLUMNS = ("messages", "conversations", "token_ids", "text")
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant"}
ROLES |= {"gpt": "assistant", "tool": "tool"}
MAX_CUSTOM_ID = 256
#: Rows looked at before an input without any prompt column is refused.
PEEK_ROWS = 100


class InputError(Exception):
    """The input cannot be used at all (unreadable, unknown format or columns)."""


@dataclass(frozen=True)
class Row:
    """One input row, ready to send or already known to be malformed."""

    index: int
    custom_id: str
    prompt: dict[str, Any] | None = None
    error: str | None = None

    @property
    def num_tokens(self) -> int | None:
        """Token count when the row carries token ids (else the server counts)."""
        ids = (self.prompt or {}).get("token_ids")
        return len(ids) if ids is not None else None


def content_id(raw: Any) -> str:
    """The id of a row without ``custom_id``: a hash of its canonical JSON."""
    text = json.dumps(raw, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    # surrogatepass: a row holding a lone surrogate still gets an id (valid text is unchanged)
    return "row-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def shard_of(custom_id: str, shards: int) -> int:
    """The shard a ``custom_id`` belongs to (a stable hash, same on every machine)."""
    return int(hashlib.sha256(custom_id.encode()).hexdigest()[:16], 16) % shards


# ---------------------------------------------------------------- normalisation


def normalise(
    index: int, raw: Any, id_column: str = "custom_id", run: RunRequest | None = None
) -> Row:
    """The row at ``index`` as a prompt, or a malformed row with its reason.

    A Batch API line is read as its route reads its body; ``run``: the options the
    run's requests carry, which the line's body must agree with (default: RunOptions').
    """
    if not isinstance(raw, dict):
        return Row(
            index, content_id(raw), error=f"malformed: a row must be an object, not {_kind(raw)}"
        )
    if is_batch_line(raw):
        return _batch_row(index, raw, run or RunRequest())
    custom_id = raw.get(id_column)
    if custom_id is None:
        custom_id = content_id(raw)
    elif not isinstance(custom_id, str | int) or not 0 < len(str(custom_id)) <= MAX_CUSTOM_ID:
        return Row(index, content_id(raw), error=f"malformed: {id_column} must be 1-256 characters")
    custom_id = str(custom_id)
    problem = not_utf8(custom_id)
    if problem is not None:
        return Row(index, content_id(raw), error=f"malformed: {id_column} {problem}")
    try:
        prompt = _prompt(raw)
    except ValueError as exc:
        return Row(index, custom_id, error=f"malformed: {exc}")
    return Row(index, custom_id, prompt=prompt)


def _batch_row(index: int, raw: dict[str, Any], run: RunRequest) -> Row:
    """A Batch API line: its ``custom_id`` (required there) and its body's prompt."""
    custom_id = raw.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        reason = f"Batch API line without a custom_id of 1-{MAX_CUSTOM_ID} characters"
        return Row(index, content_id(raw), error=f"malformed: row {index}: {reason}")
    where = f"row {index} (custom_id {custom_id!r})"
    problem = not_utf8(custom_id)
    if problem is not None:
        return Row(index, content_id(raw), error=f"malformed: {where}: custom_id {problem}")
    try:
        prompt = batch_prompt(raw, run)
        texts = {"body.prompt": prompt.get("text", "")}
        for number, message in enumerate(prompt.get("messages", [])):
            texts[f"body.messages[{number}].content"] = message["content"]
        for name, text in texts.items():
            problem = not_utf8(text)
            if problem is not None:
                raise ValueError(f"{name} {problem}")
    except ValueError as exc:
        return Row(index, custom_id, error=f"malformed: {where}: {exc}")
    return Row(index, custom_id, prompt=prompt)


def _prompt(raw: dict[str, Any]) -> dict[str, Any]:
    present = [name for name in PROMPT_COLUMNS if raw.get(name) is not None]
    if not present:
        raise ValueError(f"no prompt column (one of {', '.join(PROMPT_COLUMNS)})")
    if len(present) > 1:
        raise ValueError(f"more than one prompt column: {', '.join(present)}")
    name = present[0]
    value = raw[name]
    if name in ("messages", "conversations"):
        return {"messages": _messages(value, name)}
    if name == "token_ids":
        if not isinstance(value, list) or not value or not all(_is_token(t) for t in value):
            raise ValueError("token_ids must be a non-empty list of non-negative integers")
        return {"token_ids": [int(t) for t in value]}
    if not isinstance(value, str) or not value:
        raise ValueError("text must be a non-empty string")
    problem = not_utf8(value)
    if problem is not None:
        raise ValueError(f"text {problem}")
    return {"text": value}


def _messages(value: Any, column: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{column} must be a non-empty list of turns")
    out = []
    for number, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise ValueError(f"{column}[{number}] must be an object, not {_kind(turn)}")
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if not isinstance(role, str) or not role:
            raise ValueError(f"{column}[{number}] has no role (role or from)")
        text = _text(content, column, number)
        problem = not_utf8(text)
        if problem is not None:
            raise ValueError(f"{column}[{number}] content {problem}")
        out.append({"role": ROLES.get(role, "assistant"), "content": text})
    return out


def _text(content: Any, column: str, number: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text parts only
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        if len(parts) == len(content) and all(isinstance(p, str) for p in parts):
            return "".join(str(p) for p in parts)
    raise ValueError(f"{column}[{number}] content must be text (content or value)")


def not_utf8(text: str) -> str | None:
    """Why ``text`` cannot be sent as UTF-8 (a lone surrogate, which JSON allows), or None."""
    if text.isascii():
        return None
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return (
            f"is not valid UTF-8: a lone surrogate U+{ord(text[exc.start]):04X} "
            f"at character {exc.start}"
        )
    return None


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value: Any) -> str:
    return type(value).__name__


# ---------------------------------------------------------------- readers


class Source:
    """A readable input: rows in file order, and how many there are."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.format = detect_format(path)
        #: What the run's requests carry besides the prompt, which Batch API lines must
        #: agree with (set by the run once it knows its served model; None: RunOptions'
        #: defaults, and the model unchecked).
        self.expect: RunRequest | None = None

    def rows(self) -> Iterator[Any]:
        """The raw rows (dicts; a JSONL line that is not JSON yields ``_Unparsable``)."""
        if self.format == "jsonl":
            yield from _jsonl(self.path)
        elif self.format == "json":
            yield from _json(self.path)
        elif self.format == "parquet":
            yield from _parquet(self.path)
        else:
            yield from _arrow_dir(self.path)

    def count(self) -> int:
        """Number of rows (cheap: line count, Parquet metadata, dataset length)."""
        if self.format == "jsonl":
            with self.path.open("rb") as handle:
                return sum(1 for line in handle if line.strip())
        if self.format == "parquet":
            import pyarrow.parquet as pq  # type: ignore[import-untyped]

            return int(pq.ParquetFile(self.path).metadata.num_rows)
        return sum(1 for _ in self.rows())


@dataclass(frozen=True)
class Unparsable:
    """A JSONL line that is not JSON (a malformed row, not a malformed file)."""

    line: str
    reason: str
    #: ``row-`` + the SHA-256 of the whole line: lines that share their first 200
    #: characters (two lines nested deep) are two rows, not duplicates.
    id: str = ""


def open_source(path: str | Path, id_column: str = "custom_id") -> Source:
    """Open and check an input: readable, a known format, a prompt column in its rows.

    Raises :class:`InputError` with one clear sentence otherwise.
    """
    if str(path).startswith("s3://"):
        path = download(str(path))
    source = Source(Path(path))
    peeked = []
    try:
        for raw in source.rows():
            peeked.append(raw)
            if len(peeked) >= PEEK_ROWS:
                break
    except InputError:
        raise
    except Exception as exc:  # pyarrow, datasets, OS errors: all mean "unreadable"
        raise InputError(f"{path}: cannot read it as {source.format}: {exc}") from None
    if not peeked:
        raise InputError(f"{path}: no rows")
    # Not JSONL at all; one bad line among JSON ones (even the first) is a malformed row.
    if all(isinstance(raw, Unparsable) for raw in peeked):
        raise InputError(f"{path}: the first line is not JSON ({peeked[0].reason})")
    columns = {key for raw in peeked if isinstance(raw, dict) for key in raw}
    batch = any(isinstance(raw, dict) and is_batch_line(raw) for raw in peeked)
    if not columns & set(PROMPT_COLUMNS) and not batch:
        raise InputError(
            f"{path}: no prompt column; found {sorted(columns)[:20]}, "
            f"expected one of {', '.join(PROMPT_COLUMNS)}, or OpenAI Batch API lines "
            "(custom_id, method, url, body)"
        )
    return source


def download(url: str, cache: Path | None = None) -> Path:
    """A local copy of ``s3://bucket/key`` (a file) or ``s3://bucket/prefix/`` (a
    ``save_to_disk`` directory); credentials and endpoint from the standard AWS chain
    (``AWS_ENDPOINT_URL_S3`` for S3-compatible stores)."""
    import tempfile

    import boto3

    bucket, _, key = url[5:].partition("/")
    client = boto3.client("s3")
    root = cache or Path(tempfile.mkdtemp(prefix="hsx-dataset-input-"))
    name = key.rstrip("/").rsplit("/", 1)[-1] or "input"
    try:
        if not key.endswith("/") and Path(key).suffix:
            client.download_file(bucket, key, str(root / name))
            return root / name
        prefix = key.rstrip("/") + "/"
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
        for one in keys:
            target = root / name / one[len(prefix) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, one, str(target))
    except Exception as exc:  # botocore's errors: missing key, no access, no endpoint
        raise InputError(f"{url}: cannot download it: {exc}") from None
    if not keys:
        raise InputError(f"{url}: no such object or prefix")
    return root / name


def detect_format(path: Path) -> str:
    """``jsonl``, ``json``, ``parquet`` or ``arrow`` (a ``save_to_disk`` directory)."""
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "arrow"
        raise InputError(f"{path}: a directory, but not one saved with datasets' save_to_disk")
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    suffix = path.suffix.lower()
    formats = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
    if suffix not in formats:
        raise InputError(f"{path}: unknown format {suffix!r} (jsonl, json, parquet, a dataset dir)")
    return formats[suffix]


def _jsonl(path: Path) -> Iterator[Any]:
    with path.open("rb") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                yield _unparsable(line, f"not JSON: {exc}")
            except Exception as exc:  # RecursionError (a line nested 100,000 deep): this row only
                yield _unparsable(line, why(exc))
            else:
                yield row


def _unparsable(line: bytes, reason: str) -> Unparsable:
    digest = hashlib.sha256(line.rstrip(b"\r\n")).hexdigest()[:40]
    return Unparsable(line.decode("utf-8", "replace")[:200], reason, "row-" + digest)


def _json(path: Path) -> Iterator[Any]:
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of rows (or {{'data': [...]}})")
    yield from data


def _parquet(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _arrow_dir(path: Path) -> Iterator[Any]:
    from datasets import Dataset, DatasetDict, load_from_disk  # type: ignore[import-untyped]

    data = load_from_disk(str(path))
    if isinstance(data, DatasetDict):
        if len(data) != 1:
            raise InputError(f"{path}: a DatasetDict with splits {list(data)}; pass one split")
        data = next(iter(data.values()))
    assert isinstance(data, Dataset)
    for batch in data.with_format(None).iter(batch_size=1024):
        names = list(batch)
        for values in zip(*(batch[n] for n in names), strict=True):
            yield dict(zip(names, values, strict=True))


def iter_rows(source: Source, id_column: str = "custom_id") -> Iterator[Row]:
    """Every row of ``source`` normalised, in file order; a row that makes normalising
    raise anything (a bug's TypeError, a RecursionError) is that row's malformed reason."""
    for index, raw in enumerate(source.rows()):
        if isinstance(raw, Unparsable):
            yield Row(index, raw.id or content_id(raw.line), error=f"malformed: {raw.reason}")
            continue
        try:
            yield normalise(index, raw, id_column, source.expect)
        except Exception as exc:  # one hostile row must not end the reading of the others
            yield Row(index, _fallback_id(index, raw, id_column), error=f"malformed: {why(exc)}")


def why(exc: BaseException) -> str:
    """What a reader's exception says about its row, on one line."""
    if isinstance(exc, RecursionError):
        return "nested too deep to read (Python's recursion limit)"
    text = " ".join(str(exc).split())[:200]
    return f"cannot be read: {type(exc).__name__}: {text}" if text else type(exc).__name__


def _fallback_id(index: int, raw: Any, id_column: str) -> str:
    """The row's ``custom_id`` when it has a usable one, else its content id, else (a
    row too deep to serialise) an id from its position, the same on every run."""
    given = raw.get(id_column) if isinstance(raw, dict) else None
    if isinstance(given, str | int) and not isinstance(given, bool):  # as normalise takes it
        text = str(given)
        if 0 < len(text) <= MAX_CUSTOM_ID and not_utf8(text) is None:
            return text
    try:
        return content_id(raw)
    except Exception:  # RecursionError: the row's position is all that identifies it
        return "row-at-" + str(index)
