"""Is the installed opentelemetry-proto's profiles ``Sample`` the layout spanprof decodes?

``opentelemetry.proto.profiles.v1development`` keeps its package name while its field
numbers change, so a mismatch is not an import error but a silent misreading. Python's
opentelemetry-proto 1.40-1.42 (OTLP proto v1.9.0) number ``Sample`` as values=2,
attribute_indices=3, link_index=4; 1.43.0 (OTLP proto v1.10.0) moved ``values`` to 4
(attribute_indices=2, link_index=3). Decoded with the older classes, a current client's
sample parses without an error: its attribute indices are read as its values, its link
index as an attribute index, and its real values are dropped as an unknown field. 1.38-1.39
(v1.8) have no ``stack_index`` at all. So the check looks at the descriptor's field names
and numbers, not at the version string: ``spanprof run`` and ``validate`` call
``check_profiles_layout`` first and exit 2 naming the installed version and the one needed.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from pipeline.errors import ConfigError

__all__ = ["REQUIRED_VERSION", "SAMPLE_FIELDS", "check_profiles_layout", "sample_layout_problem"]

# the first opentelemetry-proto release whose profiles Sample is numbered as below (PyPI
# wheels 1.37.0 to 1.45.2 compared; the pin in pyproject.toml says the same)
REQUIRED_VERSION = "1.43.0"
# the Sample fields spanprof reads (pipeline/otlp/profiles.py), by OTLP profiles v1.10.0
SAMPLE_FIELDS = {"stack_index": 1, "attribute_indices": 2, "link_index": 3, "values": 4,
                 "timestamps_unix_nano": 5}


def sample_layout_problem(sample: Any) -> str:
    """"" when the ``Sample`` descriptor numbers every field as ``SAMPLE_FIELDS`` does, else
    what it has instead (``values=2``, ``stack_index absent``, ...)."""
    found = {f.name: f.number for f in sample.fields}
    wrong = [f"{name}={found[name]}" if name in found else f"{name} absent"
             for name, number in SAMPLE_FIELDS.items() if found.get(name) != number]
    return ", ".join(wrong)


def _installed_version() -> str:
    try:
        return metadata.version("opentelemetry-proto")
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def _installed_sample() -> Any:
    from opentelemetry.proto.profiles.v1development import profiles_pb2

    return profiles_pb2.Sample.DESCRIPTOR


def check_profiles_layout(sample: Any = None, version: str | None = None) -> None:
    """Raise ``ConfigError`` unless the installed ``Sample`` has the current layout.

    ``sample`` is a ``Descriptor`` (default: the installed one), ``version`` what to call
    the installed opentelemetry-proto in the message (default: its distribution version).
    """
    if sample is None:
        sample = _installed_sample()
    problem = sample_layout_problem(sample)
    if not problem:
        return
    expected = ", ".join(f"{k}={v}" for k, v in SAMPLE_FIELDS.items())
    raise ConfigError(
        f"opentelemetry-proto {version or _installed_version()} is installed, but its OTLP "
        f"profiles Sample ({sample.full_name}) has an older field layout ({problem}; spanprof "
        f"reads {expected}): the values of current clients' samples would be misread. "
        f"spanprof needs opentelemetry-proto>={REQUIRED_VERSION} (OTLP profiles v1.10.0): "
        f"pip install 'opentelemetry-proto>={REQUIRED_VERSION}'")
