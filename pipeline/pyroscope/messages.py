"""Protobuf classes for pprof and Pyroscope's PushRequest, built from their field numbers.

Neither schema ships in a maintained Python package, so the descriptors are declared here
(field numbers and types are the formats' published facts; see shared/formats/) and the
classes come from protobuf's own runtime: parsing is as strict and fast as generated code.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto
_REP, _OPT = F.LABEL_REPEATED, F.LABEL_OPTIONAL
_I64, _U64, _STR, _BYTES, _BOOL, _MSG = (F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_STRING,
                                         F.TYPE_BYTES, F.TYPE_BOOL, F.TYPE_MESSAGE)

PPROF: dict[str, list[Any]] = {
    "Profile": [("sample_type", 1, _REP, _MSG, "ValueType"), ("sample", 2, _REP, _MSG, "Sample"),
                ("mapping", 3, _REP, _MSG, "Mapping"), ("location", 4, _REP, _MSG, "Location"),
                ("function", 5, _REP, _MSG, "Function"), ("string_table", 6, _REP, _STR, None),
                ("drop_frames", 7, _OPT, _I64, None), ("keep_frames", 8, _OPT, _I64, None),
                ("time_nanos", 9, _OPT, _I64, None), ("duration_nanos", 10, _OPT, _I64, None),
                ("period_type", 11, _OPT, _MSG, "ValueType"), ("period", 12, _OPT, _I64, None),
                ("comment", 13, _REP, _I64, None), ("default_sample_type", 14, _OPT, _I64, None)],
    "ValueType": [("type", 1, _OPT, _I64, None), ("unit", 2, _OPT, _I64, None)],
    "Sample": [("location_id", 1, _REP, _U64, None), ("value", 2, _REP, _I64, None),
               ("label", 3, _REP, _MSG, "Label")],
    "Label": [("key", 1, _OPT, _I64, None), ("str", 2, _OPT, _I64, None),
              ("num", 3, _OPT, _I64, None), ("num_unit", 4, _OPT, _I64, None)],
    "Mapping": [("id", 1, _OPT, _U64, None), ("memory_start", 2, _OPT, _U64, None),
                ("memory_limit", 3, _OPT, _U64, None), ("file_offset", 4, _OPT, _U64, None),
                ("filename", 5, _OPT, _I64, None), ("build_id", 6, _OPT, _I64, None)],
    "Location": [("id", 1, _OPT, _U64, None), ("mapping_id", 2, _OPT, _U64, None),
                 ("address", 3, _OPT, _U64, None), ("line", 4, _REP, _MSG, "Line"),
                 ("is_folded", 5, _OPT, _BOOL, None)],
    "Line": [("function_id", 1, _OPT, _U64, None), ("line", 2, _OPT, _I64, None),
             ("column", 3, _OPT, _I64, None)],
    "Function": [("id", 1, _OPT, _U64, None), ("name", 2, _OPT, _I64, None),
                 ("system_name", 3, _OPT, _I64, None), ("filename", 4, _OPT, _I64, None),
                 ("start_line", 5, _OPT, _I64, None)],
}
PUSH: dict[str, list[Any]] = {
    "PushRequest": [("series", 1, _REP, _MSG, "RawProfileSeries")],
    "RawProfileSeries": [("labels", 1, _REP, _MSG, "LabelPair"),
                         ("samples", 2, _REP, _MSG, "RawSample")],
    "LabelPair": [("name", 1, _OPT, _STR, None), ("value", 2, _OPT, _STR, None)],
    "RawSample": [("raw_profile", 1, _OPT, _BYTES, None), ("ID", 2, _OPT, _STR, None)],
    "PushResponse": [],
}


def _build(package: str, name: str, messages: dict[str, list[Any]]) -> dict[str, Any]:
    fd = descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax="proto3")
    for msg, fields in messages.items():
        m = fd.message_type.add(name=msg)
        for fname, number, label, ftype, type_name in fields:
            f = m.field.add(name=fname, number=number, label=label, type=ftype)
            if type_name:
                f.type_name = f".{package}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {msg: message_factory.GetMessageClass(pool.FindMessageTypeByName(
        f"{package}.{msg}")) for msg in messages}


_pprof = _build("perftools.profiles", "spanprof/pprof.proto", PPROF)
_push = _build("push.v1", "spanprof/push.proto", PUSH)
Profile: Any = _pprof["Profile"]
PushRequest: Any = _push["PushRequest"]
PushResponse: Any = _push["PushResponse"]
