"""Where files live: a local path or a URI, through pyarrow's filesystems (docs/ARCHITECTURE.md §11).

A location is a `Path` (local) or a URI string (`s3://bucket/prefix`, `gs://...`, `hdfs://...`). S3 takes
its endpoint, scheme, region and credentials from the URI's query (`?endpoint_override=host:port&
scheme=http&access_key=...&secret_key=...`) or from the environment as the AWS tools read it
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION); buckets are never created.

Stages keep computing on local folders: a URI has a `Mirror`, a local folder on each node (under
$EAGLERAY_CACHE, default ~/.cache/eagleray) that its files are pulled into and pushed from. What actors on
any node write (capture shards, regeneration's chunks, Ray Train checkpoints) goes to the URI directly.
A folder a process reads whole (a target, a head) is `node_copy`: the node that needs it copies it from the
URI into its own cache, once per content. On a cluster of several nodes a local path is refused
(`check_shared`) unless it lies under a mount the user declares shared (EAGLERAY_SHARED_PATHS).
"""
from __future__ import annotations

import fnmatch
import glob as globlib
import hashlib
import os
import re
import shutil
from functools import lru_cache
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

import pyarrow.fs as pafs

URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
SECRET_KEYS = ("secret_key", "session_token", "access_key")
S3_QUERY = ("endpoint_override", "scheme", "region", "access_key", "secret_key", "session_token")


class StorageError(ValueError):
    """A location that cannot be read or written, worded as one line naming the config key."""


def is_uri(loc) -> bool:
    return isinstance(loc, str) and bool(URI.match(loc)) and not loc.startswith("file://")


def absolute(loc):
    """A local path made absolute (workers and replicas run in other folders); a URI, or None, as it is."""
    return loc if loc is None or is_uri(loc) else Path(loc).resolve()


def location(value) -> Path | str:
    """A config value -> a `Path` (local; `file://` stripped) or a URI string without a trailing slash."""
    if not isinstance(value, (str, Path)):
        raise ValueError(f"expected a path or a URI, got {type(value).__name__}")
    s = str(value)
    if s.startswith("file://"):
        return Path(s[len("file://"):])
    if URI.match(s):
        base, sep, query = s.partition("?")
        return base.rstrip("/") + sep + query
    return Path(value)


def join(loc, *names: str) -> Path | str:
    """`loc / name / ...` for a path or a URI (a URI's query stays at the end)."""
    if not is_uri(loc):
        return Path(loc).joinpath(*names)
    base, sep, query = loc.partition("?")
    return "/".join([base.rstrip("/"), *[n.strip("/") for n in names]]) + sep + query


def redact(loc) -> str:
    """The location as printed: credentials in a URI's query are hidden."""
    s = str(loc)
    if not is_uri(s) or "?" not in s:
        return s
    base, _, query = s.partition("?")
    pairs = [(k, "***" if k in SECRET_KEYS else v) for k, v in parse_qsl(query)]
    return f"{base}?{urlencode(pairs, safe='*:')}"


S3_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
          "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _s3(query: str) -> pafs.S3FileSystem:
    """The file system for a URI's query, made once per query and the environment it reads (a store named
    by another endpoint or credentials later in the process gets a file system of its own)."""
    return _s3_made(query, tuple(os.environ.get(k) for k in S3_ENV))


@lru_cache(maxsize=32)
def _s3_made(query: str, env: tuple) -> pafs.S3FileSystem:
    opts, env = dict(parse_qsl(query)), dict(zip(S3_ENV, env))
    unknown = set(opts) - set(S3_QUERY)
    if unknown:
        raise StorageError(f"s3 URI: unknown query key(s) {sorted(unknown)}; known: {', '.join(S3_QUERY)}")
    endpoint = opts.get("endpoint_override") or env["AWS_ENDPOINT_URL_S3"] or env["AWS_ENDPOINT_URL"]
    scheme = opts.get("scheme")
    if endpoint and "://" in endpoint:  # AWS_ENDPOINT_URL=http://host:port
        scheme, endpoint = scheme or endpoint.split("://")[0], endpoint.split("://", 1)[1]
    region = opts.get("region") or env["AWS_REGION"] or env["AWS_DEFAULT_REGION"]
    # Short timeouts and few retries: an unreachable endpoint is reported in seconds, not minutes.
    return pafs.S3FileSystem(
        endpoint_override=endpoint or None, scheme=scheme or "https", region=region or "us-east-1",
        access_key=opts.get("access_key"), secret_key=opts.get("secret_key"),
        session_token=opts.get("session_token"), connect_timeout=5, request_timeout=60,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=3))


def filesystem(loc) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a local path or a URI."""
    if not is_uri(loc):
        return pafs.LocalFileSystem(), str(Path(loc).resolve())
    scheme, rest = loc.split("://", 1)
    path, _, query = rest.partition("?")
    if scheme in ("s3", "s3a"):
        return _s3(query), path.rstrip("/")
    fs, inner = pafs.FileSystem.from_uri(loc)
    return fs, inner.rstrip("/")


def info(loc) -> pafs.FileInfo:
    fs, path = filesystem(loc)
    return fs.get_file_info(path)


def is_file(loc) -> bool:
    return info(loc).type == pafs.FileType.File


def exists(loc) -> bool:
    return info(loc).type != pafs.FileType.NotFound


def size(loc) -> int:
    return info(loc).size


def read_bytes(loc) -> bytes:
    if not is_uri(loc):
        return Path(loc).read_bytes()
    fs, path = filesystem(loc)
    with fs.open_input_stream(path) as f:
        return f.read()


def read_text(loc) -> str:
    return read_bytes(loc).decode("utf-8")


def write_bytes(loc, data: bytes) -> int:
    """Write whole: locally under a temp name, fsynced and renamed; to an object store in one put
    (an object appears complete or not at all). -> bytes written."""
    if is_uri(loc):
        fs, path = filesystem(loc)
        with fs.open_output_stream(path) as f:
            f.write(data)
        return len(data)
    final = Path(loc)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(final)
    return len(data)


def write_text(loc, text: str) -> int:
    return write_bytes(loc, text.encode("utf-8"))


def name(loc) -> str:
    """The last part of a location (a file or folder name)."""
    return str(loc).partition("?")[0].rstrip("/").rsplit("/", 1)[-1] if is_uri(loc) else Path(loc).name


def read_table(loc, columns: list[str] | None = None):
    """A Parquet file (local or URI) -> pyarrow Table."""
    import pyarrow.parquet as pq

    fs, path = filesystem(loc)
    return pq.read_table(path, columns=columns, filesystem=fs)


def parquet_file(loc):
    """A Parquet file opened for its schema, metadata and row groups."""
    import pyarrow.parquet as pq

    fs, path = filesystem(loc)
    return pq.ParquetFile(fs.open_input_file(path))


def delete(loc) -> None:
    """Remove a file if it is there."""
    fs, path = filesystem(loc)
    if fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)


def list_names(loc, pattern: str = "*") -> list[str]:
    """Names of the files directly in folder `loc` that match `pattern`, sorted."""
    fs, path = filesystem(loc)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.base_name, pattern))


def has_glob(loc) -> bool:
    """`*`, `[...]` (and `?` in a local path; in a URI it starts the query) mark a pattern."""
    s = str(loc)
    return any(c in (s.partition("?")[0] if is_uri(s) else s) for c in ("*[" if is_uri(s) else "*?["))


def expand(pattern) -> list[Path | str]:
    """A pattern -> the files it matches, sorted (`**` spans folders); a location without one -> itself if
    it exists, else []."""
    s = str(pattern)
    if not has_glob(s):
        return [location(s)] if exists(location(s)) else []
    if not is_uri(s):
        return [Path(p) for p in sorted(globlib.glob(s, recursive=True)) if Path(p).is_file()]
    base, sep, query = s.partition("?")
    scheme, rest = base.split("://", 1)
    root = re.split(r"[*\[]", rest, maxsplit=1)[0].rsplit("/", 1)[0]
    fs, _ = filesystem(f"{scheme}://{root}{sep}{query}")
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return [f"{scheme}://{i.path}{sep}{query}" for i in sorted(infos, key=lambda i: i.path)
            if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, rest)]


def check(key: str, loc, *, writable: bool = False, must_exist: bool = False) -> None:
    """Before any work: a URI's bucket reachable with these credentials (and a probe object written and
    removed when `writable`), or the location present when `must_exist`. Raises StorageError naming `key`."""
    where = f"{key}: {redact(loc)}"
    try:
        fs, path = filesystem(loc)
        bucket = path.split("/", 1)[0]
        no_bucket = is_uri(loc) and fs.get_file_info(bucket).type == pafs.FileType.NotFound
        missing = not no_bucket and must_exist and fs.get_file_info(path).type == pafs.FileType.NotFound
        if writable and is_uri(loc) and not no_bucket:
            probe = f"{path}/.eagleray-write-probe"
            with fs.open_output_stream(probe) as f:
                f.write(b"ok")
            fs.delete_file(probe)
    except StorageError as e:
        raise StorageError(f"{key}: {e}") from None
    except (OSError, ValueError) as e:  # pyarrow's IO errors are OSErrors, a malformed URI a ValueError
        raise StorageError(f"{where}: unreachable or refused ({short_reason(e)})") from None
    if no_bucket:
        raise StorageError(f"{where}: bucket {bucket!r} not found")
    if missing:
        raise StorageError(f"{where}: not found")


def short_reason(e: Exception) -> str:
    """The useful part of an AWS SDK error: 'ACCESS_DENIED ...', 'NETWORK_CONNECTION ...'."""
    m = re.search(r"AWS Error (\S+)[^:]*:\s*(.*)", str(e))
    text = f"{m.group(1)}: {m.group(2)}" if m else str(e)
    return " ".join(text.split())[:160]


def cache_root() -> Path:
    return Path(os.environ.get("EAGLERAY_CACHE") or Path.home() / ".cache" / "eagleray")


class Mirror:
    """A local working folder for a location: the folder itself when local; for a URI, a folder under
    cache_root()/mirror named by the URI's hash, on every node alike, that files are pulled into and
    pushed from (`pull`/`push` are no-ops for a local location)."""

    def __init__(self, loc, tag: str = ""):
        """`tag` keeps the mirrors of processes that share a machine apart (the trainer's driver, its rank 0)."""
        self.loc = location(loc)
        self.remote = is_uri(self.loc)
        key = hashlib.sha256(redact(self.loc).encode()).hexdigest()[:16]  # the endpoint counts, secrets not
        self.local = cache_root() / "mirror" / (key + (f"-{tag}" if tag else "")) if self.remote else Path(self.loc)

    def pull(self, rel: str = "") -> Path:
        """Copy `rel` (a file or a folder; all when empty) from the URI; a local copy of what the URI no
        longer has is removed (a mirror left by an earlier run never passes for this one's). -> its local path."""
        dst = self.local / rel if rel else self.local
        if self.remote:
            fs, path = filesystem(join(self.loc, rel) if rel else self.loc)
            kind = fs.get_file_info(path).type
            if kind == pafs.FileType.NotFound:
                if dst.is_dir():
                    shutil.rmtree(dst)
                elif dst.exists():
                    dst.unlink()
            else:
                (dst.parent if kind == pafs.FileType.File else dst).mkdir(parents=True, exist_ok=True)
                pafs.copy_files(path, str(dst), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        return dst

    def push(self, rel: str = "") -> None:
        """Copy `rel` (a file or a folder; all when empty) to the URI."""
        src = self.local / rel if rel else self.local
        if self.remote and src.exists():
            fs, path = filesystem(join(self.loc, rel) if rel else self.loc)
            pafs.copy_files(str(src), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)

    def write_text(self, rel: str, text: str) -> None:
        """Write a file here and push it to the URI."""
        path = self.local / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.push(rel)

    def forget(self, rel: str) -> None:
        """Remove a file here and at the URI."""
        (self.local / rel).unlink(missing_ok=True)
        if self.remote:
            delete(join(self.loc, rel))


def listing(loc) -> list[tuple[str, int, int]]:
    """(name relative to folder `loc`, size, mtime in ns) of every file under it, sorted: a folder's identity
    without reading it (a URI's times are the store's, the same from every node)."""
    fs, path = filesystem(loc)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return sorted((i.path[len(path):].lstrip("/"), i.size or 0, i.mtime_ns or 0)
                  for i in infos if i.type == pafs.FileType.File)


def node_copy(loc) -> Path:
    """A folder (a target, a head) as a local folder on this node: a local path as it is (made absolute);
    a URI's files copied into cache_root()/nodes/, keyed by the URI and its listing (names, sizes, times),
    so a folder rewritten at the same URI gets a copy of its own. Made once per node and content: a file
    lock keeps processes on one node from copying it twice, and a copy is used only once complete (its
    `.complete` marker written last). Never removed by the process: a restarted replica or a vLLM engine
    started later on the node finds it."""
    if not is_uri(loc):
        return Path(loc).resolve()
    import fcntl
    import json

    fs, path = filesystem(loc)
    files = listing(loc)
    if not files:
        raise StorageError(f"{redact(loc)}: no files there")
    key = hashlib.sha256(json.dumps([redact(loc), files]).encode()).hexdigest()[:16]
    root = cache_root() / "nodes"
    dst = root / f"{name(loc)}-{key}"
    if (dst / ".complete").is_file():
        return dst
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{dst.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dst / ".complete").is_file():
            shutil.rmtree(dst, ignore_errors=True)  # a copy cut short by a killed process
            dst.mkdir(parents=True)
            pafs.copy_files(path, str(dst), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
            (dst / ".complete").write_text("")
    return dst


def upload(folder, loc) -> int:
    """Copy a local folder's files to `loc` (a URI or a path), as a user puts a target where every node
    reads it -> the files copied."""
    fs, path = filesystem(loc)
    if not is_uri(loc):  # a local destination's folders are not made by copy_files
        Path(path).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(str(Path(folder).resolve()), path, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)
    return len(listing(loc))


def shared_paths() -> list[Path]:
    """Local folders the user declares shared by every node (EAGLERAY_SHARED_PATHS, ':'-separated: an NFS
    mount, say)."""
    return [Path(p).resolve() for p in os.environ.get("EAGLERAY_SHARED_PATHS", "").split(os.pathsep) if p]


def check_shared(key: str, loc, nodes: int) -> None:
    """On a cluster of `nodes` > 1, a location that work on other nodes reads or writes must be a URI (or lie
    under a declared shared mount): a local path names a file only this machine has. Raises StorageError
    naming `key`."""
    if loc is None or nodes <= 1 or is_uri(loc):
        return
    path = Path(str(loc).partition("*")[0]).resolve()
    if any(path == s or s in path.parents for s in shared_paths()):
        return
    raise StorageError(f"{key}: {loc} is a local path, and this Ray cluster has {nodes} nodes that do not "
                       f"share this machine's disk: give a URI (s3://...) or declare a shared mount in "
                       f"EAGLERAY_SHARED_PATHS")
