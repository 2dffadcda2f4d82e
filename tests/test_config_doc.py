"""docs/CONFIG.md is generated from the config models (infer/config_doc.py): it must be current, and every
key must say what it means."""
from infer import config_doc


def test_config_md_is_current():
    """Fails when a model changed without `eagleray config-doc` (run it, commit docs/CONFIG.md)."""
    want = config_doc.render()
    have = config_doc.DOC.read_text(encoding="utf-8") if config_doc.DOC.is_file() else ""
    assert have == want, "docs/CONFIG.md is stale: run `eagleray config-doc`"


def test_every_key_has_a_one_line_description():
    missing, long = [], []
    for _, _, model in config_doc.stages():
        for key, _, _, meaning in config_doc.rows(model):
            if not meaning.strip():
                missing.append(key)
            elif "\n" in meaning or len(meaning) > 100:
                long.append(key)
    assert not missing, f"give these fields Field(description=...): {missing}"
    assert not long, f"descriptions are one short line (<= 100 characters): {long}"


def test_check_mode_exits_1_with_one_line_when_stale(tmp_path, capsys):
    out = tmp_path / "CONFIG.md"
    assert config_doc.main(["--out", str(out)]) == 0
    assert config_doc.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text() + "edited\n")
    assert config_doc.main(["--check", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stale" in err[0] and "eagleray config-doc" in err[0]


def test_types_and_defaults_read_as_a_user_writes_them():
    text = config_doc.render()
    assert "|`capture.dtype`|bf16\\|fp16\\|fp32\\|fp8|`bf16`|" in text
    assert "|`target`|path or URI|required|" in text and "|`out_dir`|path or URI|`runs/train`|" in text
    assert "|`model.decay_gamma`|float or null|`4.0`|" in text and "|`data.shards`|path or URI|`null`|" in text
    assert "|`ingest.sources[].path`|" in text and "|`optim.betas`|[float, float]|`[0.9, 0.95]`|" in text
