"""A real multi-node Ray cluster on one machine: a head and worker nodes, each started by `ray start`
(`eagleray cluster up|down|check`, infer/cluster/cli.py).

Each node has a temp dir of its own (its sessions, sockets, logs), its own CPU count and object store, and a
custom resource naming its role (`eagleray_head`, `eagleray_worker`, and `eagleray_<name>` per node), so a
config can place work on worker nodes. Every port a second Ray on the machine would collide on is chosen free.
Processes are found by their node's temp dir on the command line (the client server by the GCS address), with
their children: stopping the cluster stops them and nothing else (`ray stop` ends every Ray on the machine,
a test run's or a user's beside it). The head's GCS notices a dead node in ~5 s (`HEALTH_ENV`).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.cluster import RAY_ENV

ROOT = Path(__file__).resolve().parents[2]

# Read by the head's GCS at start: a node whose raylet is gone (its health RPC refused at once) is marked
# dead after 5 checks a second apart, ~5 s (Ray's defaults: 5 checks 3 s apart after a 5 s delay, ~20 s).
# The timeout stays Ray's 10 s: on a loaded 2-core box a live raylet can take seconds to answer, and with
# a 1 s timeout the GCS declared live nodes dead and every raylet exited (measured).
HEALTH_ENV = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
              "RAY_health_check_timeout_ms": "10000", "RAY_health_check_failure_threshold": "5"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_env() -> dict[str, str]:
    """The environment every node and `ray job submit` runs with: the project's Ray settings, and this
    Python's bin first on PATH so a job's `python` is the project's."""
    bin_dir = str(Path(sys.executable).parent)
    # RAY_ENV's RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps a single-node Ray on 127.0.0.1 and also refuses a
    # second node; nodes here name their address (127.0.0.1) themselves.
    return {**os.environ, **RAY_ENV, **HEALTH_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def head_markers(temp_dir: str, address: str) -> tuple[str, str]:
    """What names a head's processes on their command lines: its temp dir, and the GCS address (the client
    server names no temp dir)."""
    return (temp_dir.rstrip("/") + "/", f"--address={address}")


@dataclass
class Node:
    name: str
    temp_dir: str
    num_cpus: float
    object_store_mb: int | None = None  # None: Ray's default (30% of memory)
    resources: dict[str, float] = field(default_factory=dict)
    head: bool = False


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def image_paths() -> list[str]:
    """What a node's machine image would hold, the only folders a private-disk node sees of this one's:
    the code, the venv, the Python the venv was made from (here under $HOME, ~/.pyenv)."""
    return list(dict.fromkeys(str(Path(p).resolve()) for p in (ROOT, sys.prefix, sys.base_prefix)))


def private_paths(root: str, extra=()) -> list[str]:
    """The folders a private-disk node gets fresh and empty: /tmp, $HOME (~/.cache with it), the store's
    cache, the cluster's root, `extra`; one inside another is left to it unless an image path lies between."""
    paths = ["/tmp", str(Path.home()), os.environ.get("EAGLERAY_CACHE"), root, *extra]
    paths, image = list(dict.fromkeys(str(Path(p).resolve()) for p in paths if p)), image_paths()

    def covered(p: str) -> bool:
        return any(q != p and under(p, q) and not any(under(k, q) and under(p, k) for k in image)
                   for q in paths)
    return [p for p in paths if not covered(p)]


def private_disk_script(temp_dir: str, private: list[str]) -> str:
    """The shell script run in a fresh mount namespace before `ray start` ("$@"): a machine of its own.
    The image paths are bind-held under a tmpfs on /run first (the tmpfs over /tmp or $HOME hides them),
    then every mount goes in shallowest first, so an image path inside a private tmpfs is bound back into it
    read-only, and a private folder inside the (read-only) code gets its tmpfs on top. /dev/shm, Ray's
    object store, is the node's own too."""
    q = shlex.quote
    image = image_paths()
    hold = "/run" if os.path.isdir("/run") and not any(under("/run", p) for p in private) else "/mnt"
    lines = ["set -e", f"hold=$(mktemp -d {hold}/eagleray-node-XXXXXX)",
             'mount -t tmpfs eagleray-hold "$hold"']
    for i, p in enumerate(image):
        lines += [f'mkdir "$hold/{i}"', f'mount --bind {q(p)} "$hold/{i}"']
    targets = [(p, None) for p in private] + [(p, i) for i, p in enumerate(image)]
    for p, i in sorted(targets, key=lambda t: (t[0].count("/"), t[0])):  # one command a line: `set -e` holds
        lines += [f"mkdir -p {q(p)}", f"mount -t tmpfs eagleray-node {q(p)}"] if i is None else [
            f"mkdir -p {q(p)}", f'mount --bind "$hold/{i}" {q(p)}', f"mount -o remount,ro,bind {q(p)}"]
    lines += [f'umount "$hold/{i}"' for i in range(len(image))]
    lines += ['umount "$hold"', 'rmdir "$hold"', "mount -t tmpfs eagleray-shm /dev/shm",
              f"mkdir -p {q(temp_dir)}", 'exec "$@"']
    return "\n".join(lines)


def start_node(node: Node, head_address: str | None = None, env: dict | None = None,
               private: list[str] | None = None) -> dict:
    """`ray start` for one node (the head when head_address is None). -> its addresses (head only).
    `private` (a worker): its mount namespace of its own, those folders fresh and empty, the image paths
    read-only (`private_disk_script`); its processes stay in it, and a restart gets a new one."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    args = [ray_bin, "start", "--node-ip-address=127.0.0.1", f"--temp-dir={node.temp_dir}",
            f"--num-cpus={node.num_cpus:g}", f"--resources={json.dumps(node.resources)}", "--disable-usage-stats"]
    if node.object_store_mb:
        args.append(f"--object-store-memory={node.object_store_mb * 2 ** 20}")
    out = {}
    if head_address is None:
        port, dash, agent, client = free_port(), free_port(), free_port(), free_port()
        # The job agent's HTTP port (52365) and the client server's (10001) are fixed by default: another
        # Ray on this machine holds them, and then `ray job submit` finds no agent.
        args += ["--head", f"--port={port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                 "--include-dashboard=true", f"--dashboard-agent-listen-port={agent}",
                 f"--ray-client-server-port={client}"]
        out = {"address": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}"}
    else:
        args += [f"--address={head_address}", "--dashboard-agent-listen-port=0"]
    if private is not None and head_address is not None:
        for p in private:  # a tmpfs goes on a folder; inside the read-only code it must be there already
            Path(p).mkdir(parents=True, exist_ok=True)
        args = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                private_disk_script(node.temp_dir, private), "sh", *args]
    res = subprocess.run(args, env=env or ray_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode:
        raise RuntimeError(f"ray start ({node.name}) failed: {res.stderr.strip().splitlines()[-1:]}")
    return out


def processes(markers) -> list:
    """Every process whose command line names a marker, with its children (agents and workers rename
    themselves, "ray::DashboardAgent", so the tree is taken whole)."""
    import psutil

    procs = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(m in a for a in (p.info["cmdline"] or []) for m in markers):
                procs += [p, *p.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return list({p.pid: p for p in procs}.values())


def stop_processes(markers) -> list[str]:
    """SIGTERM, then SIGKILL after 3 s, every process of `processes(markers)`, gone on return; -> their command
    lines."""
    import psutil

    procs, names = processes(markers), []
    for p in procs:
        try:
            names.append(" ".join(p.cmdline()))
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=3)  # some ignore SIGTERM for 10 s+
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)  # a killed raylet is still listed, whole, while the kernel tears it down
    return names


# What every process that talks to the local S3 server reads (moto takes any credentials unless `auth`).
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "eagleray", "AWS_SECRET_ACCESS_KEY": "eagleray-local", "AWS_REGION": "us-east-1"}


class S3Server:
    """moto's S3-compatible server (`python -m moto.server`, the test extra) on a free 127.0.0.1 port, with
    `buckets` created; the store the nodes share. `auth=True` makes it check credentials (IAM), so keys it
    does not know are refused. Stopped by pid."""

    def __init__(self, buckets=("eagleray",), auth: bool = False):
        self.port, self.buckets, self.auth, self.proc = free_port(), tuple(buckets), auth, None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment a node or job needs to use this server through plain `s3://` URIs."""
        return {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def uri(self, path: str) -> str:
        """`s3://path` with this server named in the query (for processes without `env`)."""
        return f"s3://{path.strip('/')}?endpoint_override=127.0.0.1:{self.port}&scheme=http"

    def start(self, wait_s: float = 60) -> "S3Server":
        import urllib.request

        env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if self.auth else {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + wait_s
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2)
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"moto S3 server did not start on port {self.port}") from None
                time.sleep(0.3)
        if not self.auth:
            import pyarrow.fs as pafs

            fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{self.port}", scheme="http", region="us-east-1",
                                   access_key=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                   secret_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"], allow_bucket_creation=True)
            for b in self.buckets:
                fs.create_dir(b)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalCluster:
    """A head and `workers` worker nodes under `root` (one temp dir per node). Context manager: stops on exit."""

    def __init__(self, root: Path | None = None, workers: int = 2, head_cpus: float = 1, worker_cpus: float = 2,
                 object_store_mb: int = 512, env: dict | None = None, private_disks: bool = False,
                 private: list[str] = ()):
        """`env`: more environment for every node and job (S3Server.env: the store the nodes share).
        `private_disks`: each worker node sees none of this machine's files but the code (read-only), as a
        real cluster's nodes would: only the S3 store and Ray itself are shared (`private_paths`, with
        `private` folders too). The head stays on this machine's disks: it runs the job drivers."""
        self.root = Path(root or tempfile.mkdtemp(prefix="er-cluster-", dir="/tmp"))
        self.private = private_paths(str(self.root), private) if private_disks else None
        self.env = {**ray_env(), **(env or {})}
        self.nodes = [Node("head", str(self.root / "head"), head_cpus, object_store_mb,
                           {"eagleray_head": 1}, head=True)]
        self.nodes += [Node(f"worker{i}", str(self.root / f"worker{i}"), worker_cpus, object_store_mb,
                            {"eagleray_worker": 1, f"eagleray_worker{i}": 1}) for i in range(1, workers + 1)]
        self.address = self.dashboard = None

    @property
    def markers(self) -> tuple[str, ...]:
        return head_markers(str(self.root), self.address) if self.address else (str(self.root) + "/",)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start(self, wait_s: float = 120) -> "LocalCluster":
        for n in self.nodes:
            Path(n.temp_dir).mkdir(parents=True, exist_ok=True)
        head = start_node(self.nodes[0], env=self.env)
        self.address, self.dashboard = head["address"], head["dashboard"]
        self.env["RAY_ADDRESS"] = self.address
        for n in self.nodes[1:]:
            start_node(n, self.address, self.env, self.private)
        self.wait_alive(len(self.nodes), wait_s)
        return self

    def alive_nodes(self) -> list[dict]:
        """The cluster's live nodes as the GCS reports them (the state API, through the dashboard)."""
        from ray.util.state import list_nodes

        return [n.__dict__ if hasattr(n, "__dict__") else dict(n)
                for n in list_nodes(address=self.dashboard, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)]

    def actor_nodes(self, class_part: str) -> list[str]:
        """The node of every actor, alive or ended, whose class name holds `class_part` (the state API)."""
        from ray.util.state import list_actors

        return [a.node_id for a in list_actors(address=self.dashboard, detail=True, limit=10000,
                                               raise_on_missing_output=False) if class_part in a.class_name]

    def wait_alive(self, count: int, wait_s: float) -> list[dict]:
        deadline = time.time() + wait_s
        while True:
            try:
                nodes = self.alive_nodes()
                if len(nodes) == count:
                    return nodes
            except Exception:  # noqa: BLE001 - the dashboard answers a few seconds after `ray start`
                nodes = []
            if time.time() > deadline:
                raise TimeoutError(f"local cluster: {len(nodes)} of {count} nodes alive after {wait_s:.0f} s")
            time.sleep(1)

    def raylet(self, name: str):
        """The raylet process of node `name`."""
        procs = [p for p in processes((self.node(name).temp_dir + "/",)) if p.name() == "raylet"]
        if len(procs) != 1:
            raise RuntimeError(f"{name}: {len(procs)} raylets found")
        return procs[0]

    def kill_node(self, name: str) -> int:
        """`kill -9` of a worker node's raylet (a node lost): its workers die with it. -> the raylet's pid."""
        pid = self.raylet(name).pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def restart_node(self, name: str) -> None:
        """Start a node again (a replacement machine joining): its leftover processes are stopped first."""
        node = self.node(name)
        stop_processes((node.temp_dir + "/",))
        start_node(node, self.address, self.env, self.private)

    def stop(self) -> list[str]:
        return stop_processes(self.markers)

    def submit(self, entrypoint: list[str], submission_id: str | None = None, wait: bool = True,
               timeout_s: float = 1200) -> subprocess.CompletedProcess | subprocess.Popen:
        """`ray job submit --working-dir <repo> -- ENTRYPOINT` (retried while the head's job agent has not
        registered: "No available agent" is Ray's try-again answer on a loaded machine)."""
        args = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", self.dashboard,
                "--working-dir", str(ROOT), *(["--submission-id", submission_id] if submission_id else []),
                *([] if wait else ["--no-wait"]), "--", *entrypoint]
        for _ in range(8):
            res = subprocess.run(args, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s)
            if res.returncode == 0 or "No available agent" not in res.stderr:
                return res
            time.sleep(10)
        return res

    def job_status(self, submission_id: str) -> str:
        from ray.job_submission import JobSubmissionClient

        return str(JobSubmissionClient(self.dashboard).get_job_status(submission_id).value)

    def job_logs(self, submission_id: str) -> str:
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard).get_job_logs(submission_id)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
