"""spanprof processors and connectors: the stages between receivers and exporters."""
