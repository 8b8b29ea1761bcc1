"""Protobuf classes for the part of Pyroscope's query API (``querier.v1``, ``types.v1``)
that spanprof answers (admin/querier.py), built from their field numbers.

No maintained Python package ships these schemas, so, as for pprof and Pyroscope's push
(pipeline/pyroscope/messages.py), the descriptors are declared here (the field numbers,
types and names are the published API's facts, ``api/querier/v1/querier.proto`` and
``api/types/v1/types.proto`` of github.com/grafana/pyroscope) and the classes come from
protobuf's own runtime: parsing is as strict and fast as generated code, and
``json_format`` gives the Connect JSON encoding (field names in lowerCamelCase, 64-bit
integers as strings, enums by name).

Only the messages of the RPCs spanprof answers are declared, and in responses only the
fields it fills: a client ignores fields it does not receive, and a request field not
declared here is skipped like any unknown field (binary) or ignored (JSON).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto
_REP, _OPT = F.LABEL_REPEATED, F.LABEL_OPTIONAL
_I64, _U32, _DBL, _STR, _BOOL, _MSG, _ENUM = (F.TYPE_INT64, F.TYPE_UINT32, F.TYPE_DOUBLE,
                                               F.TYPE_STRING, F.TYPE_BOOL, F.TYPE_MESSAGE,
                                               F.TYPE_ENUM)

# message -> [(field, number, label, type, message or enum type)]
TYPES_V1: dict[str, list[Any]] = {
    "LabelPair": [("name", 1, _OPT, _STR, None), ("value", 2, _OPT, _STR, None)],
    "ProfileType": [("ID", 1, _OPT, _STR, None), ("name", 2, _OPT, _STR, None),
                    ("sample_type", 4, _OPT, _STR, None), ("sample_unit", 5, _OPT, _STR, None),
                    ("period_type", 6, _OPT, _STR, None), ("period_unit", 7, _OPT, _STR, None)],
    "Labels": [("labels", 1, _REP, _MSG, ".types.v1.LabelPair")],
    "Series": [("labels", 1, _REP, _MSG, ".types.v1.LabelPair"),
               ("points", 2, _REP, _MSG, ".types.v1.Point")],
    "Point": [("value", 1, _OPT, _DBL, None), ("timestamp", 2, _OPT, _I64, None)],
    "LabelValuesRequest": [("name", 1, _OPT, _STR, None), ("matchers", 2, _REP, _STR, None),
                           ("start", 3, _OPT, _I64, None), ("end", 4, _OPT, _I64, None)],
    "LabelValuesResponse": [("names", 1, _REP, _STR, None)],
    "LabelNamesRequest": [("matchers", 1, _REP, _STR, None), ("start", 2, _OPT, _I64, None),
                          ("end", 3, _OPT, _I64, None)],
    "LabelNamesResponse": [("names", 1, _REP, _STR, None)],
    "StackTraceSelector": [("call_site", 1, _REP, _MSG, ".types.v1.Location"),
                           ("go_pgo", 2, _OPT, _MSG, ".types.v1.GoPGO")],
    "Location": [("name", 1, _OPT, _STR, None)],
    "GoPGO": [("keep_locations", 1, _OPT, _U32, None),
              ("aggregate_callees", 2, _OPT, _BOOL, None)],
}
TYPES_V1_ENUMS = {
    "TimeSeriesAggregationType": ["TIME_SERIES_AGGREGATION_TYPE_SUM",
                                  "TIME_SERIES_AGGREGATION_TYPE_AVERAGE"],
    "ExemplarType": ["EXEMPLAR_TYPE_UNSPECIFIED", "EXEMPLAR_TYPE_NONE",
                     "EXEMPLAR_TYPE_INDIVIDUAL", "EXEMPLAR_TYPE_SPAN"],
}
_SELECTOR = (".types.v1.StackTraceSelector")
QUERIER_V1: dict[str, list[Any]] = {
    "ProfileTypesRequest": [("start", 1, _OPT, _I64, None), ("end", 2, _OPT, _I64, None)],
    "ProfileTypesResponse": [("profile_types", 1, _REP, _MSG, ".types.v1.ProfileType")],
    "SeriesRequest": [("matchers", 1, _REP, _STR, None), ("label_names", 2, _REP, _STR, None),
                      ("start", 3, _OPT, _I64, None), ("end", 4, _OPT, _I64, None)],
    "SeriesResponse": [("labels_set", 2, _REP, _MSG, ".types.v1.Labels")],
    "SelectMergeStacktracesRequest": [
        ("profile_typeID", 1, _OPT, _STR, None), ("label_selector", 2, _OPT, _STR, None),
        ("start", 3, _OPT, _I64, None), ("end", 4, _OPT, _I64, None),
        ("max_nodes", 5, _OPT, _I64, None),
        ("format", 6, _OPT, _ENUM, ".querier.v1.ProfileFormat"),
        ("stack_trace_selector", 7, _OPT, _MSG, _SELECTOR),
        ("profile_id_selector", 8, _REP, _STR, None),
        ("async", 9, _OPT, _MSG, ".querier.v1.AsyncQueryRequest"),
        ("trace_id_selector", 10, _REP, _STR, None), ("span_selector", 11, _REP, _STR, None)],
    "AsyncQueryRequest": [("request_id", 1, _OPT, _STR, None),
                          ("type", 2, _OPT, _ENUM, ".querier.v1.AsyncQueryType")],
    "SelectMergeStacktracesResponse": [("flamegraph", 1, _OPT, _MSG, ".querier.v1.FlameGraph")],
    "SelectMergeSpanProfileRequest": [
        ("profile_typeID", 1, _OPT, _STR, None), ("label_selector", 2, _OPT, _STR, None),
        ("span_selector", 3, _REP, _STR, None), ("start", 4, _OPT, _I64, None),
        ("end", 5, _OPT, _I64, None), ("max_nodes", 6, _OPT, _I64, None),
        ("format", 7, _OPT, _ENUM, ".querier.v1.ProfileFormat")],
    "SelectMergeSpanProfileResponse": [("flamegraph", 1, _OPT, _MSG, ".querier.v1.FlameGraph")],
    "FlameGraph": [("names", 1, _REP, _STR, None), ("levels", 2, _REP, _MSG, ".querier.v1.Level"),
                   ("total", 3, _OPT, _I64, None), ("max_self", 4, _OPT, _I64, None)],
    "Level": [("values", 1, _REP, _I64, None)],
    "SelectSeriesRequest": [
        ("profile_typeID", 1, _OPT, _STR, None), ("label_selector", 2, _OPT, _STR, None),
        ("start", 3, _OPT, _I64, None), ("end", 4, _OPT, _I64, None),
        ("group_by", 5, _REP, _STR, None), ("step", 6, _OPT, _DBL, None),
        ("aggregation", 7, _OPT, _ENUM, ".types.v1.TimeSeriesAggregationType"),
        ("stack_trace_selector", 8, _OPT, _MSG, _SELECTOR), ("limit", 9, _OPT, _I64, None),
        ("exemplar_type", 10, _OPT, _ENUM, ".types.v1.ExemplarType")],
    "SelectSeriesResponse": [("series", 1, _REP, _MSG, ".types.v1.Series")],
}
QUERIER_V1_ENUMS = {
    "ProfileFormat": ["PROFILE_FORMAT_UNSPECIFIED", "PROFILE_FORMAT_FLAMEGRAPH",
                      "PROFILE_FORMAT_TREE", "PROFILE_FORMAT_DOT", "PROFILE_FORMAT_PPROF"],
    "AsyncQueryType": ["ASYNC_QUERY_TYPE_DISABLED", "ASYNC_QUERY_TYPE_FORCE"],
}


def _file(name: str, package: str, messages: dict[str, list[Any]],
          enums: dict[str, list[str]], deps: list[str]) -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax="proto3",
                                            dependency=deps)
    for enum, values in enums.items():
        e = fd.enum_type.add(name=enum)
        for number, value in enumerate(values):
            e.value.add(name=value, number=number)
    for msg, fields in messages.items():
        m = fd.message_type.add(name=msg)
        for fname, number, label, ftype, type_name in fields:
            f = m.field.add(name=fname, number=number, label=label, type=ftype)
            if type_name:
                f.type_name = type_name
    return fd


def _build() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_file("spanprof/types_v1.proto", "types.v1", TYPES_V1, TYPES_V1_ENUMS, []))
    pool.Add(_file("spanprof/querier_v1.proto", "querier.v1", QUERIER_V1, QUERIER_V1_ENUMS,
                   ["spanprof/types_v1.proto"]))
    out = {}
    for package, messages in (("types.v1", TYPES_V1), ("querier.v1", QUERIER_V1)):
        for msg in messages:
            out[msg] = message_factory.GetMessageClass(
                pool.FindMessageTypeByName(f"{package}.{msg}"))
    return out


M: dict[str, Any] = _build()  # message name (without package) -> class
