"""Typed configs: pydantic models loaded from YAML plus dotted command-line overrides.

Every entry point (pipeline, trainer, eval, serve, tools) loads its settings through `load_config`, so
an unknown key, a wrong type or a missing file is rejected the same way everywhere: one line that names
the source file and the dotted key.
"""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence, TypeVar, get_args

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, PlainSerializer, PlainValidator,
                      ValidationError)

from pipeline import storage


class ConfigError(ValueError):
    """A config problem, worded as one line for the user."""


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, not silently ignored."""
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def _must_exist(p: Path) -> Path:
    if not Path(p).exists():
        raise ValueError(f"path does not exist: {p}")
    return Path(p)


# A path that must exist when the config is loaded (inputs); outputs use plain Path.
ExistingPath = Annotated[Path, AfterValidator(_must_exist)]


def _input_location(value):
    """A local input must exist (a glob must match a file); a URI is checked by its stage before any work
    (pipeline.storage.check), not at load."""
    loc = storage.location(value)
    if not storage.is_uri(loc) and not storage.expand(loc):
        raise ValueError(f"{'no file matches' if storage.has_glob(loc) else 'path does not exist:'} {loc}")
    return loc


# Where a stage writes (Location) or reads (InputLocation): a local Path or a URI string (pipeline/storage.py).
_AS_STR = PlainSerializer(str, return_type=str, when_used="json")
Location = Annotated[Path | str, PlainValidator(storage.location), _AS_STR]
InputLocation = Annotated[Path | str, PlainValidator(_input_location), _AS_STR]

# The one dtype vocabulary of every stage's config: fp32 | bf16 | fp16 | fp8 | auto (each field takes the
# names valid there). `pipeline.target.torch_dtype` turns a name into torch's; "auto" is bf16 on GPU and fp32
# on CPU (`pipeline.target.auto_dtype`).
_OLD_DTYPE_NAMES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                    "float8": "fp8", "float8_e4m3fn": "fp8"}


def _dtype(names):
    """Literal `names`; torch's spellings (float32, bfloat16, ...) get a one-line hint, not a mismatch."""
    valid = get_args(names)

    def check(value):
        if isinstance(value, str) and value in _OLD_DTYPE_NAMES:
            ours = _OLD_DTYPE_NAMES[value]
            hint = f": write {ours}" if ours in valid else ""
            raise ValueError(f"dtypes are named {'|'.join(valid)} here{hint}")
        return value
    return Annotated[names, BeforeValidator(check)]


ModelDtype = _dtype(Literal["auto", "fp32", "bf16", "fp16"])  # a model's weights and compute
TrainDtype = _dtype(Literal["fp32", "bf16"])                  # the trainer's compute (DeepSpeed)
StorageDtype = _dtype(Literal["bf16", "fp16", "fp32", "fp8"])  # captured hidden states

T = TypeVar("T", bound=BaseModel)


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], value parsed as YAML, so 3 is an int and [1, 2] a list)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (for example train.lr=1e-4)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def set_dotted(tree: dict, parts: list[str], value: Any, item: str) -> None:
    """Set tree[a][b]... = value; a part that names a list takes an index (`ingest.sources.0.max_records`)."""
    node: Any = tree
    for i, part in enumerate(parts):
        where = ".".join(parts[:i + 1])
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not (part.isdigit() and int(part) < len(node)):
                raise ConfigError(f"override {item!r}: {where}: not an index of the list's {len(node)} items")
            part = int(part)
        elif not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[:i])} is not a section")
        if last:
            node[part] = value
        else:
            if isinstance(node, dict) and node.get(part) is None:
                node[part] = {}
            node = node[part]


def _field_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """Known keys at the parent of an error location, for 'did you mean' style messages."""
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        cls = field.annotation
    return sorted(getattr(cls, "model_fields", {}).keys())


def _describe(model: type[BaseModel], err: dict) -> tuple[str, str]:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        known = _field_names(model, loc)
        hint = f" (known keys here: {', '.join(known)})" if known else ""
        return key, f"unknown key{hint}"
    if err["type"] == "missing":
        return key, "required key is missing"
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    if not isinstance(got, (dict, list)) and got is not None:
        msg += f" (got {got!r})"
    return key, msg


def load_config(model: type[T], path: str | Path | None = None, overrides: Sequence[str] = (),
                section: str | None = None) -> T:
    """Load `path` (YAML) into `model`, apply `a.b=value` overrides, validate; raise ConfigError. With
    `section`, only that top-level key is validated against `model` (a check before any work)."""
    tree: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{source}: config file not found")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{source}: not valid YAML{where}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{source}: top level must be a mapping of keys, got {type(loaded).__name__}")
        tree = loaded or {}
    overridden: dict[str, str] = {}
    for item in overrides:
        parts, value = parse_override(item)
        set_dotted(tree, parts, value, item)
        overridden[".".join(parts)] = item
    if section is not None:
        tree = tree.get(section) or {}
    try:
        return model.model_validate(tree)
    except ValidationError as e:
        err = e.errors()[0]
        key, msg = _describe(model, err)
        key = f"{section}.{key}" if section else key
        origin = next((f"override {v!r}" for k, v in overridden.items()
                       if key == k or key.startswith(k + ".")), source)
        more = f" (+{e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ConfigError(f"{origin}: {key}: {msg}{more}") from None


def split_cli(argv: Sequence[str]) -> tuple[str | None, list[str], list[str]]:
    """argv -> (config path or None, key=value overrides, remaining --flags)."""
    path, overrides, flags = None, [], []
    for a in argv:
        if a.startswith("-"):
            flags.append(a)
        elif "=" in a:
            overrides.append(a)
        elif path is None:
            path = a
        else:
            flags.append(a)
    return path, overrides, flags


def load_or_exit(model: type[T], path: str | Path | None, overrides: Sequence[str], section: str | None = None) -> T:
    """For entry points: the config, or one 'config error' line on stderr and exit status 2."""
    try:
        return load_config(model, path, overrides, section)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def config_arguments(prog: str, doc: str, example: str = "") -> argparse.ArgumentParser:
    """The command line every entry point shares: CONFIG.yaml, then dotted key=value overrides."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted key=value" + (f", e.g. {example}" if example else ""))
    ap.add_argument("--verbose", action=_Verbose, nargs=0, help="show Ray worker logs on the console")
    return ap


class _Verbose(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        os.environ["EAGLERAY_VERBOSE"] = "1"  # read by pipeline.cluster.ensure_ray when Ray starts


@contextmanager
def errors_exit(label: str, catch: tuple = (ValueError, FileNotFoundError), root_cause: bool = False):
    """User-facing failures as one '<label> error: ...' line on stderr and exit status 1. With root_cause,
    any other error too, unwrapped to its root (Ray wraps worker errors several times)."""
    try:
        yield
    except catch as e:
        print(f"{label} error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as e:
        if not root_cause:
            raise
        while getattr(e, "__cause__", None) is not None:
            e = e.__cause__
        print(f"{label} error: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
