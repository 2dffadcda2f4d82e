"""Speculative generation with an EAGLE-3 head over any Hugging Face causal LM (batch 1).

    gen = EagleGenerator.from_folders("runs/demo/target", "runs/demo/head/head_speculators")
    out = gen.generate(prompt_ids, SpecSettings(mode="tree", top_k=4, depth=5, total_tokens=16))
    out.tokens, out.stats.tau, out.stats.accept_by_depth

Each round: grow a tree with the draft, verify it in one target forward (4D mask, explicit positions,
the target's own cache), accept (greedy or lossless sampling), compact the target's K/V to the accepted
path, and let the draft ingest the committed positions' aux states from that same forward.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from infer import cpu
from infer.draft import DraftRunner
from infer.round_cost import DraftGate, RoundCosts, measure_round_costs
from pipeline.target import default_aux_layers, num_layers
from infer.target import TargetRunner
from infer.tree import accept_sampling, compaction_indices, sampling_probs
from infer.tree_tensor import accept_greedy_tensor
from pipeline.yaml_config import StrictModel

log = logging.getLogger(__name__)


class TreeShape(StrictModel):
    """What a deployment fixes (serve's `speculative:` section). `depth` = draft levels (SGLang
    --speculative-num-steps), `total_tokens` = nodes verified per round, the root included
    (--speculative-num-draft-tokens); docs/ARCHITECTURE.md §8. Official EAGLE's (top_k, depth,
    total_token) = our (top_k, depth + 1, total_token + 1): `SpecSettings.from_eagle`."""
    mode: Literal["tree", "chain", "vanilla"] = Field("tree", description="draft a tree, a chain, or nothing")
    top_k: int = Field(4, gt=0, description="tree: children kept per node")
    depth: int = Field(5, gt=0, description="draft levels per round")
    total_tokens: int = Field(16, gt=1, description="tree: nodes verified per round, the root included")
    # adaptive: each round grows and verifies what this machine's measured costs and this request's
    # acceptance so far pay for, down to no draft at all (infer/round_cost.py)
    sizing: Literal["adaptive", "fixed"] = Field(
        "adaptive", description="adaptive: depth and total_tokens are caps, sized per round; fixed: the shape "
                                "every round")
    # read when the model loads (eval's workers, serve's replicas), not per request
    cpu_path: Literal["auto", "generic"] = Field(
        "auto", description="CPU: auto, the fastest path bit-identical here (infer/cpu/); generic: plain HF")


class SpecSettings(TreeShape):
    """One decode: the tree shape plus what each request chooses (eval's `decode:` section, the tools'
    flags and the serve handlers all build this one model)."""
    max_new_tokens: int = Field(128, gt=0, description="tokens generated at most")
    temperature: float = Field(0.0, ge=0, description="0: greedy; above: lossless speculative sampling")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    seed: int | None = Field(None, description="sampling seed; null: unseeded")
    stop: list[str] = Field([], description="strings that end the generation")
    # raw: the target's log_softmax before temperature and top-p (`token_logprobs`)
    logprobs: int | None = Field(
        None, ge=0, le=20, description="null: none; k: each token's raw target logprob and its k likeliest rivals")

    @classmethod
    def from_eagle(cls, top_k: int, depth: int, total_token: int, **kw) -> "SpecSettings":
        """Official EAGLE `topK_genrate` parameters (GPU defaults 10 / 7 / 60): `depth` expansions after
        the root's children (depth + 1 draft levels) and `total_token` drafted nodes plus the root."""
        return cls(top_k=top_k, depth=depth + 1, total_tokens=total_token + 1, **kw)


@dataclass
class SpecStats:
    rounds: int = 0                 # target verify forwards after prefill
    new_tokens: int = 0             # generated tokens (the prefill's first token included)
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per drafting round
    round_starts: list[int] = field(default_factory=list)  # output index of each drafting round's first token
    depth: int = 0
    seconds: float = 0.0
    eos_in_tree: bool = False       # EOS came from an accepted draft node, not the bonus
    cut_mid_round: bool = False     # max_new_tokens ended generation inside a round's tokens
    nodes: int = 0                  # tree nodes verified, summed over rounds (the root included)
    plain_steps: int = 0            # rounds that did not draft (cost sizing's DraftGate): 1 node, 0 levels
    levels: int = 0                 # draft levels grown, summed over rounds
    # Seconds per part summed over rounds (prefill excluded): draft (tree growth + ingest), verify (the
    # target forward), accept (acceptance + KV compaction), other (everything else in the loop).
    split: dict = field(default_factory=lambda: {"draft": 0.0, "verify": 0.0, "accept": 0.0, "other": 0.0})
    _round: dict = field(default_factory=dict)

    def begin_round(self) -> None:
        self._round = {}

    def add_split(self, part: str, seconds: float) -> None:
        self.split[part] += seconds
        self._round[part] = self._round.get(part, 0.0) + seconds

    def round_seconds(self) -> float:
        """Seconds the current round spent in the measured parts."""
        return sum(self._round.values())

    @property
    def tau(self) -> float:
        """Tokens per verify forward, bonus included (SGLang's completion_tokens / spec_verify_ct)."""
        return self.new_tokens / max(1, self.rounds)

    @staticmethod
    def pooled_tau(stats: list["SpecStats"]) -> float:
        """tau over many decodes: all their tokens over all their verify forwards (ARCHITECTURE.md §8)."""
        return sum(s.new_tokens for s in stats) / max(1, sum(s.rounds for s in stats))

    @property
    def accept_by_depth(self) -> list[float]:
        """Share of rounds that accepted at least d + 1 draft tokens, d = 0 .. depth-1."""
        n = max(1, len(self.accepted))
        return [sum(a > d for a in self.accepted) / n for d in range(self.depth)]


@dataclass
class Generation:
    tokens: list[int]
    text: str
    stats: SpecStats
    finish_reason: str | None  # "eos" | "stop" | "length"; None on intermediate stream snapshots
    # SpecSettings.logprobs set: one entry per token, logprobs[i] for tokens[i] (`token_logprobs`); else None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """logits [n, V], row i the target's scores of the position that emitted tokens[i] -> per token
    (its log-probability, [(token id, log-probability)] of the row's k most likely tokens, most likely
    first). Raw: log_softmax in float32 of the target's logits, before temperature and top-p (vLLM's
    default raw logprobs), so they describe the target whatever the request samples with."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [(c, []) for c in chosen]
    vals, ids = lp.topk(k, dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), vals.tolist())]


def draft_runner(head, embed: torch.Tensor, cpu_path: str = "auto"):
    """The draft side of the loop for the head's kind: EAGLE-3's DraftRunner or DFlash's block runner."""
    if head.config.kind == "dflash":
        from infer.dflash_draft import DFlashRunner
        return DFlashRunner(head, embed)
    return DraftRunner(head, embed, cpu_path)


def load_head(head_dir: str | Path, n_layers: int):
    """An exported head folder -> (the head module with its vocabulary, its aux layer ids or None)."""
    from trainer.export import import_head
    from trainer.kinds import build_head

    state, hcfg, aux = import_head(Path(head_dir), n_layers)
    head = build_head(hcfg)
    head.load_state_dict(state, strict=False)
    head.set_vocab(state["d2t"], state["t2d"])
    return head, aux


class EagleGenerator:
    def __init__(self, target, tokenizer, head, aux_layer_ids: list[int], cpu_path: str = "auto",
                 exact_verify: bool = True):
        """cpu_path: "auto" or "generic" (TreeShape.cpu_path); the pick is logged as one line."""
        self.target = TargetRunner(target, aux_layer_ids, cpu_path, exact_verify)
        self.tokenizer = tokenizer
        embed = target.get_input_embeddings().weight.detach()
        self.draft, draft_path = None, None
        if head is not None:
            self.draft = draft_runner(head.to(embed.device, embed.dtype), embed, cpu_path)
            draft_path = getattr(self.draft, "path", cpu.Path("generic", "DFlash heads have no fast path"))
        self.cpu_path = cpu_path
        self.path_line = cpu.log_paths(self.target.path, draft_path)
        eos = target.generation_config.eos_token_id if target.generation_config else None
        eos = eos if eos is not None or tokenizer is None else tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.costs: RoundCosts | None = None  # measured on the first `sizing: adaptive` round
        self.last_gate: DraftGate | None = None  # the last unseeded adaptive request's (DraftGate.after)

    def round_costs(self, top_k: int) -> RoundCosts:
        """This machine's costs for this target + head (infer/round_cost.py), measured once (~1 s)."""
        if self.costs is None:
            self.costs = measure_round_costs(self.target, self.draft, top_k)
            log.info("round costs (ms): %s", self.costs)
        return self.costs

    @classmethod
    def from_folders(cls, target_dir: str | Path, head_dir: str | Path | None, dtype=torch.float32, device="cpu",
                     cpu_path: str = "auto", exact_verify: bool = True):
        from transformers import AutoTokenizer

        from pipeline.target import load_model

        from pipeline import storage

        target_dir = storage.node_copy(target_dir)  # a URI's files copied to this node once
        head_dir = storage.node_copy(head_dir) if head_dir is not None else None
        target, _ = load_model(target_dir, dtype, device.startswith("cuda"))
        tok = AutoTokenizer.from_pretrained(target_dir)
        n_layers = num_layers(target.config)
        head, aux = load_head(head_dir, n_layers) if head_dir is not None else (None, None)
        return cls(target, tok, head, aux or default_aux_layers(n_layers), cpu_path, exact_verify)

    def with_head(self, head_dir: str | Path) -> "EagleGenerator":
        """A generator over this one's target (model, runner, tokenizer shared) drafting with another head
        (a hot swap, infer/head_swap.py). The head must read the aux layers this runner taps."""
        head, aux = load_head(head_dir, num_layers(self.target.model.config))
        if aux is not None and list(aux) != self.target.aux_layer_ids:
            raise ValueError(f"head: {head_dir} reads aux layers {list(aux)}, the running target taps "
                             f"{self.target.aux_layer_ids}; redeploy to serve it")
        new = copy.copy(self)
        embed = self.target.model.get_input_embeddings().weight.detach()
        new.draft = draft_runner(head.to(embed.device, embed.dtype), embed, self.cpu_path)
        new.path_line = cpu.log_paths(self.target.path, getattr(new.draft, "path", None))
        new.costs = new.last_gate = None
        return new

    def _pick(self, logits: torch.Tensor, s: SpecSettings, gen: torch.Generator | None) -> int:
        if s.temperature <= 0:
            return int(logits.argmax())
        # on the host: the seeded generator is a CPU one, and draws match across devices
        probs = sampling_probs(logits[None], s.temperature, s.top_p)[0].cpu()
        return int(torch.multinomial(probs, 1, generator=gen))

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int], s: SpecSettings) -> list:
        """`token_logprobs` of tokens (row i of logits scores tokens[i]); [] when s asks none."""
        return [] if s.logprobs is None else token_logprobs(logits, tokens, s.logprobs)

    def _finish(self, out: list[int], s: SpecSettings) -> tuple[list[int], str | None]:
        """Cut at EOS, a stop string or max_new_tokens; returns (tokens, reason or None to go on).
        A round can carry tokens past max_new_tokens: they are dropped before looking for EOS."""
        out = out[: s.max_new_tokens]
        for i, t in enumerate(out):
            if t in self.eos:
                return out[: i + 1], "eos"
        if s.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            if any(st in text for st in s.stop):
                for i in range(1, len(out) + 1):
                    if any(st in self.tokenizer.decode(out[:i], skip_special_tokens=True) for st in s.stop):
                        return out[:i], "stop"
        if len(out) >= s.max_new_tokens:
            return out, "length"
        return out, None

    def generate(self, prompt_ids: list[int], s: SpecSettings = SpecSettings()) -> Generation:
        for gen_state in self.stream(prompt_ids, s):
            pass
        return gen_state

    @torch.no_grad()
    def stream(self, prompt_ids: list[int], s: SpecSettings = SpecSettings()):
        """Yields a Generation after the prefill and after every round (tokens so far, stats, finish
        reason None until the last, logprobs so far when asked). Closing the iterator stops decoding
        between rounds. `lps[i]` is tokens[i]'s entry, cut with the tokens (`_finish` keeps a prefix)."""
        if s.cpu_path != "auto" and s.cpu_path != self.cpu_path:  # the path is fixed when the model loads
            raise ValueError(f"cpu_path: {s.cpu_path} needs a generator built with it "
                             f"(EagleGenerator(..., cpu_path={s.cpu_path!r})); this one runs {self.cpu_path}")
        mode = s.mode if self.draft is not None else "vanilla"
        if s.sizing == "adaptive" and mode != "vanilla":  # measured once, before this decode's clock starts
            self.round_costs(1 if mode == "chain" else s.top_k)
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
        depth = 0 if mode == "vanilla" else s.depth
        stats = SpecStats(depth=depth)
        cache = self.target.new_cache()
        prompt = torch.tensor(prompt_ids, dtype=torch.long)
        plen = len(prompt_ids)
        logits, aux = self.target.forward(prompt, torch.arange(plen), cache, last_only=True)
        out = [self._pick(logits[-1], s, gen)]
        lps = self._logprobs(logits[-1:], out, s)  # the prefill's last row scores the first token
        out, reason = self._finish(out, s)
        yield self._snapshot(out, stats, reason, t0, lps[: len(out)] if s.logprobs is not None else None)
        if mode != "vanilla" and reason is None:
            self.draft.reset()
            nxt = torch.cat([prompt[1:], torch.tensor(out[-1:])])
            hid, dlog = self.draft.ingest(aux, nxt.to(aux.device), torch.arange(plen, device=aux.device))
        # cost sizing: rounds that do not pay become plain steps; `pending` holds the draft's inputs
        # (aux rows, next tokens, positions) for the positions it skipped, ingested at the next drafting round
        gate = None  # unseeded: going on from the last request's gate; seeded: shapes that follow the seed alone
        if s.sizing == "adaptive" and mode != "vanilla":
            gate = DraftGate.after(self.last_gate if s.seed is None else None)
            if s.seed is None:
                self.last_gate = gate  # the next request reads its state then
        pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        while reason is None:
            t_round = time.perf_counter()
            if mode == "vanilla" or (gate is not None and not gate.drafts()):
                token, aux, lp = self._plain_step(out[-1], plen, cache, s, gen, stats)
                if mode == "vanilla":
                    stats.accepted.append(0)
                else:
                    stats.plain_steps += 1
                    stats.nodes += 1
                    dev = aux.device
                    pending.append((aux, torch.tensor([token], device=dev), torch.tensor([plen], device=dev)))
                plen += 1
                out, reason = self._finish(out + [token], s)
                lps = (lps + lp)[: len(out)]
            else:
                catch_up = 0.0
                if pending:  # catch the draft up on the plain steps
                    hid, dlog = self._ingest(pending)
                    pending, catch_up = [], time.perf_counter() - t_round
                accepted, new, aux, lp = self._round(out[-1], hid, dlog, plen, cache, s, mode, depth, gen, stats,
                                                     gate)
                stats.add_split("draft", catch_up)
                before = len(out)
                stats.round_starts.append(before)
                out, reason = self._finish(out + new, s)
                lps = (lps + lp)[: len(out)]
                stats.eos_in_tree |= reason == "eos" and len(out) - before < len(new)
                stats.cut_mid_round |= reason == "length" and len(out) - before < len(new)
                if reason is None:
                    t_ingest = time.perf_counter()
                    idx = torch.tensor(accepted, device=aux.device)
                    rows = (aux[idx], torch.tensor(new, device=aux.device),
                            plen + torch.arange(len(accepted), device=aux.device))
                    if gate is not None and gate.plain_left > 0:  # the next steps are plain: ingest later
                        pending.append(rows)
                    else:
                        hid, dlog = self.draft.ingest(*rows)
                    plen += len(accepted)
                    stats.add_split("draft", time.perf_counter() - t_ingest)
            stats.split["other"] += time.perf_counter() - t_round - stats.round_seconds()
            yield self._snapshot(out, stats, reason, t0, lps if s.logprobs is not None else None)

    def _plain_step(self, root: int, plen: int, cache, s: SpecSettings, gen, stats: SpecStats):
        """One 1-token target forward at position plen -> (the picked token, its aux states [1, 3H], its
        logprob entries: [] or the one of the picked token, scored by this forward's row)."""
        t0 = time.perf_counter()
        stats.begin_round()
        logits, aux = self.target.forward(torch.tensor([root]), torch.tensor([plen]), cache)
        stats.add_split("verify", time.perf_counter() - t0)
        stats.rounds += 1
        token = self._pick(logits[-1], s, gen)
        return token, aux, self._logprobs(logits[-1:], [token], s)

    def _ingest(self, pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        """One draft ingest of the positions the plain steps (and the round before them) skipped."""
        aux, tokens, positions = (torch.cat(parts) for parts in zip(*pending))
        return self.draft.ingest(aux, tokens, positions.to(aux.device))

    def _round(self, root: int, hid, dlog, plen: int, cache, s: SpecSettings, mode: str, depth: int, gen,
               stats: "SpecStats", gate: DraftGate | None = None
               ) -> tuple[list[int], list[int], torch.Tensor, list]:
        """One speculative round: draft a tree, verify it in one target forward, accept, compact the
        target's cache. -> (accepted node indices, new tokens incl. the bonus, the verify's aux states, the
        new tokens' logprob entries or []). Verify row j scores node j's next token: the row of the i-th
        accepted node scores new[i] (the next accepted node's token, or the bonus)."""
        t0 = time.perf_counter()
        k, total = (1, depth + 1) if mode == "chain" else (s.top_k, s.total_tokens)
        plan = self.round_costs(k).plan(plen) if s.sizing == "adaptive" else None
        if plan is not None and gate is not None:
            plan = dataclasses.replace(plan, calibration=gate.calibration.factor)
        tree = self.draft.build_tree(root, hid, dlog, plen - 1, k, depth, total, plan)
        stats.nodes += tree.size
        stats.levels += self.draft.levels
        t1 = time.perf_counter()
        logits, aux = self.target.forward(tree.tokens, tree.positions(plen), cache, self.target.verify_masks(tree, plen))
        t2 = time.perf_counter()
        if s.temperature <= 0:
            accepted, bonus = accept_greedy_tensor(tree, logits.argmax(-1))
        else:
            probs = sampling_probs(logits, s.temperature, s.top_p).cpu()  # drawn on the host, as `_pick`
            accepted, bonus = accept_sampling(tree, probs, gen)
        src, dst = compaction_indices(plen, accepted)
        self.target.compact(cache, src, dst, plen + len(accepted))
        stats.rounds += 1
        stats.accepted.append(len(accepted) - 1)
        if gate is not None:
            ms = (time.perf_counter() - t0) * 1e3, (t2 - t1) * 1e3  # the round so far, its verify
            # seeded: the predicted gain, so the shapes (and so the draws) follow the seed, not the clock
            gate.record(plan.gained(len(accepted) - 1, self.draft.levels, tree.size) if s.seed is not None
                        else plan.measured_gain(len(accepted) - 1, tree.size, *ms))
            gate.calibration.record(len(accepted) - 1, self.draft.expected)
        stats.begin_round()
        stats.add_split("draft", t1 - t0)
        stats.add_split("verify", t2 - t1)
        stats.add_split("accept", time.perf_counter() - t2)
        new = tree.tokens[accepted[1:]].tolist() + [bonus]
        rows = logits[torch.tensor(accepted, device=logits.device)] if s.logprobs is not None else None
        return accepted, new, aux, self._logprobs(rows, new, s)

    def _snapshot(self, out: list[int], stats: SpecStats, reason: str | None, t0: float,
                  lps: list | None = None) -> Generation:
        stats.new_tokens = len(out)
        stats.seconds = time.perf_counter() - t0
        # Text only for the final snapshot: per-round decoding would sit on the hot path.
        done = reason is not None and self.tokenizer is not None
        text = self.tokenizer.decode(out, skip_special_tokens=True) if done else ""
        return Generation(list(out), text, stats, reason, None if lps is None else list(lps))

