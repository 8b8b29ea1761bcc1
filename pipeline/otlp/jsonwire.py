"""OTLP/JSON -> protobuf request, refusing what ``json.loads`` lets through.

``json.loads`` turns ``"\\ud800"`` into a Python string that cannot be encoded as UTF-8
(protobuf then fails with a ``SystemError`` on a key), and a document nested a few
thousand levels deep into a ``RecursionError``: both were 500s. Here the body is parsed by
msgspec, which refuses lone surrogates and invalid UTF-8, nesting deeper than
``MAX_JSON_DEPTH`` is refused before protobuf's recursive parser sees it, and every
failure is ``InvalidData`` (400 / ``INVALID_ARGUMENT``) with the reason.

OTLP JSON writes trace/span ids as hex where protobuf's JSON mapping expects base64: the
same walk that checks the depth converts them.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
from google.protobuf import json_format

from pipeline.errors import InvalidData

# an OTLP request needs about 10 levels to reach an attribute value and 3 per nested
# AnyValue (array/kvlist): 64 allows 18 levels of nested values, and keeps protobuf's
# recursive ParseDict (a few Python frames per level) far from the recursion limit
MAX_JSON_DEPTH = 64
HEX_FIELDS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id",
                        "parent_span_id", "profileId", "profile_id"})


def loads(body: bytes | str, what: str = "body", max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON: valid UTF-8 without lone surrogates, at most ``max_depth`` deep."""
    try:
        doc = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError) as err:
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise InvalidData(f"{what}: not valid JSON: {reason}") from None
    _check_depth(doc, what, max_depth)
    return doc


def _check_depth(doc: Any, what: str, max_depth: int) -> None:
    """Iterative (a recursive walk is what this protects against)."""
    todo: list[tuple[Any, int]] = [(doc, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            raise InvalidData(f"{what}: JSON nested deeper than {max_depth} levels")
        todo.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _hex_to_base64(node: Any, path: str = "") -> Any:
    """Depth already bounded by ``loads``."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in HEX_FIELDS and isinstance(v, str):
                try:
                    out[k] = base64.b64encode(bytes.fromhex(v)).decode()
                except ValueError:
                    raise InvalidData(f"{path}{k}: {v!r} is not a hex id") from None
            else:
                out[k] = _hex_to_base64(v, f"{path}{k}.")
        return out
    if isinstance(node, list):
        return [_hex_to_base64(v, path) for v in node]
    return node


def parse_request(body: bytes, request_type: Any) -> Any:
    """An OTLP/JSON body as ``request_type`` (ExportTraceServiceRequest, ...); unknown
    fields are ignored as the spec asks. Raises only ``InvalidData``."""
    return from_doc(loads(body), request_type)


def from_doc(doc: Any, request_type: Any) -> Any:
    """A document ``loads`` returned, as ``request_type`` (for a caller that looked at the
    document first: the backfill reader tells traces from profiles by their keys). Raises
    only ``InvalidData``."""
    if not isinstance(doc, dict):
        raise InvalidData(f"not an OTLP/JSON {request_type.__name__}: expected a JSON object")
    try:
        return json_format.ParseDict(_hex_to_base64(doc), request_type(),
                                     ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, AttributeError) as err:
        raise InvalidData(f"not an OTLP/JSON {request_type.__name__}: {err}") from None
