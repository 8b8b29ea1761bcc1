"""One exception hierarchy for the whole pipeline.

Three kinds of failure matter to a caller, and each maps to one wire status:

* ``ConfigError``  - the operator's fault; the process exits 2 before starting anything.
* ``InvalidData``  - the client's fault; 4xx / ``INVALID_ARGUMENT``, never retried
  (``TooLarge``, over a configured limit: 413 / ``RESOURCE_EXHAUSTED``).
* ``Retryable``    - downstream is full or unavailable; ``UNAVAILABLE`` / 503, the client retries.
"""

from __future__ import annotations


class SpanprofError(Exception):
    """Base class of every error spanprof raises on purpose."""


class ConfigError(SpanprofError):
    """One or more configuration problems, each prefixed with the YAML key path."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class InvalidData(SpanprofError):
    """The request itself is malformed; retrying it cannot succeed."""


class PartlyStored(InvalidData):
    """Some consumers of a fan-out took the batch and another refused it for good: giving
    it again would store it twice where it was taken (``pipeline.component.Fanout``)."""


class TooLarge(InvalidData):
    """The request is over a configured limit (size, decompressed size, items); the message
    names the config key."""


class Retryable(SpanprofError):
    """The data was not accepted now but may be later (queue full, sink down).

    ``retry_after`` is a hint in seconds for the client (``Retry-After`` / ``RetryInfo``).
    """

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
