"""Hot swap of the served head: a promoted head replaces the running one without a restart.

Ray Serve runs `reconfigure()` concurrently with requests, so the swap is ours, in three rules:
- One registry per application, a detached Ray actor (`eagleray-heads-{app}`, namespace "eagleray"), holds
  the promoted head as (seq, location, version); seq grows by one per promotion.
- A head is taken only after it loads and decodes a fixed prompt token-identical to the target alone
  (`check_head`). `POST /v1/admin/head` runs that on the replica it reaches, then writes the registry; every
  other replica's watcher polls the registry and runs the same check before it swaps. A head that fails is
  refused with one line, kept in the registry's refusals, and the old head keeps serving.
- The replica's head lives in one `Slot` (generator, version) replaced by one assignment. A request reads
  the slot once, when it arrives, and decodes on that generator to the end, so requests in flight finish on
  the head they started with and the version in their usage is the head that decoded them.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

log = logging.getLogger("ray.serve")

NAMESPACE = "eagleray"
CHECK_TOKENS = 24  # the fixed prompt's greedy tokens compared with the target's


@dataclass(frozen=True)
class Slot:
    gen: object          # infer.generate.EagleGenerator
    version: str         # trainer/export.py head_version, "" for the target alone
    head: str | None     # the location it was loaded from, as the registry names it


class HeadRegistry:
    """Ray actor: the application's promoted head and the refusals of heads that failed a replica's check."""

    def __init__(self):
        self.seq, self.head, self.version, self.refused = 0, None, "", []

    def promote(self, head: str, version: str) -> int:
        self.seq += 1
        self.head, self.version = head, version
        return self.seq

    def current(self) -> tuple[int, str | None, str]:
        return self.seq, self.head, self.version

    def refuse(self, replica: str, head: str, reason: str) -> None:
        self.refused = (self.refused + [{"replica": replica, "head": head, "reason": reason}])[-20:]

    def refusals(self) -> list[dict]:
        return list(self.refused)


def registry_name(app_name: str) -> str:
    return f"eagleray-heads-{app_name}"


def registry(app_name: str):
    """The application's registry, created by whichever process asks first (driver or replica)."""
    import ray

    return ray.remote(HeadRegistry).options(name=registry_name(app_name), namespace=NAMESPACE,
                                            lifetime="detached", get_if_exists=True, num_cpus=0).remote()


def reset_registry(app_name: str) -> None:
    """A fresh deployment starts from its configured head: the registry of an earlier one is removed."""
    import ray

    try:
        ray.kill(ray.get_actor(registry_name(app_name), namespace=NAMESPACE))
    except ValueError:  # none yet
        pass


def check_head(gen, tokens: int = CHECK_TOKENS) -> str | None:
    """None when gen's speculative greedy decode of a fixed prompt equals the target alone's, else why not.
    The fixed tree: the check must not depend on this machine's measured costs."""
    from infer.generate import SpecSettings

    ids = gen.tokenizer("The flywheel check: speculative output must equal the target's.",
                        add_special_tokens=False)["input_ids"]
    s = SpecSettings(mode="tree", sizing="fixed", max_new_tokens=tokens)
    want = gen.generate(ids, s.model_copy(update={"mode": "vanilla"})).tokens
    got = gen.generate(ids, s).tokens
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return f"speculative output differs from the target's at token {first} of {len(want)}"
    return None


def load_slot(slot: Slot, head: str, tag: str, adaptive_top_k: int | None) -> Slot:
    """A new slot over slot's target drafting with `head` (a folder or URI), checked; raises ValueError with
    one line when the head does not load or fails `check_head`. Runs on the replica's torch thread."""
    from pipeline import storage
    from trainer.export import head_version

    try:
        folder = storage.node_copy(head)
        version = head_version(folder)
        gen = slot.gen.with_head(folder)
    except Exception as err:  # noqa: BLE001 - whatever a bad folder raises (safetensors' own errors too): refused
        raise ValueError(f"head {storage.redact(head)} does not load: {str(err).splitlines()[0][:300]}") from None
    why = check_head(gen)
    if why:
        raise ValueError(f"head {storage.redact(head)} refused: {why}")
    if adaptive_top_k is not None and gen.draft is not None:
        gen.round_costs(adaptive_top_k)  # measured now, not on the first request after the swap
    return Slot(gen, version, head)


class HeadWatcher:
    """The replica's side: takes heads promoted elsewhere (another replica's admin call) from the registry.

    `owner` has `slot`, `lock` (the decode lock), `pool` (its torch thread) and `replica_id`; a swap waits for
    the lock, so it lands between two decodes."""

    def __init__(self, owner, app_name: str, poll_s: float, adaptive_top_k: int | None):
        self.owner, self.app, self.poll_s, self.top_k = owner, app_name, poll_s, adaptive_top_k
        self.registry = registry(app_name)
        self.seen = 0
        self.task = None

    def take_promoted(self) -> None:
        """At the replica's start (a restart, a scale-up): the promoted head, if any, instead of the configured
        one; a promoted head that fails the check here leaves the configured one serving, and says why."""
        import ray

        seq, head, _version = ray.get(self.registry.current.remote())
        if seq and head is not None:
            try:
                self.owner.slot = self.owner.pool.submit(load_slot, self.owner.slot, head, "serve", self.top_k).result()
            except ValueError as err:
                log.warning("%s", err)
                self.registry.refuse.remote(self.owner.replica_id, head, str(err))
        self.seen = seq

    def start(self) -> None:
        """On the replica's event loop (its constructor runs there under Serve); no loop: no watching."""
        try:
            self.task = asyncio.get_running_loop().create_task(self._watch())
        except RuntimeError:
            self.task = None

    async def _watch(self) -> None:
        while True:
            try:
                seq, head, version = await self.registry.current.remote()
                if seq > self.seen and head is not None:
                    await self.adopt(seq, head, version)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a registry restarting: try again at the next poll
                log.warning("head watcher: %s", str(err).splitlines()[0][:200])
            await asyncio.sleep(self.poll_s)

    async def adopt(self, seq: int, head: str, version: str) -> None:
        self.seen = seq
        if version == self.owner.slot.version:
            return
        try:
            await self.swap(head)
        except ValueError as err:
            log.warning("%s", err)
            await self.registry.refuse.remote(self.owner.replica_id, head, str(err))

    async def swap(self, head: str) -> Slot:
        """Load, check and take `head` (under the decode lock) -> the old slot; ValueError: refused."""
        owner = self.owner
        async with owner.lock:
            old = owner.slot
            new = await asyncio.get_running_loop().run_in_executor(owner.pool, load_slot, old, head, "serve",
                                                                   self.top_k)
            owner.slot = new
        log.info("head swapped: %s -> %s", old.version or "target alone", new.version)
        return old

    async def promote(self, head: str) -> dict:
        """The admin call: swap here, then publish to the other replicas -> the response body."""
        old = await self.swap(head)
        self.seen = await self.registry.promote.remote(head, self.owner.slot.version)
        return {"head_version": self.owner.slot.version, "previous": old.version, "seq": self.seen}

    async def status(self) -> dict:
        seq, head, version = await self.registry.current.remote()
        import ray

        return {"replica": self.owner.replica_id, "node": ray.get_runtime_context().get_node_id(),
                "head_version": self.owner.slot.version, "seq": seq,
                "promoted": version or None,
                "refused": await self.registry.refusals.remote()}
