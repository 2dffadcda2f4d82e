"""eagleray config-doc [--check] [--out docs/CONFIG.md]: the configuration reference, from the config models.

Every key of every stage's config (dotted as an override names it), its type, default and meaning. The
meaning is the field's `Field(description=...)`: the models are the one source, so the file is generated,
never edited. --check exits 1 when the file differs from what would be written (tests/test_config_doc.py).
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Annotated, Literal, Union, get_args, get_origin

from pydantic import BaseModel

DOC = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"

HEADER = """# Configuration reference

Generated from the config models by `eagleray config-doc`: edit the models, not this file. A stage reads
one YAML (examples in `configs/`), then dotted overrides: `eagleray train configs/trainer/demo.yaml
optim.lr=3e-3`, `ingest.sources.0.max_records=80` (`[]`: each list entry). An unknown key or a wrong type
stops the stage with one line naming the key. Dtypes: `fp32`, `bf16`, `fp16`, `fp8` (captured states
only), `auto` (bf16 on GPU, fp32 on CPU). `null` is YAML's None.
"""


def stages() -> list[tuple[str, str, type[BaseModel]]]:
    from infer.eval import EvalConfig
    from infer.flywheel import FlywheelConfig
    from infer.gate import GateConfig
    from infer.serve import ServeConfig
    from pipeline.config import PipelineConfig
    from trainer.config import TrainConfig

    return [("Pipeline", "eagleray pipeline", PipelineConfig), ("Trainer", "eagleray train", TrainConfig),
            ("Eval", "eagleray eval", EvalConfig), ("Serve", "eagleray serve", ServeConfig),
            ("Gate", "eagleray gate", GateConfig), ("Flywheel", "eagleray flywheel", FlywheelConfig)]


def _model_of(annotation) -> type[BaseModel] | None:
    """The config section a field holds (a model, or a list of models), else None."""
    for a in (annotation, *get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def type_name(annotation, nullable: bool = True) -> str:
    """`annotation` in words; "or null" only where `nullable` (the default column shows a null default)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_name(args[0], nullable)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        kinds = [get_args(a)[0] if get_origin(a) is Annotated else a for a in args if a is not type(None)]
        if len(kinds) == 1 and get_origin(kinds[0]) in (Union, types.UnionType):
            kinds = list(get_args(kinds[0]))
        name = "path or URI" if set(kinds) == {Path, str} else " or ".join(type_name(a) for a in kinds)
        return name + (" or null" if nullable and type(None) in args else "")
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of {type_name(args[1])}"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def value_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every setting of `model`, sections flattened; a list
    of sections gets a row of its own, then its entries' keys under `key[].`."""
    out = []
    for name, field in model.model_fields.items():
        key, section = prefix + name, _model_of(field.annotation)
        if section is not None and get_origin(field.annotation) is not list:
            out += rows(section, key + ".")
            continue
        default = "required" if field.is_required() else value_text(field.get_default(call_default_factory=True))
        kind = "list" if section is not None else type_name(field.annotation, default != "null")
        out.append((key, kind, default, field.description or ""))
        if section is not None:
            out += rows(section, key + "[].")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    parts = [HEADER]
    for title, command, model in stages():
        # cells joined by bare pipes: the same table in fewer characters
        lines = [f"## {title} (`{command} CONFIG.yaml`)", "", "|key|type|default|meaning|", "|---|---|---|---|"]
        for key, kind, default, meaning in rows(model):
            shown = default if default == "required" else f"`{default}`"
            lines.append(f"|`{key}`|{_cell(kind)}|{_cell(shown)}|{_cell(meaning)}|")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagleray config-doc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is not what would be written")
    ap.add_argument("--out", type=Path, default=DOC, help=f"default {DOC.relative_to(DOC.parents[1])}")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != text:
            print(f"config-doc: {args.out} is stale; run `eagleray config-doc` to rewrite it", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"config-doc: wrote {args.out} ({sum(1 for t in stages() for _ in rows(t[2]))} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
