"""Fill the ``config.pbtxt.in`` templates of the model repository.

This plays the role of upstream's ``fill_template.py``: ``${name}`` placeholders
are replaced, and ``${inputs}`` / ``${outputs}`` are rendered from
:mod:`tritonllm.contract`, so the tensor contract is written down once.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from pathlib import Path

from tritonllm import contract


class TemplateError(ValueError):
    pass


def render_tensors(kind: str, tensors: Iterable[contract.Tensor]) -> str:
    """``input [ ... ]`` or ``output [ ... ]`` in config.pbtxt syntax."""
    entries = []
    for t in tensors:
        dims = ", ".join(str(d) for d in t.dims)
        optional = " optional: true" if t.optional else ""
        entries.append(
            f'  {{ name: "{t.name}" data_type: {t.triton_dtype} dims: [ {dims} ]{optional} }}'
        )
    return f"{kind} [\n" + ",\n".join(entries) + "\n]"


def fill(template: Path, model: str, values: dict[str, object]) -> str:
    inputs, outputs = contract.MODELS[model]
    mapping = {
        "inputs": render_tensors("input", inputs),
        "outputs": render_tensors("output", outputs),
        **{k: str(v) for k, v in values.items()},
    }
    try:
        return string.Template(template.read_text()).substitute(mapping)
    except KeyError as missing:
        raise TemplateError(
            f"{template}: no value for placeholder ${{{missing.args[0]}}}"
        ) from None
