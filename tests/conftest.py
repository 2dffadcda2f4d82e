"""Shared fixtures: one local Ray per session, the shared data folder, a tiny self-trained target."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
sys.path.insert(0, str(TOOLS))

# Ray must bind 127.0.0.1 and let its own clients in (STACK.md); set before anything imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data beside the repo (or $EAGLERAY_SHARED_DATA); a clear failure when it is missing."""
    path = Path(os.environ.get("EAGLERAY_SHARED_DATA", REPO.parent / "shared" / "data"))
    if not (path / "mt_bench" / "question.jsonl").is_file():
        pytest.fail(f"shared data not found at {path}: clone the repo beside shared/ "
                    f"or set EAGLERAY_SHARED_DATA to the folder holding mt_bench/, gsm8k/, ceval/, chat/")
    return path


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the whole session (2 CPUs, 127.0.0.1, no dashboard)."""
    import ray

    ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                   _node_ip_address="127.0.0.1", ignore_reinit_error=True)
    yield ctx
    ray.shutdown()


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
