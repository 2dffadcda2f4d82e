"""Shared fixtures: one local Ray per session, the repo's data/ folder, a tiny self-trained target."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline.cluster  # noqa: F401 - sets Ray's environment (pipeline.cluster.RAY_ENV) before Ray starts
from infer.cluster.local import S3_CREDENTIALS

REPO = Path(__file__).resolve().parents[1]

# The local S3 server's credentials (tests/test_storage.py), set before the session's Ray starts so its
# workers inherit them; each test URI names the server's endpoint in its query.
for _k, _v in S3_CREDENTIALS.items():
    os.environ.setdefault(_k, _v)

# Under `make test` two xdist workers share the two cores, so each runs torch on one thread (and so do the
# processes it starts): two processes of two threads each slowed the tiny target's training 4.4x (OpenMP
# threads spinning on a busy core), one thread each 1.1x; its weights are the same bits either way.
TEST_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
if TEST_THREADS == 1:
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


SLOW_FIXTURES = {"ray_cluster", "vllm_python"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`make test` runs two pytest-xdist workers (`-n 2 --dist loadgroup`), each a session with its own
    fixtures (its own local Ray when a test of it needs one). The session fixtures every stage's tests read
    (`tiny_target`, `pipeline_run`, `tiny_head`, `tiny_dflash_head`) are `built_once` for both workers; a
    module whose tests share a module-scoped fixture (a served endpoint, a vLLM server) is one group, run on
    one worker in order, so that fixture is built once too. The rest fill both workers: most of a Ray test's
    wall is waiting on process starts, which leaves a core idle.

    The tiers: a test that starts a Ray cluster (any fixture built on `ray_cluster`) or a vLLM engine is
    slow, so `make check` (`-m "not slow"`) leaves it to `make test`."""
    for item in items:
        defs = item._fixtureinfo.name2fixturedefs
        if any(d[-1].scope == "module" for d in defs.values() if d):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        if SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder built by the first xdist worker that asks, under the run's shared temp root, and read by
    the others: the tiny target takes a core for tens of seconds, once per run instead of once per worker
    (one thread or two, its weights are the same bits)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    out, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a build cut short by an earlier failure
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The benchmark and chat files the repo ships (data/README.md): a clone needs nothing beside it."""
    return REPO / "data"


def start_head() -> dict:
    """A single-node Ray head (`ray start --head`, 2 CPUs, 127.0.0.1, job server on, free ports) in a temp
    dir of its own that marks its processes (infer/cluster/local.py, the one owner of `ray start`):
    `stop_head` then stops this cluster only (`ray stop` would kill every Ray on the machine, a CI run
    beside us included)."""
    import tempfile

    from infer.cluster.local import Node, head_markers, start_node

    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    temp_dir = tempfile.mkdtemp(prefix="er-ray-", dir="/tmp")
    head = start_node(Node("head", temp_dir, num_cpus=2, head=True), env=env)
    return {"address": head["address"], "dashboard": head["dashboard"], "env": env,
            "markers": head_markers(temp_dir, head["address"])}


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray head for the whole session, joined by this process; tests that run pipelines in
    subprocesses or through `ray job submit` join the same one."""
    import ray

    head = start_head()
    ray.init(address=head["address"], log_to_driver=False)
    yield {k: head[k] for k in ("address", "dashboard", "env", "markers")}
    ray.shutdown()
    stop_head(head["markers"])


@pytest.fixture
def own_driver():
    """This worker process free of the session's Ray for one test that joins a cluster of its own as its
    driver (`infer.cluster.isolation.connected` refuses a second cluster), joined again after: whether the
    session's Ray was started first depends on which tests xdist gave this worker before."""
    import ray

    address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if address:
        ray.shutdown()
    yield
    if address and not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)


def actor_processes(title: str, markers: tuple[str, ...] | None = None, root: int | None = None) -> list:
    """Live processes whose title names `title` (Ray titles an actor's process after its class:
    "ray::MapWorker(MapBatches(CaptureWorker))") in one Ray's process tree: the head whose command lines
    name `markers` (`ray_cluster["markers"]`), or the descendants of pid `root` (a stage that started a Ray
    of its own). Each test worker runs a Ray, so a test's kill must not land on the other worker's actor."""
    import psutil

    from infer.cluster.local import processes

    try:
        tree = processes(markers) if markers else psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in tree:
        try:
            if title in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def stop_head(markers: tuple[str, ...]) -> list[str]:
    """Stop every process whose command line names a marker, and their children; -> their command lines."""
    from infer.cluster.local import stop_processes

    return stop_processes(markers)


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> Path:
    """A 0.5 MB demo corpus (train.jsonl / val.jsonl) generated once per run."""
    from infer.demo import corpus as dc

    return built_once(tmp_path_factory, "corpus",
                      lambda out: dc.main(["--out", str(out), "--seed", "0", "--size-mb", "0.5"]))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, demo_corpus) -> Path:
    """The `tiny` preset target trained on the demo corpus: a real HF folder, built once per run (tests that
    change it work on a copy)."""
    from infer.demo import target as dt

    return built_once(tmp_path_factory, "tiny_target",
                      lambda out: dt.main(["--out", str(out), "--preset", "tiny", f"threads={TEST_THREADS}",
                                           "--corpus", str(demo_corpus / "train.jsonl")]))


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

    def build(run_dir: Path) -> None:
        run_dir.mkdir(parents=True)
        tree = pipeline_tree(run_dir, tiny_target, demo_corpus / "train.jsonl")
        run(load_config(PipelineConfig, write_yaml(run_dir / "cfg.yaml", tree)))

    return built_once(tmp_path_factory, "pipeline_run", build)


@pytest.fixture(scope="session")
def tiny_head(tmp_path_factory, ray_cluster, pipeline_run, tiny_target):
    """A head trained briefly on the tiny target's shards (1 worker), SGLang export folder. 240 steps (~40 s):
    enough that it leans on the aux states (chain tau ~2.4 at k=3), so a broken export shows in vLLM."""
    from pipeline.yaml_config import load_config
    from trainer.config import TrainConfig
    from trainer.driver import run_training

    def build(out: Path) -> None:
        out.mkdir(parents=True)
        tree = {"target": str(tiny_target), "out_dir": str(out),
                "data": {"shards": str(pipeline_run / "capture"), "max_rows_per_batch": 4, "val_rows": 0},
                "model": {"ttt_length": 3}, "optim": {"lr": 5e-3}, "max_steps": 240, "epochs": 20,
                "log_every": 20, "scaling": {"num_workers": 1, "cpus_per_worker": 1}}
        run_training(load_config(TrainConfig, write_yaml(out / "t.yaml", tree)))

    return built_once(tmp_path_factory, "tiny_head", build) / "head_sglang"


@pytest.fixture(scope="session")
def tiny_dflash_head(tmp_path_factory, ray_cluster, pipeline_run, tiny_target):
    """A DFlash head (2 layers, blocks of 5, every loss position an anchor, lm_head from the target's rows)
    trained briefly on the tiny target's shards: its out_dir (report.json, history.json, head_dflash/).
    240 steps leave it far below the EAGLE-3 head's acceptance (held-out sim tau ~1.58 vs 2.60) and still
    climbing: DFlash learns slower here."""
    from pipeline.yaml_config import load_config
    from trainer.config import TrainConfig
    from trainer.driver import run_training

    def build(out: Path) -> None:
        out.mkdir(parents=True)
        tree = {"target": str(tiny_target), "out_dir": str(out),
                "data": {"shards": str(pipeline_run / "capture"), "max_rows_per_batch": 4, "val_rows": 8},
                "model": {"kind": "dflash", "num_layers": 2, "block_size": 5, "anchors": 256,
                          "lm_head_init": "target"},
                "optim": {"lr": 5e-3}, "max_steps": 240, "epochs": 20, "log_every": 20, "eval_every": 60,
                "scaling": {"num_workers": 1, "cpus_per_worker": 1}}
        run_training(load_config(TrainConfig, write_yaml(out / "t.yaml", tree)))

    return built_once(tmp_path_factory, "tiny_dflash_head", build)
