"""Stage 2 (optional), regenerate: the target rewrites every assistant turn in Ray Data actors.

Turn k of every record in a batch is generated together, conditioned on the record's already regenerated
turns 0..k-1, so the draft later learns the target's own distribution. Prompt-only records (user turns and
no answer) get every answer written; a trailing user turn gets one too. Two engines behind one turn loop:
`hf` (transformers `generate`, left-padded batches; any target) and `vllm` (a `vllm.LLM` held by the actor;
continuous batching, ~3.5x faster on CPU). Ray's `ray.data.llm` processor is not used: it runs one pass per
prompt, while turn k here needs turn k-1's answer within the same record.

Each record ends as `success`, `skipped` (prompt too long for the target: kept as it was) or `errored`
(kept as it was or dropped, per `on_error`), with a reason; all are counted, none vanish. A record with
no answer of its own (prompt-only) that is not regenerated is dropped and counted: there is nothing to
keep. Served records (ingest's `served: true`, the traffic log's) hold the target's own answers already:
they pass through unchanged and are counted as `served`. The output is written once complete; a rerun with
the same input and settings reuses it.
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch

from pipeline import storage
from pipeline.cluster import check_actor_cpus
from pipeline.progress import progress_bar
from pipeline.config import ChatTemplate, Regenerate
from pipeline.target import TargetSpec, weights_id
from pipeline.tokenize import read_records_table


def fill_slots(conv: list[dict]) -> tuple[list[dict], list[int]]:
    """Positions the target answers: every assistant turn, plus a slot after a trailing user turn."""
    conv = [dict(m) for m in conv]
    if conv and conv[-1]["role"] == "user":
        conv.append({"role": "assistant", "content": ""})
    return conv, [j for j, m in enumerate(conv) if m["role"] == "assistant"]


class TurnRegenerator:
    """The turn loop, statuses and reasons, shared by both engines; subclasses implement `generate`."""

    def __init__(self, target: str, cfg: Regenerate, chat: ChatTemplate, parts: dict | None = None):
        from transformers import AutoTokenizer

        self.cfg = cfg
        # Chunk mode (run_regenerate): {"records" (a table, through the object store), "out_dir" (a location
        # every node reaches), "fingerprint"}; each input row names a chunk.
        self.parts = parts
        self.records = parts["records"] if parts else None
        target = str(storage.node_copy(target))  # this node's copy of a URI's files
        # Ray starts an actor with OMP_NUM_THREADS = its logical CPUs (1 here): without this an engine
        # runs one thread whatever cores the node has (measured: vLLM at 100% of one core of two).
        if cfg.threads_per_actor:
            torch.set_num_threads(cfg.threads_per_actor)
        self.tok = AutoTokenizer.from_pretrained(target)
        self.kw = chat.kwargs()
        self.max_len = self.context_length(target)
        self.stop_ids = self.eos_ids(target)

    def eos_ids(self, target: str) -> set[int]:
        from transformers import GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(target).eos_token_id
        except OSError:
            eos = None
        eos = eos if eos is not None else self.tok.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) - {None}

    def context_length(self, target: str) -> int:
        return TargetSpec.read(target).max_positions

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Prompt token ids -> answer token ids (cut before the first end-of-sequence token)."""
        raise NotImplementedError

    def cut(self, ids: list[int]) -> list[int]:
        stops = self.stop_ids
        for i, t in enumerate(ids):
            if t in stops:
                return ids[:i]
        return ids

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).strip()

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return list(self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=True, **self.kw)["input_ids"])

    def _answers(self, prompts: list[list[int]], seed: int) -> list[list[int] | Exception]:
        """A failed batch is retried record by record, so one bad prompt costs only its own record."""
        try:
            return list(self.generate(prompts, seed))
        except Exception:  # noqa: BLE001 - isolate below
            out: list[list[int] | Exception] = []
            for i, p in enumerate(prompts):
                try:
                    out.append(self.generate([p], seed + i)[0])
                except Exception as e:  # noqa: BLE001 - counted with its reason, never a crash
                    out.append(e)
            return out

    def __call__(self, batch: dict):
        if self.parts is None:
            return self.regenerate(batch)
        for index, start, end in zip(batch["index"], batch["start"], batch["end"]):
            part = self.records.slice(int(start), int(end) - int(start))
            table = self.regenerate({"id": part["id"].to_pylist(), "messages": part["messages"].to_pylist()})
            write_part(table, self.parts["out_dir"], int(index), self.parts["fingerprint"])
        return {"index": batch["index"]}

    def regenerate(self, batch: dict) -> pa.Table:
        """Records (id, messages as JSON) -> (id, messages, status, reason, kept), turn by turn."""
        originals = [json.loads(m) for m in batch["messages"]]
        convs, slots = zip(*(fill_slots(c) for c in originals)) if originals else ((), ())
        convs = list(convs)
        status, reason = ["success"] * len(convs), [""] * len(convs)
        seed = self.cfg.seed + zlib.crc32("".join(map(str, batch["id"])).encode())  # not scheduling-dependent
        for k in range(max((len(s) for s in slots), default=0)):
            todo, prompts = [], []
            for i, c in enumerate(convs):
                if status[i] != "success" or k >= len(slots[i]):
                    continue
                try:
                    ids = self.prompt_ids(c[: slots[i][k]])
                except Exception as e:  # noqa: BLE001 - a template that refuses this record
                    status[i], reason[i] = "errored", f"chat_template: {type(e).__name__}: {str(e)[:120]}"
                    continue
                if len(ids) + self.cfg.max_new_tokens > self.max_len:
                    status[i], reason[i] = "skipped", f"prompt {len(ids)} + max_new_tokens > context {self.max_len}"
                    continue
                todo.append((i, slots[i][k]))
                prompts.append(ids)
            for s in range(0, len(prompts), self.cfg.batch_size):
                chunk = todo[s: s + self.cfg.batch_size]
                answers = self._answers(prompts[s: s + self.cfg.batch_size], seed + 7919 * k + s)
                for (i, j), ans in zip(chunk, answers):
                    text = ans if isinstance(ans, Exception) else self.text(ans)
                    if isinstance(text, Exception):
                        status[i], reason[i] = "errored", f"{type(text).__name__}: {str(text)[:160]}"
                    elif not text:
                        status[i], reason[i] = "errored", "empty answer"
                    else:
                        convs[i][j] = {"role": "assistant", "content": text}
        keep = [st == "success" or (any(m["role"] == "assistant" for m in o)
                                    and (st == "skipped" or self.cfg.on_error == "keep_original"))
                for st, o in zip(status, originals)]
        msgs = [json.dumps(c, ensure_ascii=False) if st == "success" else batch["messages"][i]
                for i, (c, st) in enumerate(zip(convs, status))]
        return pa.table({"id": pa.array([str(x) for x in batch["id"]], pa.string()),
                         "messages": pa.array(msgs, pa.string()), "status": pa.array(status, pa.string()),
                         "reason": pa.array(reason, pa.string()), "kept": pa.array(keep, pa.bool_())})


class HFRegenerator(TurnRegenerator):
    def __init__(self, target: str, cfg: Regenerate, chat: ChatTemplate, parts: dict | None = None):
        super().__init__(target, cfg, chat, parts)
        from pipeline.target import load_model

        self.model, self.device = load_model(target, "auto", self.cfg.num_gpus_per_actor > 0)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        torch.manual_seed(seed)
        sample = self.cfg.temperature > 0
        out = self.model.generate(input_ids=ids, attention_mask=att, max_new_tokens=self.cfg.max_new_tokens,
                                  do_sample=sample, temperature=self.cfg.temperature if sample else None,
                                  top_p=self.cfg.top_p if sample else None, pad_token_id=self.pad)
        return [self.cut(row[width:].tolist()) for row in out]


class VllmRegenerator(TurnRegenerator):
    """vLLM's offline engine inside the actor (in-process: Ray already gave the actor its CPUs / GPU)."""

    def __init__(self, target: str, cfg: Regenerate, chat: ChatTemplate, parts: dict | None = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        for key, value in cfg.vllm.cpu_env().items():
            os.environ.setdefault(key, value)
        super().__init__(target, cfg, chat, parts)
        from vllm import LLM

        v = self.cfg.vllm
        try:
            self.llm = LLM(model=target, dtype=v.engine_dtype(cfg.num_gpus_per_actor > 0),
                           max_model_len=v.max_model_len, enforce_eager=v.enforce_eager,
                           max_num_seqs=v.max_num_seqs, seed=self.cfg.seed,
                           gpu_memory_utilization=v.gpu_memory_utilization)
        except Exception as e:  # noqa: BLE001 - one line naming the config keys, not an engine traceback
            raise RuntimeError(f"regenerate.engine=vllm: the vLLM engine did not start for {target} "
                               f"({type(e).__name__}: {str(e)[:300]}); check regenerate.vllm.* "
                               f"(max_model_len, kv_cache_gb, dtype) or use regenerate.engine=hf") from None

    def context_length(self, target: str) -> int:
        limit = self.cfg.vllm.max_model_len
        return min(limit, super().context_length(target)) if limit else super().context_length(target)

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                 max_tokens=self.cfg.max_new_tokens, seed=seed + i)
                  for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [self.cut(list(o.outputs[0].token_ids)) for o in outs]


ENGINES = {"hf": HFRegenerator, "vllm": VllmRegenerator}
PARTS = "parts"
PART_META = b"eagleray_regenerate"


def part_path(out_dir, index: int):
    return storage.join(out_dir, PARTS, f"part-{index:05d}.parquet")


def write_part(table: pa.Table, out_dir, index: int, fingerprint: str) -> None:
    """One finished chunk at the stage's location (a URI on a cluster: written by whichever node ran it,
    read by the driver), whole or not at all (storage.write_bytes)."""
    buf = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata({PART_META: fingerprint.encode()}), buf)
    storage.write_bytes(part_path(out_dir, index), buf.getvalue().to_pybytes())


def done_parts(out_dir, fingerprint: str) -> set[int]:
    """Indexes of the chunks finished with this fingerprint (one listing, then each part's footer)."""
    folder = storage.join(out_dir, PARTS)
    done = set()
    for name in storage.list_names(folder, "part-*.parquet"):
        meta = storage.parquet_file(storage.join(folder, name)).schema_arrow.metadata or {}
        if meta.get(PART_META) == fingerprint.encode():
            done.add(int(name[len("part-"):-len(".parquet")]))
    return done


def _fingerprint(cfg: Regenerate, chat: ChatTemplate, target, records: Path) -> str:
    # What decides the answers; pool sizes and threads do not (beyond float reduction order).
    h = hashlib.sha256(cfg.model_dump_json(exclude={"num_actors", "num_cpus_per_actor", "batch_size",
                                                    "threads_per_actor"}).encode())
    if chat.kwargs():
        h.update(chat.model_dump_json().encode())
    h.update(storage.redact(storage.absolute(target)).encode())
    h.update((storage.node_copy(target) / "config.json").read_bytes())
    h.update(weights_id(target).encode())  # a target retrained in place writes other answers
    h.update(records.read_bytes())
    return h.hexdigest()


def split_served(records: Path, out_dir: Path) -> tuple[Path, list[str]]:
    """-> (the records to regenerate: `records` itself, or out_dir/to_regenerate.jsonl without the served
    ones; the served records' lines, marked not regenerated)."""
    keep, served = [], []
    with open(records, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("served"):
                served.append(json.dumps(rec | {"regenerated": False}, ensure_ascii=False) + "\n")
            else:
                keep.append(line)
    if not served:
        return records, []
    rest = out_dir / "to_regenerate.jsonl"
    text = "".join(keep)
    if not rest.is_file() or rest.read_text(encoding="utf-8") != text:  # same text: the reuse fingerprint holds
        rest.write_text(text, encoding="utf-8")
    return rest, served


def run_regenerate(cfg: Regenerate, target, records: Path, out_dir: Path,
                   chat: ChatTemplate = ChatTemplate(), parts_at=None) -> dict:
    """`records` and `out_dir` are the driver's; the chunks go to `parts_at` (default out_dir), a location
    every node reaches (the run_dir's URI on a cluster), so a chunk written on any node counts, and a
    resubmitted job reuses the chunks finished there."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parts_at = out_dir if parts_at is None else parts_at
    records, served = split_served(records, out_dir)
    stats_path, fp = out_dir / "stats.json", _fingerprint(cfg, chat, target, records)
    if served:  # the output holds them too: other served records, another output
        fp = hashlib.sha256((fp + "".join(served)).encode()).hexdigest()
    if stats_path.is_file() and (out_dir / "records.jsonl").is_file():
        old = json.loads(stats_path.read_text())
        if old.get("fingerprint") == fp:  # same input, same settings: the finished output stands
            return old | {"reused": True}
    table = read_records_table(records)
    n = table.num_rows
    # Chunks of 4 engine batches, each written as a part when done: a rerun after a kill does the rest only.
    chunk = cfg.batch_size * 4
    ranges = [(i, s, min(s + chunk, n)) for i, s in enumerate(range(0, n, chunk))]
    finished = done_parts(parts_at, fp)
    todo = [r for r in ranges if r[0] not in finished]
    parts = {"records": table, "out_dir": parts_at, "fingerprint": fp}

    if todo:
        # Ray Data restarts an actor lost with its node and retries its chunk (docs/ARCHITECTURE.md §12)
        check_actor_cpus("regenerate.num_cpus_per_actor", min(cfg.num_actors, len(todo)), cfg.num_cpus_per_actor)
        done = lambda: len(done_parts(parts_at, fp) & {i for i, _, _ in ranges})  # noqa: E731
        pending = [{"index": i, "start": s, "end": e} for i, s, e in todo]
        with progress_bar("regenerate", len(ranges), done, unit="chunk"):
            ray.data.from_items(pending, override_num_blocks=len(pending)).map_batches(
                ENGINES[cfg.engine], batch_size=1, batch_format="numpy",
                compute=ray.data.ActorPoolStrategy(size=min(cfg.num_actors, len(pending))),
                num_cpus=cfg.num_cpus_per_actor, num_gpus=cfg.num_gpus_per_actor,
                resources=cfg.resources_per_actor or None,
                fn_constructor_kwargs={"target": str(target), "cfg": cfg, "chat": chat, "parts": parts}).materialize()
    sources = {}
    with open(records, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            sources[rec["id"]] = rec["source"]
    rows = pa.concat_tables([storage.read_table(part_path(parts_at, i)) for i, _, _ in ranges]).to_pylist() \
        if ranges else []
    counts = {"success": 0, "skipped": 0, "errored": 0, "dropped": 0}
    reasons: dict[str, int] = {}
    tmp = out_dir / ".records.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            counts[r["status"]] += 1
            if r["reason"]:
                key = r["reason"].split(":")[0] if r["status"] == "errored" else r["status"]
                reasons[key] = reasons.get(key, 0) + 1
            if not r["kept"]:
                counts["dropped"] += 1
                continue
            f.write(json.dumps({"id": r["id"], "source": sources[r["id"]], "regenerated": r["status"] == "success",
                                "messages": json.loads(r["messages"])}, ensure_ascii=False) + "\n")
        for line in served:
            f.write(line)
    tmp.replace(out_dir / "records.jsonl")
    with open(out_dir / "failures.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            if r["status"] != "success":
                f.write(json.dumps({"id": r["id"], "status": r["status"], "reason": r["reason"],
                                    "kept": r["kept"]}, ensure_ascii=False) + "\n")
    stats = {"records": len(rows) + len(served), **counts, "served": len(served), "reasons": reasons, "engine": cfg.engine, "on_error": cfg.on_error,
             "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens, "fingerprint": fp,
             "chunks": len(ranges), "chunks_reused": len(ranges) - len(todo)}
    stats_path.write_text(json.dumps(stats, indent=2))
    return stats
