"""Component type name -> factory.

Factories live in one explicit list (``default_factories`` below) so that ``spanprof
validate`` can name every valid type, and adding a component touches its own module plus
one line here. Nothing reaches for this list: the CLI calls ``default_factories()`` once and
passes the result to ``pipeline.config.load_file`` (which types a config may name) and to
the service (which types the graph builds), so a test can hand both a list of its own.

``Context``, ``Factory`` and ``Store`` are defined in ``pipeline.component``; they are
imported here too because every component module imports them from here.
"""

from __future__ import annotations

from pipeline.component import Context, Factories, Factory, Kind, Store

__all__ = ["Context", "Factories", "Factory", "Kind", "Store", "default_factories"]


def default_factories() -> dict[Kind, dict[str, Factory]]:
    """Every component spanprof ships, by kind and type name.

    The component modules are imported here, when a pipeline is loaded, and not at the top:
    they pull in grpc, aiokafka and clickhouse-connect, which ``spanprof --help`` and the
    query commands (``top``, ``explain``, ...) never need.
    """
    from pipeline.auth import FACTORY as tenantauth
    from pipeline.exporters.clickhouse.exporter import FACTORY as clickhouse
    from pipeline.exporters.debug import FACTORY as debug
    from pipeline.exporters.kafka import FACTORY as kafka_exporter
    from pipeline.receivers.kafka import FACTORY as kafka_receiver
    from pipeline.receivers.otlp import FACTORY as otlp
    from pipeline.receivers.pyroscope import FACTORY as pyroscope
    from processors.batch import FACTORY as batch
    from processors.correlate.connector import FACTORY as spancorrelator
    from processors.memory_limiter import FACTORY as memory_limiter

    factories = [otlp, kafka_receiver, pyroscope, memory_limiter, batch, clickhouse, debug,
                 kafka_exporter, spancorrelator, tenantauth]
    out: dict[Kind, dict[str, Factory]] = {
        "receiver": {}, "processor": {}, "exporter": {}, "connector": {}, "extension": {}
    }
    for f in factories:
        out[f.kind][f.type] = f
    return out
