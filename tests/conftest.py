"""Shared fixtures: one local Ray per session, the repo's data/ folder, a tiny self-trained target."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
sys.path.insert(0, str(TOOLS))

import pipeline.cluster  # noqa: E402,F401 - sets Ray's environment (pipeline.cluster.RAY_ENV) before Ray starts


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The benchmark and chat files the repo ships (data/README.md): a clone needs nothing beside it."""
    return REPO / "data"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head() -> dict:
    """`ray start --head` on free ports (2 CPUs, 127.0.0.1, job server on), in a temp dir of its own that
    marks its processes: `stop_head` then stops this cluster only (`ray stop` would kill every Ray on the
    machine, a CI run beside us included)."""
    import tempfile

    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    port, dash, agent, client = _free_port(), _free_port(), _free_port(), _free_port()
    temp_dir = tempfile.mkdtemp(prefix="er-ray-", dir="/tmp")
    subprocess.run([str(bin_dir / "ray"), "start", "--head", f"--port={port}", "--num-cpus=2",
                    "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                    "--include-dashboard=true", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                    # the job agent's HTTP port (52365) and the client server's (10001) are fixed by default:
                    # another Ray on this machine (a training run beside the tests) holds them, and then
                    # `ray job submit` finds no agent
                    f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}"],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    gcs = f"127.0.0.1:{port}"
    # The client server names no temp dir, only the GCS address, and `ray start` leaves it to init.
    return {"address": gcs, "dashboard": f"http://127.0.0.1:{dash}", "env": env,
            "markers": (temp_dir, f"--address={gcs}")}


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray head for the whole session, joined by this process; tests that run pipelines in
    subprocesses or through `ray job submit` join the same one."""
    import ray

    head = start_head()
    ray.init(address=head["address"], log_to_driver=False)
    yield {k: head[k] for k in ("address", "dashboard", "env")}
    ray.shutdown()
    stop_head(head["markers"])


def stop_head(markers: tuple[str, ...]) -> list[str]:
    """Stop every process whose command line names a marker, and their children; returns their command
    lines."""
    import psutil

    procs = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(m in a for a in (p.info["cmdline"] or []) for m in markers):
                procs.append(p)
                # Agents and workers rename themselves ("ray::DashboardAgent"): take the whole tree.
                procs += p.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    procs = list({p.pid: p for p in procs}.values())
    names = []
    for p in procs:
        try:
            names.append(" ".join(p.cmdline()))
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=3)  # some ignore SIGTERM for 10 s+
    for p in alive:
        p.kill()
    return names


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> Path:
    """A 0.5 MB demo corpus (train.jsonl / val.jsonl) generated once per session."""
    import demo_corpus as dc

    out = tmp_path_factory.mktemp("corpus")
    dc.main(["--out", str(out), "--seed", "0", "--size-mb", "0.5"])
    return out


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, demo_corpus) -> Path:
    """The `tiny` preset target trained on the demo corpus: a real HF folder, built in ~20 s."""
    import demo_target as dt

    out = tmp_path_factory.mktemp("tiny_target")
    dt.main(["--out", str(out), "--preset", "tiny", "--corpus", str(demo_corpus / "train.jsonl")])
    return out


def write_yaml(path: Path, tree: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def pipeline_tree(run_dir: Path, target: Path, corpus: Path, records: int = 64, **stages) -> dict:
    """A small pipeline config as a dict (tests change what they need)."""
    tree = {"run_dir": str(run_dir), "target": str(target),
            "ingest": {"sources": [{"path": str(corpus), "format": "sharegpt", "max_records": records}]},
            "tokenize": {"max_length": 256},
            "capture": {"rows_per_shard": 16, "batch_tokens": 2048, "threads_per_actor": 1},
            "vocab": {"draft_vocab_size": 256}}
    for k, v in stages.items():
        tree.setdefault(k, {}).update(v)
    return tree


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory, ray_cluster, tiny_target, demo_corpus) -> Path:
    """The whole pipeline (ingest, tokenize, capture, vocab) on the tiny target: its run_dir."""
    from pipeline.__main__ import run
    from pipeline.yaml_config import load_config
    from pipeline.config import PipelineConfig

    run_dir = tmp_path_factory.mktemp("pipeline_run")
    cfg_path = write_yaml(run_dir / "cfg.yaml", pipeline_tree(run_dir, tiny_target, demo_corpus / "train.jsonl"))
    run(load_config(PipelineConfig, cfg_path))
    return run_dir


@pytest.fixture(scope="session")
def tiny_head(tmp_path_factory, ray_cluster, pipeline_run, tiny_target):
    """A head trained briefly on the tiny target's shards (1 worker), SGLang export folder. 240 steps (~40 s):
    enough that it leans on the aux states (chain tau ~2.4 at k=3), so a broken export shows in vLLM."""
    from pipeline.yaml_config import load_config
    from trainer.config import TrainConfig
    from trainer.driver import run_training

    out = tmp_path_factory.mktemp("tiny_head")
    tree = {"target": str(tiny_target), "out_dir": str(out),
            "data": {"shards": str(pipeline_run / "capture"), "max_rows_per_batch": 4, "val_rows": 0},
            "model": {"ttt_length": 3}, "optim": {"lr": 5e-3}, "max_steps": 240, "epochs": 20, "log_every": 20,
            "scaling": {"num_workers": 1, "cpus_per_worker": 1}}
    run_training(load_config(TrainConfig, write_yaml(out / "t.yaml", tree)))
    return out / "head_sglang"
