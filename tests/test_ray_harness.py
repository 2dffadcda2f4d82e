"""The session Ray instance is local (127.0.0.1, 2 CPUs) and Ray Data reads what the tools write."""
import json


def test_ray_is_local_with_two_cpus(ray_cluster):
    import ray

    assert ray.cluster_resources()["CPU"] == 2
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}


def test_ray_data_reads_demo_corpus(ray_cluster, demo_corpus):
    import ray

    lines = (demo_corpus / "train.jsonl").read_text().splitlines()
    ds = ray.data.read_json(str(demo_corpus / "train.jsonl"))
    assert ds.count() == len(lines)
    ids = sorted(r["id"] for r in ds.select_columns(["id"]).take_all())
    assert ids == sorted(json.loads(x)["id"] for x in lines)


def test_cpu_workers_keep_freed_memory(ray_cluster):
    """A Ray worker started with `cpu_worker_env` settles into reusing a freed 64 MB block: after a few
    rounds of allocate, touch, free, its pages no longer fault in again. A worker without it faults all
    16,384 pages every round (glibc munmaps blocks of 32 MB+ on free and the kernel zeroes them anew)."""
    import ray

    from pipeline.cluster import KEEP_FREED_MEMORY, cpu_worker_env

    def refault_pages(megabytes: int, rounds: int) -> dict:
        """Minor page faults of each round, in a thread as Ray Train runs the loop."""
        import os
        import resource
        import threading

        import torch

        faults = []
        torch.set_num_threads(1)

        def run():
            for _ in range(rounds):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                x = torch.empty(megabytes * 2 ** 20 // 4)
                x.fill_(1.0)
                del x
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return {"faults": faults, "tunables": os.environ.get("GLIBC_TUNABLES")}

    task = ray.remote(num_cpus=0.5)(refault_pages)
    pages = 64 * 2 ** 20 // 4096
    kept = ray.get(task.options(runtime_env={"env_vars": cpu_worker_env(True)}).remote(64, 16))
    plain = ray.get(task.remote(64, 16))
    assert kept["tunables"] == KEEP_FREED_MEMORY
    assert sum(kept["faults"][-4:]) < pages // 20, kept
    assert min(plain["faults"][-4:]) >= pages, plain
    assert cpu_worker_env(False) == {}


def test_stop_head_stops_its_cluster_and_no_other(ray_cluster):
    """A test session's teardown stops its own cluster's processes and nothing else: the Ray client server
    too, which names only the GCS address and which `ray start` leaves to init (one was left running
    after every test session before); the session's own cluster, beside it, keeps running."""
    import psutil
    import ray
    from conftest import start_head, stop_head

    head = start_head()
    stopped = stop_head(head["markers"])
    assert any("ray.util.client.server" in c for c in stopped), stopped
    assert any("gcs_server" in c for c in stopped) and any("raylet" in c for c in stopped), stopped
    assert not any(ray_cluster["address"] in c for c in stopped), stopped
    left = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
            if any(m in a for a in (p.info["cmdline"] or []) for m in (*head["markers"], head["address"]))]
    assert left == [], left
    assert ray.get(ray.remote(lambda: 7).remote()) == 7 and ray.cluster_resources()["CPU"] == 2


def test_a_stage_on_a_terminal_ends_without_a_colour_reset(ray_cluster):
    """Starting Ray loads its CLI logger, which registers colorama's exit hook, which writes ESC[0m to a
    terminal: a stray line after every demo stage. ensure_ray removes it (pipeline.cluster._no_colour_reset_at_exit)."""
    import os
    import pty
    import subprocess
    import sys

    from conftest import REPO

    def run(code: str) -> bytes:
        leader, follower = pty.openpty()
        env = {k: v for k, v in ray_cluster["env"].items() if k != "RAY_ADDRESS"}  # a Ray of its own, as a stage
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=follower, stderr=follower)
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        proc.wait(timeout=120)
        os.close(leader)
        assert proc.returncode == 0, out[-2000:]
        return out

    # Joining a cluster loads no CLI logger; starting one (every demo stage) does.
    assert b"\x1b[0m" in run("import ray; ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)")
    out = run("from pipeline.cluster import ensure_ray; print(ensure_ray(num_cpus=1))")
    assert b"started a local Ray" in out and b"\x1b[0m" not in out, out
