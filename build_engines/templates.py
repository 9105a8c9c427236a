"""Fill the ``config.pbtxt.in`` templates of the model repository.

This plays the role of upstream's ``fill_template.py``: ``${name}`` placeholders
are replaced, and ``${inputs}`` / ``${outputs}`` are rendered from
:mod:`tritonllm.contract`, so the tensor contract is written down once.
``${dynamic_batching}`` becomes a ``dynamic_batching`` block, or nothing when off.
"""

from __future__ import annotations

import string
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tritonllm import contract

if TYPE_CHECKING:  # targets import this module
    from build_engines.targets.base import DynamicBatching


class TemplateError(ValueError):
    pass


def render_tensors(
    kind: str, tensors: Iterable[contract.Tensor], tensorrtllm: bool = False, ragged: bool = False
) -> str:
    """``input [ ... ]`` or ``output [ ... ]`` in config.pbtxt syntax.

    ``tensorrtllm``: the input attributes of NVIDIA's tensorrt_llm/config.pbtxt for the
    C++ backend: ``[1]`` inputs reach it as scalars (``reshape: { shape: [ ] }``), but
    for the strings (the guided decoding guide and its type, read as ``[1]``, as upstream
    declares them), and variable-length ones may be batched ragged
    (``allow_ragged_batch: true``).

    ``ragged`` marks variable-size inputs ``allow_ragged_batch``: without it Triton's
    dynamic batcher only merges requests whose shapes are equal (stop words of other
    lengths would never share an execute). A Python-backend model reads each request's
    tensors apart, so ragged batches need nothing more from it.
    """
    entries = []
    for t in tensors:
        dims = ", ".join(str(d) for d in t.dims)
        extra = " optional: true" if t.optional else ""
        scalar = t.dims == (1,) and t.triton_dtype != "TYPE_STRING"
        if kind == "input" and tensorrtllm and scalar:
            extra += " reshape: { shape: [ ] }"
        if kind == "input" and (tensorrtllm or ragged) and -1 in t.dims:
            extra += " allow_ragged_batch: true"
        head = f'name: "{t.name}" data_type: {t.triton_dtype} dims: [ {dims} ]'
        entries.append(f"  {{ {head}{extra} }}")
    return f"{kind} [\n" + ",\n".join(entries) + "\n]"


def render_dynamic_batching(batching: DynamicBatching, max_batch_size: int) -> str:
    """A ``dynamic_batching { ... }`` block, or the empty string when batching is off."""
    if not batching.enabled:
        return ""
    too_large = [s for s in batching.preferred_batch_sizes if not 0 < s <= max_batch_size]
    if too_large:
        raise TemplateError(
            f"preferred batch sizes {too_large} must lie in 1..{max_batch_size} "
            "(the model's max_batch_size): lower --preferred-batch-sizes"
        )
    if batching.max_queue_delay_us < 0:
        raise TemplateError("--dynamic-batching-delay-us must be >= 0")
    sizes = ", ".join(str(s) for s in batching.preferred_batch_sizes)
    preferred = f"preferred_batch_size: [ {sizes} ] " if sizes else ""
    return (
        f"dynamic_batching {{ {preferred}"
        f"max_queue_delay_microseconds: {batching.max_queue_delay_us} }}"
    )


def render_extension_maps(kind: str, tensors: Iterable[contract.Tensor]) -> str:
    """The ensemble's ``input_map``/``output_map`` lines of the tensorrt_llm step for
    our engine extensions (each ensemble tensor named as the engine's)."""
    return "\n".join(
        f'      {kind}_map {{ key: "{t.name}" value: "{t.name}" }}'
        for t in tensors
        if t.engine_extension
    )


def fill(
    template: Path,
    model: str,
    values: dict[str, object],
    tensorrtllm: bool = False,
    ragged: bool = False,
    engine_extensions: Collection[contract.Tensor] | None = None,
) -> str:
    """``template`` filled for ``model``. ``engine_extensions``: which of our tensors of
    the tensorrt_llm step the engine there serves (None: all, the torch engine's; a
    TensorRT-LLM backend has none)."""
    inputs, outputs = contract.ALL_MODELS[model]
    if engine_extensions is not None:
        served = set(engine_extensions)
        inputs = [t for t in inputs if not t.engine_extension or t in served]
        outputs = [t for t in outputs if not t.engine_extension or t in served]
    mapping = {
        "inputs": render_tensors("input", inputs, tensorrtllm, ragged),
        "outputs": render_tensors("output", outputs, tensorrtllm),
        "engine_extension_input_maps": render_extension_maps("input", inputs),
        "engine_extension_output_maps": render_extension_maps("output", outputs),
        **{k: str(v) for k, v in values.items()},
    }
    try:
        return string.Template(template.read_text()).substitute(mapping)
    except KeyError as missing:
        raise TemplateError(
            f"{template}: no value for placeholder ${{{missing.args[0]}}}"
        ) from None
