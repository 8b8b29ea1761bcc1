"""The gateway's trace path on wire bytes, in Rust (``src/lib.rs``), loaded with ctypes.

``pip install`` builds the library with cargo (setuptools-rust, ``pyproject.toml``); it has
no dependencies beyond the Rust toolchain. Without it (no toolchain where spanprof was
installed, or ``SPANPROF_NATIVE=0``) every function here answers ``None`` and the callers
take their Python path, which gives the same results: the library only takes requests
it is sure of and hands every other one back (see ``src/lib.rs``).

``traces_check``: the span count of an ``ExportTraceServiceRequest`` whose spans all pass
the receiver's checks, without parsing it in Python (``pipeline/otlp/traces.py``).
``traces_split``: the same request split by trace or by partition, as
``pipeline/otlp/wire.py``'s ``split_trace_bytes`` does, byte for byte.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

# pipeline/kafka's partitioners, by their config names
_HASHERS = {"sarama_compat": 1, "murmur2": 2}


class _Out(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("buf_len", ctypes.c_size_t),
                ("buf_cap", ctypes.c_size_t), ("idx", ctypes.POINTER(ctypes.c_uint64)),
                ("idx_len", ctypes.c_size_t), ("idx_cap", ctypes.c_size_t)]


def _load() -> ctypes.CDLL | None:
    if os.environ.get("SPANPROF_NATIVE", "1") == "0":
        return None
    here = Path(__file__).parent
    for path in sorted(here.glob("_wire*.so")):
        lib = ctypes.CDLL(str(path))
        lib.spanprof_traces_check.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.spanprof_traces_check.restype = ctypes.c_int64
        lib.spanprof_traces_split.argtypes = [ctypes.c_char_p, ctypes.c_size_t,
                                              ctypes.c_uint32, ctypes.c_uint32,
                                              ctypes.POINTER(_Out)]
        lib.spanprof_traces_split.restype = ctypes.c_int64
        lib.spanprof_out_free.argtypes = [ctypes.POINTER(_Out)]
        lib.spanprof_out_free.restype = None
        return lib
    return None


_lib = _load()
AVAILABLE = _lib is not None


def traces_check(data: bytes) -> int | None:
    """The number of spans when the request parses and every span passes the checks;
    None when the Python path must decide (it names what it refuses)."""
    if _lib is None:
        return None
    n = int(_lib.spanprof_traces_check(data, len(data)))
    return None if n < 0 else n


def traces_split(data: bytes, partitioner: str | None = None,
                 partitions: int = 0) -> dict[str, bytes] | None:
    """Message key -> message, as ``split_trace_bytes(data, (), bucket_of)`` with
    ``bucket_of`` the exporter's ``Buckets(partitioner, partitions)`` (None: a message per
    trace); None when the Python path must do it."""
    if _lib is None:
        return None
    if partitioner is None:
        hasher, partitions = 0, 0
    elif partitioner in _HASHERS and 0 < partitions < 2**32:
        hasher = _HASHERS[partitioner]
    else:
        return None
    out = _Out()
    n = int(_lib.spanprof_traces_split(data, len(data), hasher, partitions,
                                       ctypes.byref(out)))
    if n < 0:
        return None
    try:
        idx = out.idx
        base = out.buf or 0
        parts: dict[str, bytes] = {}
        for j in range(0, 3 * n, 3):
            t, a, z = idx[j], idx[j + 1], idx[j + 2]
            parts[data[t:t + 16].hex()] = ctypes.string_at(base + a, z - a)
        return parts
    finally:
        _lib.spanprof_out_free(ctypes.byref(out))
