"""The span <-> profile join: state (``state.py``) and the connector around it.

``connector`` (the component), ``state`` (the join) with ``known``, ``placement`` and
``timed``, ``windows``, ``frames``, ``accumulators``, ``spans``, ``skew`` and ``sizes``;
``messages`` (the Kafka tier's rows per message);
``recovery`` (after a crash) with ``reconcile`` and ``readback``.
"""
