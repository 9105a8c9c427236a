"""Building Triton error responses with the right code (pb_utils passed in)."""

from __future__ import annotations


def triton_error(pb_utils, message: str, code: str = "INVALID_ARG"):
    """``pb_utils.TritonError`` with ``code`` where this Triton version supports codes."""
    error_cls = pb_utils.TritonError
    value = getattr(error_cls, code, None)
    return error_cls(message, value) if value is not None else error_cls(message)
