"""data/: the files a clone ships for the demo and the tests, each with its checksum in SHA256SUMS and in
data/README.md, and nothing in the repo that reads a folder beside the clone."""
import hashlib
import re
import subprocess


def test_shipped_files_match_their_checksums(data_dir):
    listed = dict(reversed(line.split()) for line in (data_dir / "SHA256SUMS").read_text().splitlines())
    on_disk = sorted("./" + str(p.relative_to(data_dir)) for p in data_dir.rglob("*")
                     if p.is_file() and p.name not in ("SHA256SUMS", "README.md"))
    assert sorted(listed) == on_disk and len(on_disk) == 39
    for rel, digest in listed.items():
        assert hashlib.sha256((data_dir / rel).read_bytes()).hexdigest() == digest, rel
    readme = (data_dir / "README.md").read_text()
    assert dict(re.findall(r"\| `([^`]+)` \| `([0-9a-f]{64})` \|", readme)) == {k[2:]: v for k, v in listed.items()}
    assert sum(p.stat().st_size for p in data_dir.rglob("*") if p.is_file()) < 5e6  # "a few MB"


def test_no_tracked_file_reaches_2_mib(repo_root):
    """Large artefacts are built, not committed: every tracked file (the shipped demo target's weights
    included) stays under 2 MiB."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=repo_root, capture_output=True, text=True,
                             check=True).stdout.split("\0")
    sizes = {f: (repo_root / f).stat().st_size for f in tracked if f and (repo_root / f).is_file()}
    assert len(sizes) > 100 and max(sizes.values()) < 2 * 2**20, max(sizes, key=sizes.get)


def test_shipped_demo_target_is_the_demo_recipe(data_dir):
    """`make demo` copies data/demo_target only when it was trained from the demo's recipe (infer/demo/target.py
    use_shipped): a preset changed without retraining and reshipping would make every demo train its target first."""
    import json

    from infer.demo import target as dt

    report = json.loads((data_dir / "demo_target/report.json").read_text())
    assert report["recipe"]["resolved"] == dt.PRESETS["demo1m"] and report["recipe"]["seed"] == 0
    assert not report["hit_time_cap"] and report["val_loss"] < 1.0


def test_nothing_tracked_reads_beside_the_clone(repo_root):
    """Configs, code and tests never name ../shared: a user's clone has nothing beside it (data/README.md
    names the larger corpora the SmolLM2 configs read, which `make real` checks before any work)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=repo_root, capture_output=True, text=True,
                             check=True).stdout.split()
    allowed = {"configs/pipeline/smollm2.yaml", "configs/pipeline/smollm2_large.yaml", "configs/pipeline/smollm2_rounds.yaml",
               "tests/test_data_files.py"}
    hits = [f for f in tracked if f.endswith((".py", ".yaml", "Makefile", ".cfg", ".toml")) and f not in allowed
            and "../shared" in (repo_root / f).read_text(encoding="utf-8")]
    assert hits == []
