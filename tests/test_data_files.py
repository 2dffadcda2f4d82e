"""data/: the files a clone ships for the demo and the tests, each with its checksum in SHA256SUMS and in
data/README.md, and nothing in the repo that reads a folder beside the clone."""
import hashlib
import re
import subprocess


def test_shipped_files_match_their_checksums(data_dir):
    listed = dict(reversed(line.split()) for line in (data_dir / "SHA256SUMS").read_text().splitlines())
    on_disk = sorted("./" + str(p.relative_to(data_dir)) for p in data_dir.rglob("*")
                     if p.is_file() and p.name not in ("SHA256SUMS", "README.md"))
    assert sorted(listed) == on_disk and len(on_disk) == 31
    for rel, digest in listed.items():
        assert hashlib.sha256((data_dir / rel).read_bytes()).hexdigest() == digest, rel
    readme = (data_dir / "README.md").read_text()
    assert dict(re.findall(r"\| `([^`]+)` \| `([0-9a-f]{64})` \|", readme)) == {k[2:]: v for k, v in listed.items()}
    assert sum(p.stat().st_size for p in data_dir.rglob("*") if p.is_file()) < 4e6  # "a few MB"


def test_nothing_tracked_reads_beside_the_clone(repo_root):
    """Configs, code and tests never name ../shared: a user's clone has nothing beside it (data/README.md
    names the larger corpora the SmolLM2 configs read, which `make real` checks before any work)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=repo_root, capture_output=True, text=True,
                             check=True).stdout.split()
    allowed = {"configs/pipeline/smollm2.yaml", "configs/pipeline/smollm2_large.yaml", "tests/test_data_files.py"}
    hits = [f for f in tracked if f.endswith((".py", ".yaml", "Makefile", ".cfg", ".toml")) and f not in allowed
            and "../shared" in (repo_root / f).read_text(encoding="utf-8")]
    assert hits == []
