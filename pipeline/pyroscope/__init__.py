"""Pyroscope's wire formats: the push API (push.v1) and pprof (perftools.profiles)."""
