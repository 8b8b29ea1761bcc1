"""The gateway's OTLP path on wire bytes, in Rust (``src/lib.rs``, ``src/profiles.rs``),
loaded with ctypes.

``pip install`` builds the library with cargo (setuptools-rust, ``pyproject.toml``); it has
no dependencies beyond the Rust toolchain. Without it (no toolchain where spanprof was
installed, or ``SPANPROF_NATIVE=0``) every function here answers ``None`` and the callers
take their Python path, which gives the same results: the library only takes requests
it is sure of and hands every other one back (see ``src/lib.rs``).

``traces_check``: the span count of an ``ExportTraceServiceRequest`` whose spans all pass
the receiver's checks, without parsing it in Python (``pipeline/otlp/traces.py``).
``traces_split``: the same request split by trace or by partition, as
``pipeline/otlp/wire.py``'s ``split_trace_bytes`` does, byte for byte.
``profiles_split``: an ``ExportProfilesServiceRequest`` split by the partition of each
sample's trace, as ``pipeline/otlp/wire_profiles.py``'s ``split_profile_bytes``.
``profile_columns``: each profile's samples as columns (stack, link, value) when all are
the usual kind, for the gateway's checks (``pipeline/otlp/profiles.py``).
``dictionary_summary``: every entry of a profile request's dictionary checked, with bounds
on the stack budget any use of it can spend (``pipeline/otlp/dictionary.py``).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

# pipeline/kafka's partitioners, by their config names
_HASHERS = {"sarama_compat": 1, "murmur2": 2}
# profiles_split's answer when the parts' copies of the dictionary would outweigh the
# request: the caller compacts each part instead (split.split_profiles)
COMPACT = "compact"
# traces_split's answer when the messages would make more than the limit given
TOO_LARGE = "too large"
_NO_TRACE = 2**64 - 1  # a part's key offset for the samples without a trace


class _Out(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("buf_len", ctypes.c_size_t),
                ("buf_cap", ctypes.c_size_t), ("idx", ctypes.POINTER(ctypes.c_uint64)),
                ("idx_len", ctypes.c_size_t), ("idx_cap", ctypes.c_size_t)]


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The library, or None and why not."""
    if os.environ.get("SPANPROF_NATIVE", "1") == "0":
        return None, "SPANPROF_NATIVE=0"
    here = Path(__file__).parent
    for path in sorted(here.glob("_wire*.so")):
        try:
            return _bind(ctypes.CDLL(str(path))), ""
        except (OSError, AttributeError) as err:  # unloadable, or built from older sources
            return None, f"{path.name}: {err}"
    return None, "not built (no cargo where spanprof was installed)"


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Each function's C signature (AttributeError: a library built before one existed)."""
    lib.spanprof_traces_check.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.spanprof_traces_check.restype = ctypes.c_int64
    lib.spanprof_traces_split.argtypes = [ctypes.c_char_p, ctypes.c_size_t,
                                          ctypes.c_uint32, ctypes.c_uint32,
                                          ctypes.c_size_t,  # the bytes limit
                                          ctypes.POINTER(_Out)]
    lib.spanprof_traces_split.restype = ctypes.c_int64
    lib.spanprof_profiles_split.argtypes = [ctypes.c_char_p, ctypes.c_size_t,
                                            ctypes.c_uint32, ctypes.c_uint32,
                                            ctypes.POINTER(_Out)]
    lib.spanprof_profiles_split.restype = ctypes.c_int64
    lib.spanprof_profiles_columns.argtypes = [ctypes.c_char_p, ctypes.c_size_t,
                                              ctypes.POINTER(_Out)]
    lib.spanprof_profiles_columns.restype = ctypes.c_int64
    lib.spanprof_profiles_dictionary.argtypes = [ctypes.c_char_p, ctypes.c_size_t,
                                                 ctypes.c_uint64,
                                                 ctypes.POINTER(ctypes.c_uint64)]
    lib.spanprof_profiles_dictionary.restype = ctypes.c_int64
    lib.spanprof_out_free.argtypes = [ctypes.POINTER(_Out)]
    lib.spanprof_out_free.restype = None
    return lib


_lib, WHY_NOT = _load()
AVAILABLE = _lib is not None


def traces_check(data: bytes) -> int | None:
    """The number of spans when the request parses and every span passes the checks;
    None when the Python path must decide (it names what it refuses)."""
    if _lib is None or type(data) is not bytes:
        return None
    n = int(_lib.spanprof_traces_check(data, len(data)))
    return None if n < 0 else n


def traces_split(data: bytes, partitioner: str | None = None, partitions: int = 0,
                 limit: int = 2**63) -> dict[str, bytes] | str | None:
    """Message key -> message, as ``split_trace_bytes(data, (), bucket_of)`` with
    ``bucket_of`` the exporter's ``Buckets(partitioner, partitions)`` (None: a message per
    trace); ``TOO_LARGE`` when the messages would make more than ``limit`` bytes; None
    when the Python path must do it."""
    if _lib is None or type(data) is not bytes:
        return None
    keying = _keying(partitioner, partitions)
    if keying is None:
        return None
    got = _split(_lib.spanprof_traces_split, data, *keying, limit)
    return TOO_LARGE if got == COMPACT else got


def profiles_split(data: bytes, partitioner: str, partitions: int
                   ) -> dict[str, bytes] | str | None:
    """Message key ("" for the samples without a trace) -> message, as
    ``split_profile_bytes`` makes them from a checked request's bytes (``data``, as upb
    serialises it); ``COMPACT`` when that would answer None (the parts' dictionaries
    outweigh the request); None when the Python path must decide."""
    if _lib is None or type(data) is not bytes:
        return None
    keying = _keying(partitioner, partitions)
    if keying is None or keying[0] == 0:
        return None
    return _split(_lib.spanprof_profiles_split, data, *keying)


Columns = tuple[Any, Any, Any]  # stack indices, link indices, values (int64 arrays)


def profile_columns(data: bytes) -> list[Columns | None] | None:
    """For each profile of the request (in the order upb gives them), its samples' stack
    indices, link indices and values when every sample is the usual kind (those three
    fields once each, one value, indices within int32, the value not negative), else
    None for that profile; None for all when the library is not there or the request is
    not what it expects."""
    if _lib is None or type(data) is not bytes:
        return None
    out = _Out()
    n = int(_lib.spanprof_profiles_columns(data, len(data), ctypes.byref(out)))
    if n < 0:
        return None
    try:
        flat = np.ctypeslib.as_array(out.idx, shape=(out.idx_len,)).view(np.int64).copy()
    finally:
        _lib.spanprof_out_free(ctypes.byref(out))
    heads = flat[1:1 + 2 * n].reshape(n, 2).tolist()
    at = 1 + 2 * n
    cols: list[Columns | None] = []
    for usual, k in heads:
        if usual:
            cols.append((flat[at:at + k], flat[at + k:at + 2 * k], flat[at + 2 * k:at + 3 * k]))
            at += 3 * k
        else:
            cols.append(None)
    return cols


class Summary(NamedTuple):
    """A dictionary whose every entry passed the checks a used entry gets, with table
    sizes and what any use of it can charge to a ``StackTable``'s budget."""

    strings: int
    links: int
    stacks: int
    depth: int  # the most frames (or location references) of one stack or location
    excess: int  # frames beyond ``fanout`` per location reference, over all stacks
    text: int  # name characters of every location and frame bytes of every stack


def dictionary_summary(data: bytes, fanout: int) -> Summary | None:
    """``Summary`` of the dictionary of a profile request upb parsed; None when an entry
    is wrong or unusual (or no library): the caller checks the entries its profiles use."""
    if _lib is None or type(data) is not bytes:
        return None
    out = (ctypes.c_uint64 * 6)()
    if _lib.spanprof_profiles_dictionary(data, len(data), fanout, out) != 0:
        return None
    return Summary(*out)


def _keying(partitioner: str | None, partitions: int) -> tuple[int, int] | None:
    if partitioner is None:
        return 0, 0
    if partitioner in _HASHERS and 0 < partitions < 2**32:
        return _HASHERS[partitioner], partitions
    return None


def _split(fn: Any, data: bytes, hasher: int, partitions: int,
           *more: int) -> dict[str, bytes] | str | None:
    """``fn``'s parts by key; ``more``: its arguments after the partition count."""
    out = _Out()
    n = int(fn(data, len(data), hasher, partitions, *more, ctypes.byref(out)))
    if n == -2:
        return COMPACT
    if n < 0:
        return None
    try:
        idx = out.idx
        base = out.buf or 0
        parts: dict[str, bytes] = {}
        for j in range(0, 3 * n, 3):
            t, a, z = idx[j], idx[j + 1], idx[j + 2]
            key = "" if t == _NO_TRACE else data[t:t + 16].hex()
            parts[key] = ctypes.string_at(base + a, z - a)
        return parts
    finally:
        assert _lib is not None
        _lib.spanprof_out_free(ctypes.byref(out))
