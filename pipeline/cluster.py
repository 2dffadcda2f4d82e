"""Starting or joining Ray the same way from every entry point."""
from __future__ import annotations

import os

# Stay on 127.0.0.1 and let Ray's own clients in; Ray Train's controller polls its workers every 0.25 s,
# not 2 s, so a run ends when its workers do (docs/ARCHITECTURE.md §13). Set before Ray starts: its
# processes inherit them.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "TOKENIZERS_PARALLELISM": "false", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
           # The raylet warns on the console once a node has started 4x this many worker processes; it
           # defaults to the node's CPUs, and a training run on 2 CPUs (controller, 2 workers, Ray Data's
           # tasks) starts 8 by design.
           "RAY_worker_maximum_startup_concurrency": "4"}
for _k, _v in RAY_ENV.items():
    os.environ.setdefault(_k, _v)


def _name_deepspeed_accelerator() -> None:
    """DeepSpeed guesses its accelerator when first imported (transformers imports it whenever it is
    installed) and logs a warning each time it falls back to the CPU; with no CUDA device we name the CPU
    ourselves. A DS_ACCELERATOR the user set stays."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


_name_deepspeed_accelerator()


# glibc hands a freed block of 32 MB or more straight back to the kernel (munmap) and trims its heaps, so a
# CPU step that frees and reallocates its activations page-faults them in again, zeroed by the kernel, at
# every step: 6-7% of a SmolLM2-shaped training step was system time (docs/ARCHITECTURE.md §13). One heap,
# never trimmed, no mmap: freed memory stays in the process for the next step.
KEEP_FREED_MEMORY = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                     "glibc.malloc.trim_threshold=68719476736")


def cpu_worker_env(keep_freed_memory: bool) -> dict[str, str]:
    """Environment for Ray worker processes that run torch on CPU (a runtime_env's env_vars). A
    GLIBC_TUNABLES already set where the job starts is the user's choice and stays; other C libraries
    ignore the variable."""
    if not keep_freed_memory or "GLIBC_TUNABLES" in os.environ:
        return {}
    return {"GLIBC_TUNABLES": KEEP_FREED_MEMORY}


def verbose() -> bool:
    """Ray worker and actor logs on the console (`--verbose` or EAGLERAY_VERBOSE=1); else they stay in
    Ray's log files and the console shows each stage's one-line summary."""
    return os.environ.get("EAGLERAY_VERBOSE", "") not in ("", "0")


# Ray's core logs this at the start of every restartable actor that Ray Data creates, since Ray Data passes
# an actor its arguments through the object store (ray-project/ray#57733): a false alarm, the driver holds
# those references. Our actor pools keep Ray's restarts (docs/ARCHITECTURE.md §12), so the line is dropped.
RAY_FALSE_ALARMS = (b"has constructor arguments in the object store and max_restarts > 0",)
_FILTERING = False


def drop_false_alarms(alarms=RAY_FALSE_ALARMS) -> None:
    """A line filter on this process's stderr (fd 2), once per process: Ray's core writes its log lines there
    from C++, past Python's logging. Lines matching `alarms` are dropped, everything else passes at once
    (a partial line too, unless it may be the start of a core log line, `[`); at exit fd 2 is given back."""
    global _FILTERING
    if _FILTERING:
        return
    import atexit
    import sys
    import threading

    _FILTERING = True
    sys.stderr.flush()
    real, (read_end, write_end) = os.dup(2), os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump() -> None:
        held = b""
        while chunk := os.read(read_end, 65536):
            *lines, held = (held + chunk).split(b"\n")
            out = b"".join(x + b"\n" for x in lines if not any(a in x for a in alarms))
            if held and not held.startswith(b"["):
                out, held = out + held, b""
            if out:
                os.write(real, out)
        if held:
            os.write(real, held)

    thread = threading.Thread(target=pump, name="eagleray-stderr-filter", daemon=True)
    thread.start()

    def give_back() -> None:
        sys.stderr.flush()
        os.dup2(real, 2)  # the pipe's last write end closes: the pump reads to its end and stops
        thread.join(timeout=5)

    atexit.register(give_back)  # registered before Ray's own exit hooks, so it runs after them


_STARTED_LOCAL = False


def _no_colour_reset_at_exit() -> None:
    """Ray's CLI logger runs `colorama.init()` as Ray starts, which registers an exit hook that writes an
    ANSI reset to a terminal: a stray blank line after every stage of the demo. Our drivers print no colour."""
    import atexit
    import sys

    initialise = sys.modules.get("colorama.initialise")
    if initialise is not None:
        atexit.unregister(initialise.reset_all)


def started_local_ray() -> bool:
    """Whether this process started the Ray it is connected to (so stopping it ends everything on it)."""
    import ray

    return _STARTED_LOCAL and ray.is_initialized()


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Join `address` (or $RAY_ADDRESS, as under `ray job submit`), else start a local Ray on 127.0.0.1.
    Returns how it connected and where the worker logs are, for the log."""
    import ray

    if ray.is_initialized():
        return "already connected"
    address = address or os.environ.get("RAY_ADDRESS")
    drop_false_alarms()
    global _STARTED_LOCAL
    if address:
        context = ray.init(address=address, log_to_driver=verbose())
        how = f"joined {address}"
    else:
        # The dashboard serves the state API that Ray Train's controller polls; without it, it logs every second.
        context = ray.init(num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
                           _node_ip_address="127.0.0.1", log_to_driver=verbose(), logging_level="WARNING")
        how, _STARTED_LOCAL = "started a local Ray", True
    _no_colour_reset_at_exit()
    logs = getattr(context, "address_info", {}).get("session_dir")  # absent when joined through a client
    logs = logs and os.path.join(logs, "logs")
    return how + (f" (worker logs: {logs}; --verbose shows them here)" if logs and not verbose() else "")


def ray_data_settings() -> None:
    """Ray Data as every stage's driver runs it: deterministic block order, no per-operator progress or
    memory-advice spam in logs, and Parquet read through Ray Data's V1 datasource. V2's file listing
    (Ray 2.60) reads footers in actors it creates without restarts, so a node lost while a read lists its
    files fails the whole dataset (a vocab step's `ListFiles` failed so, docs/ARCHITECTURE.md §12); V1's
    listing and reads are tasks, which Ray retries on another node."""
    import logging

    import ray

    ctx = ray.data.DataContext.get_current()  # imports ray.data, which sets up its loggers: quiet them after
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # Its one warning here only says that the bars are off, which is this function's choice.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.use_datasource_v2 = False
    # Its high-memory detector repeats a 12-line advice every 30 s for each actor stage that holds more than
    # it requested (a vLLM regenerator: ~4 GiB): our stages size their memory by config
    # (regenerate.vllm.kv_cache_gb, capture.batch_tokens), so the advice is noise in the stage's output.
    ctx.issue_detectors_config.high_memory_detector_config.detection_time_interval_s = -1


def check_actor_cpus(key: str, num_actors: int, cpus_per_actor: float) -> None:
    """Refuse an actor pool that takes every CPU of the cluster: Ray Data's own tasks (reads, repartition)
    then never get one, and the job waits forever with idle actors (seen with 1 actor x 2 CPUs on 2 cores)."""
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    if total and num_actors * cpus_per_actor > total - 0.5:
        raise ValueError(f"{key}: {num_actors} actor(s) x {cpus_per_actor:g} CPU leave no CPU of this {total:g}-CPU "
                         f"cluster for Ray Data's own tasks, so the job would wait forever; give the actors at most "
                         f"{max(0.0, total - 1):g} CPU in all (an actor's torch / vLLM threads may still use "
                         f"more cores)")


def node_count() -> int:
    """Live nodes of the Ray this process is connected to (1 when it is not connected)."""
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive")) if ray.is_initialized() else 1


def check_shared(locations: dict) -> None:
    """On a multi-node cluster, every location in `locations` (config key -> location) that work on other
    nodes reads or writes must be a URI or under a declared shared mount (pipeline/storage.py check_shared)."""
    from pipeline import storage

    nodes = node_count()
    for key, loc in locations.items():
        for i, one in enumerate(loc if isinstance(loc, (list, tuple)) else [loc]):
            storage.check_shared(key if not isinstance(loc, (list, tuple)) else f"{key}.{i}", one, nodes)
