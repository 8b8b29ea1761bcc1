"""The span <-> profile join: state (``state.py``) and the connector around it."""
