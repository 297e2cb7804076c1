"""Object codecs: how one object's hidden states are stored, and how to read them back.

One package for the server (the worker's writer encodes, ``GET /objects?decode=true``
decodes) and for clients, so it imports nothing of hsx outside it and only torch (and
its numpy), safetensors and zstandard (lazily, so the codec names cost nothing to
import). Import its names from here (``from service.codecs import decode``).

- ``registry``: what a codec is (``CodecImpl``), the registered ones (``CODECS``) and
  the metadata every object names them by;
- ``raw``, ``lossy`` (``fp8``, ``bf16``) and ``lossless``: the codecs, one family a
  module, each class's docstring giving its layout; a new codec is one class and its
  test;
- ``encoding``: ``prepare`` (a tensor transform; runs on any device, so a GPU can do it
  before the device-to-host copy) and ``pack_parts`` (CPU: byte planes, zstd,
  safetensors);
- ``decoding``: ``read_object`` checks an object's header, ``decode`` reads any codec
  back;
- ``safetensors_io``: the file format, written and read without copying a tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from service.codecs.decoding import (
    ObjectHeader,
    codec_of,
    decode,
    read_metadata,
    read_object,
    read_tensor,
    to_raw,
)
from service.codecs.encoding import check_layers, pack_parts, prepare, prepared_nbytes, restore
from service.codecs.registry import (
    CODEC_KEY,
    CODEC_VERSION,
    CODEC_VERSION_KEY,
    CODECS,
    DECODED_FROM_KEY,
    MODEL_DTYPES,
    POOLED_SELECTIONS,
    TOKENS_KEY,
    CodecImpl,
    Shape,
    TensorCheck,
    check_codec,
    codec_impl,
    describe,
    offered,
    register,
    states_nbytes,
)
from service.codecs.safetensors_io import (
    MAX_HEADER_BYTES,
    CorruptObjectError,
    TensorEntry,
    dtype_name,
    parse_safetensors_header,
    read_safetensors_header,
    safetensors_parts,
)

# The codec families register themselves on import, in the order CODECS lists them and
# the API offers them: raw, fp8, bf16, lossless. Keep these three imports in this order.
# isort: off
from service.codecs.raw import RawCodec
from service.codecs.lossy import FP8_SCALE_STEPS, SCALES, Bf16Codec, Fp8Codec, quantize_fp8
from service.codecs.lossless import (
    EXPONENT_PLANE,
    LOSSLESS_DTYPES,
    REST_PLANES,
    ZSTD_PARAMS,
    LosslessCodec,
    join_planes,
    split_planes,
)
# isort: on

if TYPE_CHECKING:
    from service.codecs.registry import Codec
else:
    #: A codec's name: at run time the Literal of the registered names, so pydantic
    #: fields of this type validate, document (the OpenAPI enum) and refuse by them.
    Codec = Literal[tuple(CODECS)]

__all__ = [
    "CODECS",
    "CODEC_KEY",
    "CODEC_VERSION",
    "CODEC_VERSION_KEY",
    "DECODED_FROM_KEY",
    "EXPONENT_PLANE",
    "FP8_SCALE_STEPS",
    "LOSSLESS_DTYPES",
    "MAX_HEADER_BYTES",
    "MODEL_DTYPES",
    "POOLED_SELECTIONS",
    "REST_PLANES",
    "SCALES",
    "TOKENS_KEY",
    "ZSTD_PARAMS",
    "Bf16Codec",
    "Codec",
    "CodecImpl",
    "CorruptObjectError",
    "Fp8Codec",
    "LosslessCodec",
    "ObjectHeader",
    "RawCodec",
    "Shape",
    "TensorCheck",
    "TensorEntry",
    "check_codec",
    "check_layers",
    "codec_impl",
    "codec_of",
    "decode",
    "describe",
    "dtype_name",
    "join_planes",
    "offered",
    "pack_parts",
    "parse_safetensors_header",
    "prepare",
    "prepared_nbytes",
    "quantize_fp8",
    "read_metadata",
    "read_object",
    "read_safetensors_header",
    "read_tensor",
    "register",
    "restore",
    "safetensors_parts",
    "split_planes",
    "states_nbytes",
    "to_raw",
]
