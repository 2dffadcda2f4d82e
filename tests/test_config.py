"""Typed configs: errors name the key and the source; overrides are typed."""
import sys
from pathlib import Path

import pytest
from pydantic import Field

from pipeline.yaml_config import ConfigError, ExistingPath, StrictModel, load_config, split_cli


class Optim(StrictModel):
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)


class Stage(StrictModel):
    name: str
    steps: int = Field(10, gt=0)
    data: ExistingPath | None = None
    optim: Optim = Optim()


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "stage.yaml"
    p.write_text(text)
    return p


def test_loads_yaml_and_typed_overrides(tmp_path):
    p = write(tmp_path, "name: a\noptim:\n  lr: 0.01\n")
    cfg = load_config(Stage, p, ["steps=7", "optim.lr=3e-4", "optim.betas=[0.8, 0.9]", "name=b"])
    assert (cfg.name, cfg.steps, cfg.optim.lr, cfg.optim.betas) == ("b", 7, 3e-4, (0.8, 0.9))


def test_unknown_key_names_key_and_file(tmp_path):
    p = write(tmp_path, "name: a\noptim:\n  lrr: 0.01\n")
    with pytest.raises(ConfigError) as e:
        load_config(Stage, p)
    msg = str(e.value)
    assert str(p) in msg and "optim.lrr" in msg and "unknown key" in msg and "lr" in msg
    assert "\n" not in msg


def test_wrong_type_names_key_and_file(tmp_path):
    p = write(tmp_path, "name: a\nsteps: many\n")
    with pytest.raises(ConfigError, match=r"stage\.yaml: steps: .*integer.*'many'"):
        load_config(Stage, p)


def test_constraint_violation_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"steps: .*greater than 0"):
        load_config(Stage, write(tmp_path, "name: a\nsteps: 0\n"))


def test_bad_override_names_override(tmp_path):
    p = write(tmp_path, "name: a\n")
    with pytest.raises(ConfigError, match=r"override 'optim.lr=fast': optim.lr: "):
        load_config(Stage, p, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"override 'optim.bogus=1': optim.bogus: unknown key"):
        load_config(Stage, p, ["optim.bogus=1"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(Stage, p, ["optim.lr"])


def test_missing_files(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: config file not found"):
        load_config(Stage, tmp_path / "nope.yaml")
    p = write(tmp_path, f"name: a\ndata: {tmp_path / 'absent.parquet'}\n")
    with pytest.raises(ConfigError, match=r"stage\.yaml: data: path does not exist: .*absent\.parquet"):
        load_config(Stage, p)


def test_missing_required_and_bad_top_level(tmp_path):
    with pytest.raises(ConfigError, match=r"name: required key is missing"):
        load_config(Stage, write(tmp_path, "steps: 3\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(Stage, write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="not valid YAML at line 2"):
        load_config(Stage, write(tmp_path, "name: a\n  bad: [\n"))


def test_override_indexes_into_lists(tmp_path):
    class Source(StrictModel):
        path: str
        max_records: int | None = None

    class Ingest(StrictModel):
        sources: list[Source]

    p = write(tmp_path, "sources:\n  - {path: a}\n  - {path: b, max_records: 5}\n")
    cfg = load_config(Ingest, p, ["sources.1.max_records=80", "sources.0.path=c"])
    assert [(s.path, s.max_records) for s in cfg.sources] == [("c", None), ("b", 80)]
    with pytest.raises(ConfigError, match=r"override 'sources.2.path=d': sources.2: not an index of the list's 2"):
        load_config(Ingest, p, ["sources.2.path=d"])
    with pytest.raises(ConfigError, match=r"sources.x: not an index"):
        load_config(Ingest, p, ["sources.x.path=d"])
    with pytest.raises(ConfigError, match=r"override 'sources.0.path.z=1': sources.0.path is not a section"):
        load_config(Ingest, p, ["sources.0.path.z=1"])


def test_split_cli():
    assert split_cli(["c.yaml", "a.b=1", "--plan", "x=y"]) == ("c.yaml", ["a.b=1", "x=y"], ["--plan"])


def test_entry_point_prints_one_line_and_exits_2(tmp_path, capsys):
    from infer.demo import target as demo_target

    with pytest.raises(SystemExit) as e:
        demo_target.main(["--out", str(tmp_path), "--preset", "tiny", "--corpus", str(tmp_path / "none.jsonl")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: override") and "corpus.0" in err[0]


def test_serve_dtype_belongs_to_the_eagleray_backend(tmp_path):
    from infer.serve import ServeConfig

    (tmp_path / "target").mkdir()
    yaml = write(tmp_path, f"target: {tmp_path / 'target'}\n")
    assert load_config(ServeConfig, yaml, ["dtype=bf16"]).dtype == "bf16"
    with pytest.raises(ConfigError, match=r"dtype applies to the eagleray backend.*vllm\.dtype"):
        load_config(ServeConfig, yaml, ["backend=vllm", "dtype=bf16"])
    assert load_config(ServeConfig, yaml, ["speculative.sizing=adaptive"]).speculative.sizing == "adaptive"
    with pytest.raises(ConfigError, match=r"speculative\.sizing applies to the eagleray backend"):
        load_config(ServeConfig, yaml, ["backend=vllm", "speculative.sizing=adaptive"])
    with pytest.raises(ConfigError, match=r"speculative\.sizing"):
        load_config(ServeConfig, yaml, ["speculative.sizing=auto"])


def test_one_dtype_vocabulary_and_old_spellings_named(tmp_path):
    """Every stage spells dtypes fp32 | bf16 | fp16 | fp8 | auto; torch's names are refused in one line that
    names the key and the spelling to use; vLLM gets its own names."""
    from infer.eval import EvalConfig
    from infer.serve import ServeConfig
    from pipeline.config import PipelineConfig, VllmEngine
    from pipeline.target import torch_dtype
    from trainer.config import TrainConfig

    import torch

    (tmp_path / "target").mkdir()
    base = write(tmp_path, f"target: {tmp_path / 'target'}\n")
    cases = [(PipelineConfig, "regenerate.vllm.dtype", "bfloat16", "bf16"), (PipelineConfig, "capture.dtype",
             "float16", "fp16"), (PipelineConfig, "capture.model_dtype", "float32", "fp32"),
             (ServeConfig, "dtype", "bfloat16", "bf16"), (ServeConfig, "vllm.dtype", "float32", "fp32"),
             (TrainConfig, "deepspeed.dtype", "float32", "fp32"), (EvalConfig, "dtype", "bfloat16", "bf16")]
    extra = {TrainConfig: [f"data.shards={tmp_path}"], EvalConfig: [f"head={tmp_path}", "benchmarks=[]"]}
    for model, key, old, new in cases:
        with pytest.raises(ConfigError) as e:
            load_config(model, base, extra.get(model, []) + [f"{key}={old}"])
        msg = str(e.value)
        assert "\n" not in msg and f"{key}: " in msg and f"write {new}" in msg, msg
        assert load_config(model, base, extra.get(model, []) + [f"{key}={new}"])
    with pytest.raises(ConfigError, match=r"capture\.model_dtype: .*'fp8'"):  # fp8: stored states only
        load_config(PipelineConfig, base, ["capture.model_dtype=fp8"])
    assert load_config(PipelineConfig, base, ["capture.dtype=fp8"]).capture.dtype == "fp8"
    assert [VllmEngine(dtype=d).engine_dtype(gpu=False) for d in ("auto", "fp32", "bf16", "fp16")] == \
        ["float32", "float32", "bfloat16", "float16"]
    assert VllmEngine().engine_dtype(gpu=True) == "bfloat16"
    assert (torch_dtype("auto", "cpu"), torch_dtype("auto", "cuda"), torch_dtype("fp16", "cpu")) == \
        (torch.float32, torch.bfloat16, torch.float16)


def shipped_configs() -> list[Path]:
    return sorted((Path(__file__).resolve().parents[1] / "configs").glob("*/*.yaml"))


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_config_validates_but_for_paths_a_clone_lacks(path):
    """Each configs/STAGE/*.yaml against its stage's model: every key known, every value of its type (the
    dtype names included); only inputs that a fresh clone has not built yet (runs/..., /mnt/...) may fail."""
    import yaml
    from pydantic import ValidationError

    from infer.eval import EvalConfig
    from infer.flywheel import FlywheelConfig
    from infer.serve import ServeConfig
    from pipeline.config import PipelineConfig
    from trainer.config import TrainConfig

    model = {"pipeline": PipelineConfig, "trainer": TrainConfig, "eval": EvalConfig, "serve": ServeConfig,
             "flywheel": FlywheelConfig}
    try:
        model[path.parent.name].model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as e:
        bad = [err for err in e.errors() if not any(m in err["msg"] for m in ("does not exist", "no file matches"))]
        assert not bad, bad


def test_gpu_example_configs_validate_with_their_paths_supplied(tmp_path):
    """configs/*/qwen3_8b_gpu.yaml (and the SmolLM2 heads') name paths that do not exist here. With those
    supplied as overrides every other key validates, so a renamed or mistyped key fails here, not on a
    user's cluster."""
    from pipeline.config import PipelineConfig
    from trainer.config import TrainConfig

    folder, corpus = tmp_path / "folder", tmp_path / "corpus.jsonl"
    folder.mkdir()
    corpus.write_text("")
    configs = Path(__file__).resolve().parents[1] / "configs"
    pipe = load_config(PipelineConfig, configs / "pipeline/qwen3_8b_gpu.yaml",
                       [f"target={folder}"] + [f"ingest.sources.{i}.path={corpus}" for i in range(3)])
    assert pipe.capture.num_gpus_per_actor == 1 and pipe.capture.dtype == "bf16"
    train = load_config(TrainConfig, configs / "trainer/qwen3_8b_gpu.yaml", [f"target={folder}",
                                                                              f"data.shards={folder}"])
    assert train.scaling.use_gpu and train.model.compile and train.deepspeed.dtype == "bf16"
    paths = [f"target={folder}", f"data.shards={folder}"]
    smol = {name: load_config(TrainConfig, configs / f"trainer/{name}.yaml", paths)
            for name in ("smollm2", "smollm2_dflash")}
    assert [(c.model.kind, c.model.layers_init, c.model.fc_init) for c in smol.values()] == \
        [("eagle3", "target", "high"), ("dflash", "target", "high")]


def test_eagleray_command_lists_stages_and_runs_each_stage_module(repo_root):
    """The console script pyproject installs: --help names the four stages, then the other commands, without
    starting anything; an unknown command is one line and exit 2, and a stage gets the module's own command
    line (a config error there is the module's one line, exit 2, as with `python -m`)."""
    import subprocess

    from infer.cli import ALL

    exe = Path(sys.executable).parent / "eagleray"
    assert exe.is_file(), "pip install -e . installs the eagleray console script"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, cwd=repo_root)
    listed = [ln.split()[0] for ln in out.stdout.splitlines() if ln.startswith("  ")]
    assert out.returncode == 0 and listed[:4] == ["pipeline", "train", "eval", "serve"] and listed == list(ALL)
    bad = subprocess.run([str(exe), "deploy", "x.yaml"], capture_output=True, text=True, cwd=repo_root)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("eagleray: unknown command 'deploy'")
    for stage, module in (("train", "trainer"), ("eval", "infer.eval")):
        via_cli = subprocess.run([str(exe), stage, "configs/none.yaml"], capture_output=True, text=True, cwd=repo_root)
        via_m = subprocess.run([sys.executable, "-m", module, "configs/none.yaml"], capture_output=True, text=True,
                               cwd=repo_root)
        assert via_cli.returncode == via_m.returncode == 2
        assert via_cli.stderr == via_m.stderr == "config error: configs/none.yaml: config file not found\n"


def test_check_sources_names_the_first_missing_corpus(tmp_path, capsys):
    """`make real` first runs `python -m pipeline CONFIG --check-sources`: no Ray, no target needed, and a
    corpus the clone lacks is one line naming the key and the file."""
    from pipeline.__main__ import main

    corpus = tmp_path / "a.jsonl"
    corpus.write_text("{}\n")
    cfg = write(tmp_path, f"target: {tmp_path / 'no_target_yet'}\ningest:\n  sources:\n    - {{path: {corpus}}}\n"
                          f"    - {{path: {tmp_path / 'missing.json'}}}\n")
    with pytest.raises(SystemExit) as e:
        main([str(cfg), "--check-sources"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert err[0].startswith(f"config error: {cfg}: ingest.sources.1.path: path does not exist: {tmp_path}/missing.json")
    assert main([str(cfg), f"ingest.sources.1.path={corpus}", "--check-sources"]) == {"sources": 2}
