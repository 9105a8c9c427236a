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


def render_tensors(kind: str, tensors: Iterable[contract.Tensor], tensorrtllm: bool = False) -> str:
    """``input [ ... ]`` or ``output [ ... ]`` in config.pbtxt syntax.

    ``tensorrtllm``: the input attributes of NVIDIA's tensorrt_llm/config.pbtxt for the
    C++ backend: ``[1]`` inputs reach it as scalars (``reshape: { shape: [ ] }``) and
    variable-length ones may be batched ragged (``allow_ragged_batch: true``).
    """
    entries = []
    for t in tensors:
        dims = ", ".join(str(d) for d in t.dims)
        extra = " optional: true" if t.optional else ""
        if tensorrtllm and kind == "input":
            if t.dims == (1,):
                extra += " reshape: { shape: [ ] }"
            elif -1 in t.dims:
                extra += " allow_ragged_batch: true"
        head = f'name: "{t.name}" data_type: {t.triton_dtype} dims: [ {dims} ]'
        entries.append(f"  {{ {head}{extra} }}")
    return f"{kind} [\n" + ",\n".join(entries) + "\n]"


def fill(template: Path, model: str, values: dict[str, object], tensorrtllm: bool = False) -> str:
    inputs, outputs = contract.MODELS[model]
    mapping = {
        "inputs": render_tensors("input", inputs, tensorrtllm),
        "outputs": render_tensors("output", outputs, tensorrtllm),
        **{k: str(v) for k, v in values.items()},
    }
    try:
        return string.Template(template.read_text()).substitute(mapping)
    except KeyError as missing:
        raise TemplateError(
            f"{template}: no value for placeholder ${{{missing.args[0]}}}"
        ) from None
