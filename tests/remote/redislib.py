"""A redis-server of the tests' own (the remote tier's tests and benchmarks/bench_remote.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time


class RedisServer:
    """A redis-server of its own (no persistence) on a Unix socket in a temporary directory; with ``tls``, also
    a TLS port on localhost (``url`` is then the ``rediss://`` one; the Unix socket stays plain)."""

    def __init__(self, *args: str, tls: "Certs | None" = None, clients: str = "optional",
                 binary: str = "redis-server") -> None:
        """``args``: more redis-server options (``--requirepass``...); ``tls``: the server's certificates;
        ``clients``: ``--tls-auth-clients`` (``yes``: a client certificate is required); ``binary``: the
        program to start (e.g. ``.redis-bundle/bin/redis-server``, made by scripts/redis-bundle.sh)."""
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.url = f"unix://{self.socket}"
        if tls is not None:
            port = free_port()
            args = (*args, "--tls-port", str(port), "--tls-cert-file", tls.server_cert, "--tls-key-file",
                    tls.server_key, "--tls-ca-cert-file", tls.ca, "--tls-auth-clients", clients)
            self.url = f"rediss://localhost:{port}/0"
        self.args = args
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [self.binary, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", self.dir, *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server {' '.join(self.args)} exited with {self.proc.returncode}")
            try:
                if self.client().ping():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def client(self):
        import redis

        password = self.args[self.args.index("--requirepass") + 1] if "--requirepass" in self.args else None
        return redis.Redis(unix_socket_path=self.socket, socket_timeout=5, password=password)

    def keys(self, pattern: str) -> list[bytes]:
        return self.client().keys(pattern)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one must be able to exit
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def free_port() -> int:
    """A TCP port nothing listens on now (and its cluster bus port, +10000, neither)."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisCluster:
    """Three redis-server masters on localhost TCP ports, joined into one Redis Cluster; with ``tls``, every node
    listens with TLS only (its client port and its cluster bus) and ``url`` is a ``rediss://`` one."""

    def __init__(self, tls: "Certs | None" = None, clients: str = "optional") -> None:
        """``tls``: the nodes' certificates; ``clients``: ``--tls-auth-clients`` (``yes``: a client certificate
        is required, also of the nodes among themselves and of redis-cli)."""
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-cluster-")
        self.ports = [free_port() for _ in range(3)]
        self.tls = tls
        self.clients = clients
        self.url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{self.ports[0]}/0"
        self.procs: list[subprocess.Popen] = []

    def _port_args(self, port: int) -> list[str]:
        if self.tls is None:
            return ["--port", str(port)]
        t = self.tls
        return ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-cert-file", t.server_cert,
                "--tls-key-file", t.server_key, "--tls-ca-cert-file", t.ca, "--tls-auth-clients", self.clients,
                # the bus: a node is the client of the others, with the same certificate
                "--tls-client-cert-file", t.server_cert, "--tls-client-key-file", t.server_key]

    def cli(self, *args: str) -> list[str]:
        """A redis-cli command line that reaches the nodes (with the client certificate under TLS)."""
        if self.tls is None:
            return ["redis-cli", *args]
        t = self.tls
        return ["redis-cli", "--tls", "--cacert", t.ca, "--cert", t.client_cert, "--key", t.client_key, *args]

    def start(self) -> "RedisCluster":
        for port in self.ports:
            d = os.path.join(self.dir, str(port))
            os.makedirs(d)
            self.procs.append(subprocess.Popen(
                ["redis-server", *self._port_args(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no", "--dir", d],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        deadline = time.monotonic() + 20
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a cluster node exited with {p.returncode} (TLS: {self.tls is not None})")
            out = subprocess.run(self.cli("--cluster", "create", *nodes, "--cluster-replicas", "0",
                                          "--cluster-yes"), capture_output=True, text=True)
            if out.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not form: {out.stdout[-500:]} {out.stderr[-500:]}")
            time.sleep(0.2)
        while subprocess.run(self.cli("-h", "127.0.0.1", "-p", str(self.ports[0]), "cluster", "info"),
                             capture_output=True, text=True).stdout.find("cluster_state:ok") < 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster is not ok")
            time.sleep(0.1)
        return self

    def keys(self, pattern: str) -> list[bytes]:
        """The keys matching ``pattern`` on all nodes (asked with redis-cli, so a TLS cluster needs no client
        of the test's own)."""
        return [k for port in self.ports for k in self._keys(port, pattern)]

    def _keys(self, port: int, pattern: str) -> list[bytes]:
        out = subprocess.run(self.cli("-h", "127.0.0.1", "-p", str(port), "--raw", "keys", pattern),
                             capture_output=True, check=True)
        return [k for k in out.stdout.split(b"\n") if k]

    def nodes_with_keys(self, pattern: str) -> int:
        """How many nodes hold a key matching ``pattern``."""
        return sum(1 for port in self.ports if self._keys(port, pattern))

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


class Certs:
    """A throwaway CA, a server certificate it signed (for localhost and 127.0.0.1), a client certificate it
    signed, and another CA that signed nothing of these; PEM files in ``dir`` (made with the openssl CLI)."""

    def __init__(self, dir: str) -> None:
        self.dir = dir
        self.ca, self.ca_key = self._path("ca.crt"), self._path("ca.key")
        self.server_cert, self.server_key = self._path("server.crt"), self._path("server.key")
        self.client_cert, self.client_key = self._path("client.crt"), self._path("client.key")
        self.other_ca = self._path("other-ca.crt")
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
        self._openssl("req", "-x509", *key, "-keyout", self.ca_key, "-out", self.ca, "-days", "2",
                      "-subj", "/CN=kvpool test CA")
        self._openssl("req", "-x509", *key, "-keyout", self._path("other-ca.key"), "-out", self.other_ca,
                      "-days", "2", "-subj", "/CN=kvpool other CA")
        for name, cn, ext in (("server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
                              ("client", "kvpoold", "extendedKeyUsage=clientAuth")):
            csr = self._path(f"{name}.csr")
            self._openssl("req", *key, "-keyout", self._path(f"{name}.key"), "-out", csr, "-subj", f"/CN={cn}")
            with open(self._path(f"{name}.ext"), "w") as f:
                f.write(ext + "\n")
            self._openssl("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", self.ca_key, "-CAcreateserial",
                          "-out", self._path(f"{name}.crt"), "-days", "2", "-extfile", self._path(f"{name}.ext"))

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    @staticmethod
    def _openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
