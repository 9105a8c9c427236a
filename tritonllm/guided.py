"""Guided decoding (structured outputs) with XGrammar: guides checked, compiled, matched.

A request names a guide with TensorRT-LLM's two tensors, ``guided_decoding_guide_type``
(one of :data:`tritonllm.contract.GUIDE_TYPES`) and ``guided_decoding_guide`` (its text):

- ``json``: any JSON object or array (XGrammar's builtin JSON grammar); the text is ignored.
- ``json_schema``: the text is a JSON Schema; the output is one JSON value valid against it.
- ``regex``: the text is a regular expression the whole output matches.
- ``ebnf_grammar``: the text is an EBNF grammar (XGrammar's, llama.cpp's GBNF) whose root
  rule is named ``root``.
- ``structural_tag``: the text is XGrammar's structural tag JSON, as
  ``xgrammar.get_model_structural_tag(...).model_dump_json()`` writes it
  (``{"type": "structural_tag", "format": {...}}``), or the older
  ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` form.

:func:`grammar` needs no tokenizer: the API layer calls it to refuse a bad guide before
sending, and the engine calls it again. :class:`GuideCompiler` compiles guides for one
model's vocabulary, each distinct guide once (XGrammar's compiled-grammar cache), and
hands out one :class:`xgrammar.GrammarMatcher` per sequence.

XGrammar is imported on first use: the import alone takes about 2 s.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

from tritonllm import schema_checks
from tritonllm.contract import GUIDE_TYPES
from tritonllm.tokenization import InvalidRequest

if TYPE_CHECKING:
    import xgrammar

# A guide's text beyond this is refused: a schema or grammar this large is a mistake or an
# attack (conversion and compilation grow with it), not a real output format.
MAX_GUIDE_BYTES = 64 * 1024

# The compiled grammars one model keeps (XGrammar's cache, least recently used out).
DEFAULT_CACHE_LIMIT_BYTES = 256 * 1024 * 1024

# Guides remembered as checked (digests only): a repeated one skips the checks.
_CHECKED_GUIDES = 4096
_checked: OrderedDict[bytes, None] = OrderedDict()
_checked_lock = threading.Lock()

# XGrammar's C++ errors start with a timestamp and a source location, and checks with
# "Check failed: (...) is false:"; the client gets the cause only.
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")


class InvalidGuide(InvalidRequest):
    """A guide that cannot be used; the message names the guide type and the cause."""


def _cause(exc: Exception) -> str:
    text = str(exc).strip()
    text = _CHECK.sub("", _LOCATION.sub("", text)).strip()
    for prefix in ("Invalid JSON error: ", "Invalid structural tag error: "):
        text = text.removeprefix(prefix)
    return text.splitlines()[0] if text else type(exc).__name__


def check_guide(guide_type: str, guide: str) -> None:
    """Refuse an unknown guide type or a guide over :data:`MAX_GUIDE_BYTES`."""
    if guide_type not in GUIDE_TYPES:
        raise InvalidGuide(
            f"guided_decoding_guide_type {guide_type!r} is not supported; use one of "
            f"{', '.join(GUIDE_TYPES)}"
        )
    size = len(guide.encode("utf-8"))
    if size > MAX_GUIDE_BYTES:
        raise InvalidGuide(
            f"{guide_type} guide of {size} bytes exceeds the limit of {MAX_GUIDE_BYTES} bytes"
        )
    if guide_type != "json" and not guide.strip():
        raise InvalidGuide(f"{guide_type} guide is empty: guided_decoding_guide must hold it")


def grammar(guide_type: str, guide: str) -> xgrammar.Grammar:
    """The XGrammar grammar of a guide, or :class:`InvalidGuide` saying what is wrong.

    Needs no tokenizer (the API layer's check before sending; the engine's first step).
    """
    check_guide(guide_type, guide)
    if guide_type in ("json_schema", "structural_tag"):
        _check_depth(guide_type, guide)
    import xgrammar as xgr

    if guide_type == "json":
        return xgr.Grammar.builtin_json_grammar()
    if guide_type == "json_schema":
        return _json_schema_grammar(guide)
    if guide_type == "structural_tag":
        return _structural_tag_grammar(guide)
    convert = xgr.Grammar.from_regex if guide_type == "regex" else xgr.Grammar.from_ebnf
    try:
        return convert(guide)
    except Exception as exc:  # XGrammar raises RuntimeError from C++ parse errors
        what = "regular expression" if guide_type == "regex" else "EBNF grammar (root rule: root)"
        raise InvalidGuide(f"{guide_type} guide is not a valid {what}: {_cause(exc)}") from None


def _check_depth(guide_type: str, guide: str) -> None:
    depth = schema_checks.json_depth(guide)
    if depth > schema_checks.MAX_DEPTH:
        raise InvalidGuide(
            f"{guide_type} guide nests {depth} levels of arrays and objects, more than the "
            f"limit of {schema_checks.MAX_DEPTH}: flatten the schema"
        )


def _check_refs(guide_type: str, document) -> None:
    refs = schema_checks.external_refs(document)
    if refs:
        raise InvalidGuide(
            f"{guide_type} guide refers to a schema outside it ($ref {refs[0]!r}), which is "
            'never fetched: put it under "$defs" and refer to it as "#/$defs/..."'
        )


def check(guide_type: str, guide: str) -> None:
    """:func:`grammar`'s checks, skipped for a guide that passed them lately (clients
    send the same schema again and again): :class:`InvalidGuide` says what is wrong."""
    key = hashlib.sha256(f"{guide_type}\0{guide}".encode()).digest()
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            return
    grammar(guide_type, guide)
    with _checked_lock:
        _checked[key] = None
        while len(_checked) > _CHECKED_GUIDES:
            _checked.popitem(last=False)


def _json_schema_grammar(guide: str) -> xgrammar.Grammar:
    import jsonschema
    import xgrammar as xgr

    try:
        schema = json.loads(guide)
    except ValueError as exc:
        raise InvalidGuide(f"json_schema guide is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidGuide(
            f"json_schema guide must be a JSON object (or a boolean), got {type(schema).__name__}"
        )
    _check_refs("json_schema", schema)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(the root)"
        raise InvalidGuide(
            f"json_schema guide is not a valid JSON Schema: {exc.message} (at {path})"
        ) from None
    try:
        # any_whitespace=False: XGrammar then allows exactly json.dumps's default
        # separators, ", " between items and ": " after keys, and no other whitespace
        # (checked: '{"a": 1, "b": ["x"]}' is accepted, '{"a":1,"b":["x"]}' is not). A
        # model given free whitespace can loop on spaces and newlines until max_tokens.
        return xgr.Grammar.from_json_schema(guide, any_whitespace=False)
    except Exception as exc:
        raise InvalidGuide(
            f"XGrammar cannot compile this json_schema guide: {_cause(exc)}"
        ) from None


def _structural_tag_grammar(guide: str) -> xgrammar.Grammar:
    import xgrammar as xgr

    text = structural_tag_json(guide)
    _check_refs("structural_tag", json.loads(text))
    try:
        return xgr.Grammar.from_structural_tag(text)
    except Exception as exc:  # InvalidStructuralTagError
        raise InvalidGuide(
            f"structural_tag guide is not a valid XGrammar structural tag: {_cause(exc)}"
        ) from None


def structural_tag_json(guide: str) -> str:
    """A structural tag guide in XGrammar's current form (``{"type": "structural_tag",
    "format": ...}``), the older ``structures``/``triggers`` form converted."""
    import xgrammar as xgr

    try:
        tag = json.loads(guide)
    except ValueError as exc:
        raise InvalidGuide(f"structural_tag guide is not valid JSON: {exc}") from None
    if not (isinstance(tag, dict) and "structures" in tag and "format" not in tag):
        return guide
    try:
        items = [
            xgr.StructuralTagItem(
                begin=s["begin"], schema=s.get("schema", s.get("schema_")), end=s["end"]
            )
            for s in tag["structures"]
        ]
        converted = xgr.StructuralTag.from_legacy_structural_tag(
            items, list(tag.get("triggers", []))
        )
        return converted.model_dump_json()
    except Exception as exc:  # pydantic's ValidationError, a KeyError, a TypeError
        raise InvalidGuide(
            f"structural_tag guide is not a valid XGrammar structural tag: {_cause(exc)}"
        ) from None


def xgrammar_tokenizer_info(tokenizer) -> dict:
    """What TensorRT-LLM's C++ backend reads from ``xgrammar_tokenizer_info_path``: the
    vocabulary in id order, the fast tokenizer's own JSON (XGrammar derives the
    vocabulary type from it) and the end token, as TensorRT-LLM's
    examples/generate_xgrammar_tokenizer_info.py writes them (fast tokenizers only)."""
    vocab = tokenizer.get_vocab()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__} is not a fast tokenizer: the C++ backend's "
            "guided decoding needs its tokenizer.json"
        )
    return {
        "encoded_vocab": [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])],
        "tokenizer_str": backend.to_str(),
        "stop_token_ids": [tokenizer.eos_token_id],
    }


class GuideCompiler:
    """Compiles guides for one model (its tokenizer and vocabulary) and makes matchers.

    ``vocab_size`` is the width of the model's logits, which may exceed the tokenizer's
    length (padded embeddings); ``end_id`` is the model's end token, the grammars' stop
    token unless a request names another. Each distinct guide compiles once: XGrammar's
    cache keeps the compiled grammars, within ``cache_limit_bytes``.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        end_id: int | None,
        cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES,
        max_threads: int = 2,
    ):
        import xgrammar as xgr

        stop = [end_id] if end_id is not None and end_id >= 0 else None
        self.vocab_size = vocab_size
        self.end_id = stop[0] if stop else None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop
        )
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info,
            max_threads=max_threads,
            cache_enabled=True,
            cache_limit_bytes=cache_limit_bytes,
        )

    @classmethod
    def from_tokenizer_dir(
        cls, tokenizer_dir: str | Path, vocab_size: int, end_id: int | None = None, **kwargs
    ) -> GuideCompiler:
        """From a Hugging Face tokenizer directory (the torch engine's engine dir);
        ``end_id`` defaults to the tokenizer's end-of-sequence token."""
        from tritonllm.tokenization import load_tokenizer

        tokenizer = load_tokenizer(str(tokenizer_dir))
        if end_id is None:
            end_id = tokenizer.eos_token_id
        return cls(tokenizer, vocab_size, end_id, **kwargs)

    def compile(self, guide_type: str, guide: str) -> xgrammar.CompiledGrammar:
        """The compiled guide, or InvalidGuide. A guide seen before skips the checks
        and comes from XGrammar's cache (keyed by its text): microseconds."""
        check(guide_type, guide)
        compiler = self._compiler
        try:
            if guide_type == "json":
                compiled = compiler.compile_builtin_json_grammar()
            elif guide_type == "json_schema":
                compiled = compiler.compile_json_schema(guide, any_whitespace=False)
            elif guide_type == "regex":
                compiled = compiler.compile_regex(guide)
            elif guide_type == "ebnf_grammar":
                compiled = compiler.compile_grammar(guide, root_rule_name="root")
            else:
                compiled = compiler.compile_structural_tag(structural_tag_json(guide))
        except InvalidGuide:
            raise
        except Exception as exc:
            raise InvalidGuide(
                f"invalid {guide_type} guide: XGrammar cannot compile it: {_cause(exc)}"
            ) from None
        return compiled

    def matcher(
        self, compiled: xgrammar.CompiledGrammar, end_id: int | None
    ) -> xgrammar.GrammarMatcher:
        """A fresh matcher for one sequence whose end token is ``end_id``. With none
        (None or negative: TensorRT-LLM's ignore_eos) the matcher terminates once the
        grammar is complete, without a stop token."""
        import xgrammar as xgr

        if end_id is None or end_id < 0:
            return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        override = None if end_id == self.end_id else [end_id]
        return xgr.GrammarMatcher(compiled, override_stop_tokens=override)

    @property
    def cache_size_bytes(self) -> int:
        return self._compiler.get_cache_size_bytes()
