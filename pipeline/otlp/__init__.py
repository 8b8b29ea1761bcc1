"""The one place that knows OTLP's wire format: OTLP protobuf <-> internal records."""
