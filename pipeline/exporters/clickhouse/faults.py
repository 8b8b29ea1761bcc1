"""What a failed insert means: the rows' fault (permanent) or ClickHouse's (retryable), and
whether the failed attempt may still have stored something.

The writer's whole failure handling rests on these two answers, as the Collector's
exporterhelper rests on ``consumererror.IsPermanent``:

* **permanent** - retrying the same rows can never succeed: a value out of its column's
  range, a wrong type, text ClickHouse cannot parse. The writer splits the block to find
  the rows at fault and quarantines them; retrying would wedge every client behind them.
* **retryable** - everything else, including errors not recognised: a network error, a
  full disk, too many parts, a memory limit. Retrying later may succeed; treating an
  unknown error as permanent would throw good rows away.

Observed with clickhouse-connect 1.12 on chdb 26.9 (tests/pipeline/exporters/
test_writer_faults.py keeps them honest): values the Native encoder cannot write fail in
the client, before anything is sent, as ``DataError("Unable to create native array for
column `x`")`` raised from ``struct.error`` (UInt64 >= 2**64 or < 0, a ``DateTime`` at or
beyond 2106, a ``DateTime64(9)`` beyond 2262, UInt8 > 255), and as bare ``TypeError``
(None in a number column), ``ValueError`` (a non-numeric string), ``AttributeError`` (a
number in a String column: ``'int' object has no attribute 'encode'``) and
``UnicodeEncodeError`` (a lone surrogate). These carry no ``code``. Server-side failures
are ``DatabaseError`` with the numeric ``code`` and symbolic ``name`` (chdb and HTTP alike).
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Iterator

from urllib3.exceptions import ConnectTimeoutError

# ClickHouse error codes that a block's *values* cause: the same rows fail the same way on
# every attempt (src/Common/ErrorCodes.cpp)
PERMANENT_CODES = {
    6: "CANNOT_PARSE_TEXT",
    25: "CANNOT_PARSE_ESCAPE_SEQUENCE",
    26: "CANNOT_PARSE_QUOTED_STRING",
    27: "CANNOT_PARSE_INPUT_ASSERTION_FAILED",
    38: "CANNOT_PARSE_DATE",
    41: "CANNOT_PARSE_DATETIME",
    43: "ILLEGAL_TYPE_OF_ARGUMENT",
    53: "TYPE_MISMATCH",
    69: "ARGUMENT_OUT_OF_BOUND",
    70: "CANNOT_CONVERT_TYPE",
    72: "CANNOT_PARSE_NUMBER",
    117: "INCORRECT_DATA",
    128: "TOO_LARGE_ARRAY_SIZE",
    131: "TOO_LARGE_STRING_SIZE",
    190: "SIZES_OF_ARRAYS_DONT_MATCH",
    321: "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE",
    349: "CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN",
    376: "CANNOT_PARSE_UUID",
    377: "ILLEGAL_SYNTAX_FOR_DATA_TYPE",
    395: "FUNCTION_THROW_IF_VALUE_IS_NON_ZERO",
    407: "DECIMAL_OVERFLOW",
    691: "UNKNOWN_ELEMENT_OF_ENUM",
}

# server-side failures after which the block may have been stored all the same: the
# server stopped waiting, not writing (a replicated insert's Keeper commit, a timeout)
UNCERTAIN_CODES = {
    159: "TIMEOUT_EXCEEDED",
    209: "SOCKET_TIMEOUT",
    210: "NETWORK_ERROR",
    319: "UNKNOWN_STATUS_OF_INSERT",
    999: "KEEPER_EXCEPTION",
}

# what clickhouse-connect's Native encoder raises on a value it cannot write (see above)
CLIENT_SIDE = (struct.error, OverflowError, TypeError, ValueError, AttributeError,
               UnicodeError)

# ClickHouse names the view when a materialized view fails: the source table's block is
# already stored by then (observed: a throwIf in a view left the source row written)
PUSHING_TO_VIEW = "while pushing to view"


def _chain(err: BaseException) -> Iterator[BaseException]:
    """The error, its causes and contexts, and urllib3's ``reason`` (MaxRetryError wraps the
    connection error there, not in ``__cause__``)."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo and len(seen) < 16:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        reason = getattr(e, "reason", None)
        todo += [x for x in (e.__cause__, e.__context__, reason)
                 if isinstance(x, BaseException)]


def server_code(err: BaseException) -> int | None:
    """The ClickHouse error code the server (or chdb) reported, if it reported one."""
    for e in _chain(err):
        code = getattr(e, "code", None)
        if isinstance(code, int) and not isinstance(code, bool):
            return code
    return None


def is_permanent(err: BaseException) -> bool:
    """True when retrying the same rows cannot succeed (their values are at fault).

    Client-side errors count only as the error itself or what it was raised *from*
    (clickhouse-connect: ``DataError`` from ``struct.error``), never an error that was
    merely being handled when it was raised: a network error raised while a library
    parsed a reply inside ``except ValueError`` is not the rows' fault."""
    code = server_code(err)
    if code is not None:
        return code in PERMANENT_CODES
    e: BaseException | None = err
    for _ in range(16):
        if e is None:
            return False
        if isinstance(e, CLIENT_SIDE):
            return True
        e = e.__cause__
    return False


# server errors that say ClickHouse itself is short of something for now: retried
TRANSIENT_CODES = {
    **UNCERTAIN_CODES,
    74: "CANNOT_READ_FROM_FILE_DESCRIPTOR",
    75: "CANNOT_WRITE_TO_FILE_DESCRIPTOR",
    202: "TOO_MANY_SIMULTANEOUS_QUERIES",
    236: "ABORTED",
    241: "MEMORY_LIMIT_EXCEEDED",
    242: "TABLE_IS_READ_ONLY",
    243: "NOT_ENOUGH_SPACE",
    252: "TOO_MANY_PARTS",
    394: "QUERY_WAS_CANCELLED",
}


def is_transient(err: BaseException) -> bool:
    """True when the failure is ClickHouse's passing state (unreachable, disk full, too many
    parts, memory): the same insert may succeed later. A server answer with any other code
    (an unknown table, a missing column) will not change by retrying."""
    code = server_code(err)
    return code is None or code in TRANSIENT_CODES


def may_have_landed(err: BaseException) -> bool:
    """False only when the failed attempt certainly stored nothing: the server answered
    with an error before writing, or no connection was ever made. Anything else (a
    connection lost mid-request, a timeout, a view failing after its source table was
    written) may have stored the block, so it must be retried under the same token, never
    dropped and resent by the client under a new one."""
    code = server_code(err)
    if code is not None:
        return code in UNCERTAIN_CODES or PUSHING_TO_VIEW in str(err)
    if is_permanent(err):
        return False  # failed while encoding: nothing was sent
    return not any(_never_connected(e) for e in _chain(err))


def _never_connected(err: BaseException) -> bool:
    """A connection refused or never established (urllib3 wraps it; an ``OSError``
    subclass may carry ``ECONNREFUSED`` without being ``ConnectionRefusedError``)."""
    return isinstance(err, ConnectionRefusedError | ConnectTimeoutError) or (
        isinstance(err, OSError) and err.errno == errno.ECONNREFUSED)


def _name(err: BaseException) -> str:
    name = type(err).__name__
    return "struct.error" if isinstance(err, struct.error) else name


def reason(err: BaseException, limit: int = 300) -> str:
    """A one-line reason: the error's type and text, and its cause's when the text alone
    is vague (clickhouse-connect's ``DataError`` says only which column)."""
    text = f"{_name(err)}: {str(err).strip()}"
    cause = err.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" ({_name(cause)}: {str(cause).strip()})"
    return " ".join(text.split())[:limit]
