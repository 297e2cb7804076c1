"""A request's ``codec`` and ``layers``, checked against what this server offers.

Every route that extracts calls ``check_codec_params`` before anything reaches the
engine, so they all refuse alike: 422 naming the field and the allowed values.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.api.errors import ApiError
from service.api.extractor import ExtractorLike


def check_codec_params(
    extractor: ExtractorLike, codec: str | None, layers: Sequence[int] | None, *, prefix: str = ""
) -> None:
    """ApiError 422 for a codec not offered or layers not served.

    ``prefix`` is put before the field names (e.g. ``"extra_body."``).
    """
    try:
        extractor.check_codec(codec)
    except ValueError as exc:
        raise _invalid(f"{prefix}codec", str(exc)) from None
    try:
        extractor.check_layers(layers)
    except ValueError as exc:
        raise _invalid(f"{prefix}layers", str(exc)) from None


def _invalid(field: str, message: str) -> ApiError:
    return ApiError(422, "invalid_request", f"{field}: {message}", field=field)
