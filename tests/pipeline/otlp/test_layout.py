"""pipeline/otlp/layout.py: an opentelemetry-proto whose profiles ``Sample`` has an older
field layout is refused at start-up (exit 2, naming the installed and the needed version);
the layouts are those of the PyPI wheels, rebuilt here as descriptors in a private pool."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from opentelemetry.proto.profiles.v1development import profiles_pb2

from pipeline.errors import ConfigError
from pipeline.otlp import layout
from pipeline.otlp.layout import (
    REQUIRED_VERSION,
    SAMPLE_FIELDS,
    check_profiles_layout,
    sample_layout_problem,
)

ROOT = Path(__file__).resolve().parents[3]
F = descriptor_pb2.FieldDescriptorProto
I32, I64, FX64 = F.TYPE_INT32, F.TYPE_INT64, F.TYPE_FIXED64
ONE, MANY = F.LABEL_OPTIONAL, F.LABEL_REPEATED

# Sample as each opentelemetry-proto release line numbers it (name, number, type, label)
V1_8 = [("locations_start_index", 1, I32, ONE), ("locations_length", 2, I32, ONE),
        ("value", 3, I64, MANY), ("attribute_indices", 4, I32, MANY),
        ("link_index", 5, I32, ONE), ("timestamps_unix_nano", 6, FX64, MANY)]  # 1.38-1.39
V1_9 = [("stack_index", 1, I32, ONE), ("values", 2, I64, MANY),
        ("attribute_indices", 3, I32, MANY), ("link_index", 4, I32, ONE),
        ("timestamps_unix_nano", 5, FX64, MANY)]  # 1.40-1.42
V1_10 = [("stack_index", 1, I32, ONE), ("attribute_indices", 2, I32, MANY),
         ("link_index", 3, I32, ONE), ("values", 4, I64, MANY),
         ("timestamps_unix_nano", 5, FX64, MANY)]  # 1.43 on

_POOLS: list[Any] = []  # keep each private pool alive as long as its descriptors


def sample_descriptor(fields: list[tuple[str, int, int, int]]) -> Any:
    """A ``Sample`` descriptor with these fields, in the profiles package, in its own pool."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"fake_profiles_{len(_POOLS)}.proto", syntax="proto3",
        package="opentelemetry.proto.profiles.v1development")
    msg = fdp.message_type.add(name="Sample")
    for name, number, type_, label in fields:
        msg.field.add(name=name, number=number, type=type_, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    _POOLS.append(pool)
    return pool.FindMessageTypeByName("opentelemetry.proto.profiles.v1development.Sample")


class TestSampleLayout:
    def test_installed_release_has_the_current_layout(self) -> None:
        """The opentelemetry-proto in this environment passes, and it numbers Sample as
        the v1.10 layout the decoder reads."""
        check_profiles_layout()
        assert sample_layout_problem(profiles_pb2.Sample.DESCRIPTOR) == ""
        assert {f.name: f.number for f in profiles_pb2.Sample.DESCRIPTOR.fields} == \
            SAMPLE_FIELDS

    def test_current_layout_passes(self) -> None:
        """A descriptor numbered as OTLP profiles v1.10 (opentelemetry-proto 1.43 on) passes."""
        check_profiles_layout(sample_descriptor(V1_10), version="1.43.0")

    def test_v1_9_layout_is_refused_naming_both_versions(self) -> None:
        """1.40-1.42's Sample (values=2, attribute_indices=3, link_index=4) is refused with
        one message naming the installed version, what differs and the version needed."""
        with pytest.raises(ConfigError) as err:
            check_profiles_layout(sample_descriptor(V1_9), version="1.42.1")
        assert err.value.problems == [
            "opentelemetry-proto 1.42.1 is installed, but its OTLP profiles Sample "
            "(opentelemetry.proto.profiles.v1development.Sample) has an older field layout "
            "(attribute_indices=3, link_index=4, values=2; spanprof reads stack_index=1, "
            "attribute_indices=2, link_index=3, values=4, timestamps_unix_nano=5): the values "
            "of current clients' samples would be misread. spanprof needs "
            "opentelemetry-proto>=1.43.0 (OTLP profiles v1.10.0): "
            "pip install 'opentelemetry-proto>=1.43.0'"]

    def test_v1_8_layout_is_refused_naming_absent_fields(self) -> None:
        """1.38-1.39's Sample has no stack_index nor values: both are named as absent."""
        assert sample_layout_problem(sample_descriptor(V1_8)) == (
            "stack_index absent, attribute_indices=4, link_index=5, values absent, "
            "timestamps_unix_nano=6")
        with pytest.raises(ConfigError, match=r"opentelemetry-proto 1\.38\.0 is installed"):
            check_profiles_layout(sample_descriptor(V1_8), version="1.38.0")

    def test_the_installed_version_is_named(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without ``version=`` the message names the installed distribution's version, or
        says it is unknown when there is no distribution metadata."""
        old = sample_descriptor(V1_9)
        with pytest.raises(ConfigError, match=re.escape(
                f"opentelemetry-proto {metadata.version('opentelemetry-proto')} is installed")):
            check_profiles_layout(old)

        def missing(name: str) -> str:
            raise metadata.PackageNotFoundError(name)

        monkeypatch.setattr(layout.metadata, "version", missing)
        with pytest.raises(ConfigError, match=re.escape(
                "opentelemetry-proto (version unknown) is installed")):
            check_profiles_layout(old)

    def test_pin_and_check_name_the_same_release(self) -> None:
        """pyproject.toml pins opentelemetry-proto to the release the check asks for."""
        deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        pins = [d for d in deps if d.startswith("opentelemetry-proto")]
        assert len(pins) == 1
        floor = pins[0].removeprefix("opentelemetry-proto>=")
        assert REQUIRED_VERSION.split(".")[:2] == floor.split(".")[:2]


# spanprof's CLI in a fresh interpreter whose installed Sample is the 1.40-1.42 one
_OLD_PROTO_CLI = """\
import sys
from pipeline.otlp import layout
from tests.pipeline.otlp.test_layout import V1_9, sample_descriptor
layout._installed_sample = lambda: sample_descriptor(V1_9)
layout._installed_version = lambda: "1.42.1"
from pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


class TestStartUp:
    @pytest.mark.parametrize("command", ["validate", "run"])
    def test_old_layout_exits_2_before_anything_starts(self, command: str) -> None:
        """`spanprof validate` and `spanprof run` exit 2 with one `error:` line naming the
        installed and the needed opentelemetry-proto, as for a configuration error; `run`
        starts nothing (the config's ports stay free, the process ends at once)."""
        res = subprocess.run(
            [sys.executable, "-c", _OLD_PROTO_CLI, command, "-c", "config/gateway.yaml"],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
            env={"PATH": "/usr/bin:/bin", "SPANPROF_OTLP_GRPC_ENDPOINT": "127.0.0.1:1"})
        assert res.returncode == 2, res
        lines = res.stderr.splitlines()
        assert len(lines) == 1, res.stderr
        assert lines[0].startswith("error: opentelemetry-proto 1.42.1 is installed, but its "
                                   "OTLP profiles Sample")
        assert "spanprof needs opentelemetry-proto>=1.43.0" in lines[0]
        assert res.stdout == ""
