"""Proof that a LocalCluster's worker nodes have disks of their own (`LocalCluster(private_disks=True)`).

A check on one machine passes by accident when a worker writes a file the head then reads from the same
disk: on a real cluster that file is not there. `prove_isolation` writes a unique file from each worker into
each local folder code writes to (/tmp, $HOME, the store's cache, the cluster's root) and looks for it on the
head (this process) and on the other workers, and the other way round; and it checks that the code and the
venv are there on the workers, read-only, as a machine image would have them.
"""
from __future__ import annotations

import contextlib
import os
import sys
import uuid
from pathlib import Path

from infer.cluster.local import ROOT, LocalCluster
from pipeline.storage import cache_root


@contextlib.contextmanager
def connected(cl: LocalCluster):
    """This process as a driver of `cl` (the GCS prefers the head's raylet for a driver on its host, the one
    whose sockets this process can reach). Disconnected on exit only if it was not connected before; a
    connection to another cluster is refused."""
    import ray

    if ray.is_initialized():
        if ray.get_runtime_context().gcs_address != cl.address:
            raise RuntimeError(f"this process is a driver of another Ray cluster, not {cl.address}")
        yield
        return
    ray.init(address=cl.address, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def run_on(node: str, fn, *args, timeout_s: float = 120):
    """fn(*args) in a Ray task on node `node` (its custom resource `eagleray_<node>` places it)."""
    import ray

    task = ray.remote(num_cpus=0, resources={f"eagleray_{node}": 0.01}, max_retries=0)(fn)
    return ray.get(task.remote(*args), timeout=timeout_s)


def write_files(folders: list[str], tag: str) -> list[str]:
    """A file named after `tag` in each folder (made if missing) -> their paths."""
    out = []
    for d in folders:
        Path(d).mkdir(parents=True, exist_ok=True)
        path = Path(d) / f"eagleray-isolation-{tag}"
        path.write_text(tag)
        out.append(str(path))
    return out


def existing(paths: list[str]) -> list[str]:
    return [p for p in paths if os.path.exists(p)]


def code_view() -> dict:
    """Whether the repo and the venv are visible here, and whether a file can be made in them."""
    out = {}
    for d in (str(ROOT), sys.prefix):
        probe = Path(d) / f".eagleray-isolation-{uuid.uuid4().hex}"
        try:
            probe.write_text("")
            probe.unlink()
            writable = True
        except OSError:
            writable = False
        out[d] = {"visible": (Path(d) / "pyproject.toml").is_file() or (Path(d) / "bin").is_dir(),
                  "writable": writable}
    return out


def prove_isolation(cl: LocalCluster) -> dict:
    """On a started cluster: counts of files one node wrote that another node sees (all 0 when each worker
    has disks of its own), and whether the code is visible and read-only on every worker. Removes what it
    wrote that this process can see (all of it when the disks are shared)."""
    folders = ["/tmp", str(Path.home()), str(cache_root()), str(cl.root)]
    workers = [n.name for n in cl.nodes if not n.head]
    tag = uuid.uuid4().hex[:12]
    head_files = write_files(folders, f"{tag}-head")
    written: dict[str, list[str]] = {}
    try:
        with connected(cl):
            for w in workers:
                written[w] = run_on(w, write_files, folders, f"{tag}-{w}")
            on_head = sum(len(existing(f)) for f in written.values())
            on_other = sum(len(run_on(o, existing, written[w])) for w in workers for o in workers if o != w)
            head_on_workers = sum(len(run_on(w, existing, head_files)) for w in workers)
            views = {w: run_on(w, code_view) for w in workers}
    finally:
        for p in existing(head_files + [f for fs in written.values() for f in fs]):
            os.unlink(p)
    read_only = all(v["visible"] and not v["writable"] for view in views.values() for v in view.values())
    counts = {"worker_files_seen_on_head": on_head, "worker_files_seen_on_other_worker": on_other,
              "head_files_seen_on_workers": head_on_workers}
    return {"private_disks": read_only and not any(counts.values()), "paths": folders, "workers": workers,
            **counts, "code_read_only": read_only, "code_view": views}
