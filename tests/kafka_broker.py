"""A real single-node Apache Kafka broker (KRaft) for tests and benchmarks.

The jars come from Maven Central through ``tests/kafka/pom.xml`` (``mvn
dependency:copy-dependencies``) and are cached in ``~/.cache/spanprof/kafka-VERSION``
(``SPANPROF_CACHE`` overrides the root); storage is formatted in a fresh directory and the
broker listens on free loopback ports. No mock: the tests talk to Kafka itself.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from tests.cachelock import cache_lock

ROOT = Path(__file__).resolve().parent.parent
POM = ROOT / "tests" / "kafka" / "pom.xml"
KAFKA_VERSION = "4.4.0"


class KafkaUnavailable(RuntimeError):
    pass


def _free_port() -> int:
    from tests.conftest import free_port

    return free_port()


def kafka_libs() -> Path:
    """The broker's jars, fetched once with Maven."""
    with cache_lock("kafka"):
        return _kafka_libs()


def _kafka_libs() -> Path:
    cache = Path(os.environ.get("SPANPROF_CACHE", Path.home() / ".cache" / "spanprof"))
    libs = cache / f"kafka-{KAFKA_VERSION}" / "libs"
    if (libs / f"kafka_2.13-{KAFKA_VERSION}.jar").exists():
        return libs
    for tool, pkg in (("java", "a Java 17+ runtime (e.g. apt-get install openjdk-17-jre)"),
                      ("mvn", "Apache Maven (e.g. apt-get install maven)")):
        if shutil.which(tool) is None:
            raise KafkaUnavailable(f"the Kafka tests need `{tool}` on PATH: install {pkg}")
    tmp = libs.with_name("libs.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    res = subprocess.run(
        ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
         f"-DoutputDirectory={tmp}", f"-Dkafka.version={KAFKA_VERSION}"],
        capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise KafkaUnavailable(f"fetching Kafka {KAFKA_VERSION} with Maven failed:\n"
                               f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    tmp.rename(libs)
    return libs


class KafkaBroker:
    """``start()`` formats storage and launches the broker; ``stop()`` ends it.

    ``stop()`` and ``start()`` again keep the data (same ports), so a test can take the
    broker away from a running pipeline and bring it back.
    """

    def __init__(self, workdir: Path, partitions: int = 6,
                 secure: tuple[Path, Path, dict[str, str]] | None = None) -> None:
        """``secure``: (certificate, key, SASL PLAIN users) of a second listener that
        takes TLS and SASL (``SASL_SSL``) on ``secure_port``, beside the plain one."""
        self.workdir = workdir
        self.secure = secure
        self.secure_port = _free_port() if secure else 0
        self.port = _free_port()
        self.controller_port = _free_port()
        self.partitions = partitions
        self.proc: subprocess.Popen[bytes] | None = None
        self.libs = kafka_libs()
        self._formatted = False

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},"
                         f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.workdir / "data"),
            "num.partitions": str(self.partitions),
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "6",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "true",
            "log.flush.interval.messages": "1",
        }
        if self.secure is not None:
            cert, key, users = self.secure
            # Kafka reads a PEM keystore: the PKCS#8 key and its certificate in one file
            pem = self.workdir / "secure-keystore.pem"
            self.workdir.mkdir(parents=True, exist_ok=True)
            pem.write_bytes(key.read_bytes() + cert.read_bytes())
            name = "listener.name.secure."
            jaas = " ".join(f'user_{u}="{p}"' for u, p in users.items())
            props.update({
                "listeners": props["listeners"] + f",SECURE://127.0.0.1:{self.secure_port}",
                "advertised.listeners": props["advertised.listeners"]
                + f",SECURE://127.0.0.1:{self.secure_port}",
                "listener.security.protocol.map": props["listener.security.protocol.map"]
                + ",SECURE:SASL_SSL",
                "inter.broker.listener.name": "PLAINTEXT",
                name + "sasl.enabled.mechanisms": "PLAIN",
                name + "plain.sasl.jaas.config":
                    "org.apache.kafka.common.security.plain.PlainLoginModule required "
                    f"{jaas};",
                name + "ssl.keystore.type": "PEM",
                name + "ssl.keystore.location": str(pem),
            })
        path = self.workdir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _java(self, *args: str) -> list[str]:
        return ["java", "-Xms128m", "-Xmx512m", "-XX:+UseSerialGC",
                "-cp", f"{self.libs}/*", *args]

    def start(self, timeout: float = 90.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        if not self._formatted:
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            res = subprocess.run(self._java("kafka.tools.StorageTool", "format",
                                            # one argument: an id may start with "-"
                                            f"--cluster-id={cluster_id}", "-c", str(config)),
                                 capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                raise KafkaUnavailable(f"kafka storage format failed: {res.stderr[-2000:]}")
            self._formatted = True
        log_path = self.workdir / "broker.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        log = open(log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(self._java("kafka.Kafka", str(config)),
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise KafkaUnavailable(f"kafka exited {self.proc.returncode}:\n{self.logs()}")
            with open(log_path, "rb") as fh:  # only what this start wrote
                fh.seek(offset)
                if b"Kafka Server started" in fh.read():
                    return
            time.sleep(0.2)
        raise KafkaUnavailable(f"kafka did not start in {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        p = self.workdir / "broker.log"
        return p.read_text(errors="replace")[-5000:] if p.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


async def create_topics(bootstrap: str, *names: str, partitions: int = 6) -> None:
    """Create topics with ``partitions`` partitions (replication 1: one broker)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, partitions, 1) for n in names])
    finally:
        await admin.close()
