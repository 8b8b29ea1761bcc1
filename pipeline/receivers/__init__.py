"""Receivers: wire formats in, internal records out."""
