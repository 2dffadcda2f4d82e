"""bf16 decoding on oneDNN (infer/cpu/: packed.py, scripted.py, fused.py, exact_attention.py): packed
linears give F.linear's rows bit for bit at any row count, scripted layers the modules' bits, the fused
C++ halves the scripted ones', a verified tree's rows are bit for bit what HF's own 1-token steps give for
each node's path, and greedy tree decoding in bf16 is token-identical to HF generate in bf16. Skipped
where this CPU has no oneDNN bf16 (the CI box has AMX)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as T

from infer.generate import EagleGenerator, SpecSettings
from infer.cpu import choose_target, fused as fused_layer
from infer.cpu.exact_attention import PathGroups
from infer.cpu.lean import LeanTarget
from infer.cpu.packed import (NotPacked, PackedLinear, packing_unsupported, rows_depend_on_count,
                              with_packed_linears)
from infer.tree import Candidates, finalize
from pipeline.target import default_aux_layers
from trainer.head import Eagle3Head, head_config_from_target

pytestmark = pytest.mark.skipif(packing_unsupported(torch.zeros(1, dtype=torch.bfloat16)) is not None,
                                reason="no oneDNN bf16 on this CPU")

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
FAMILIES = {
    "llama": lambda: T.LlamaConfig(**COMMON, head_dim=32),
    "qwen2": lambda: T.Qwen2Config(**COMMON),  # q/k/v biases: the fused q|k|v bias
    "qwen3": lambda: T.Qwen3Config(**COMMON, head_dim=32),
    # a down projection over 1536 inputs: on a CPU without AMX its multi-row calls round some rows
    # differently from 1-row calls (SmolLM2's shape), so the exact verify calls it a row at a time
    "llama_k1536": lambda: T.LlamaConfig(**{**COMMON, "intermediate_size": 1536}, head_dim=32),
}


def bf16_model(config) -> T.PreTrainedModel:
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() == 2 else None
    return model.to(torch.bfloat16)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    return request.param, bf16_model(FAMILIES[request.param]())


def lean_of(model, aux_ids: list[int]) -> LeanTarget | None:
    return choose_target(model, aux_ids)[0]


def ids_of(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_f_linear_bit_for_bit_at_any_row_count(bias):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(384, 160, generator=gen).bfloat16()
    b = torch.randn(384, generator=gen).bfloat16() if bias else None
    lin = PackedLinear.pack(w, b)
    assert lin is not None
    x = torch.randn(1, 33, 160, generator=gen).bfloat16()
    want = F.linear(x, w, b)
    assert torch.equal(lin(x), want)
    for rows in (1, 2, 7, 16):  # a row does not change with how many rows share the call
        assert torch.equal(lin(x[:, 5:5 + rows]), want[:, 5:5 + rows])


def test_rows_depend_on_count_tells_apart():
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0)).bfloat16()

    def row_by_row(x):
        return torch.cat([F.linear(x[:, i:i + 1], w) for i in range(x.shape[1])], dim=1)

    assert not rows_depend_on_count(row_by_row, 40, w)
    nudged = lambda x: row_by_row(x) + (x.shape[1] > 1) * 2.0 ** -6  # noqa: E731 - a multi-row call rounds up
    assert rows_depend_on_count(nudged, 40, w)


def test_wide_down_projection_is_verified_row_by_row_where_needed():
    m = bf16_model(FAMILIES["llama_k1536"]())
    lean = lean_of(m, default_aux_layers(6))
    down = m.model.layers[0].mlp.down_proj.weight
    assert lean.row_wise[3] == rows_depend_on_count(lambda x: F.linear(x, down), 1536, down)
    assert lean.row_wise[:3] == [False, False, False]  # 128 inputs: one order at any row count here


def test_verified_chains_equal_one_token_steps_with_a_wide_mlp():
    """Many 16-token chains verified in one forward each, against the same tokens decoded one at a time:
    every row's logits bit for bit. With a 1536-input down projection, a multi-row call rounds a few
    outputs in 10^4 differently on a CPU without AMX: over these 8 x 16 rows x 6 layers some do, so
    without the row-at-a-time verify (`row_wise`) this fails there."""
    m = bf16_model(FAMILIES["llama_k1536"]())
    lean = lean_of(m, default_aux_layers(6))
    n = 16
    for trial in range(8):
        ids = ids_of(10 + trial, 40 + n)
        steps, verify = lean.new_cache(), lean.new_cache()
        for cache in (steps, verify):
            lean.forward(ids[:40], torch.arange(40), cache, last_only=True)
        want = torch.cat([lean.forward(ids[40 + i:41 + i], torch.tensor([40 + i]), steps)[0]
                          for i in range(n)])
        keep = torch.cat([torch.ones(n, 40, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
        got, _ = lean.forward(ids[40:], torch.arange(40, 40 + n), verify, keep[None, None])
        assert torch.equal(got, want), (trial, (got - want).abs().amax(-1).tolist())


def test_only_bf16_is_packed():
    assert "bf16" in packing_unsupported(torch.zeros(2, 2))
    head = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(NotPacked, match="bf16"):  # fp32: refused, the module unchanged
        with_packed_linears(head)
    packed = with_packed_linears(head.bfloat16())
    assert packed is not head and isinstance(packed[0], PackedLinear)
    assert isinstance(head[0], torch.nn.Linear)  # the caller's module is not modified


def test_bf16_lean_target_packs_and_its_prefill_equals_hf(model):
    name, m = model
    lean = lean_of(m, default_aux_layers(6))
    assert lean is not None and lean.packed is not None and lean.exact_attention, name
    ids = ids_of(1, 40)
    logits, _ = lean.forward(ids, torch.arange(40), lean.new_cache())
    with torch.no_grad():
        want = m(input_ids=ids[None]).logits[0].float()
    assert torch.equal(logits, want), (name, (logits - want).abs().max())


def test_scripted_layers_give_the_modules_bits(model):
    """Packed Llama-shaped layers run as TorchScript (infer/cpu/scripted.py) with the bits of the
    modules' path, q|k|v biases included; Qwen3 (q/k norms) keeps the modules' path."""
    name, m = model
    lean = lean_of(m, default_aux_layers(6))
    assert (lean.script_args is not None) == (name != "qwen3"), name
    if lean.script_args is None:
        return
    ids, pos = ids_of(3, 30), torch.arange(30)
    got = lean.forward(ids, pos, lean.new_cache())
    lean.script_args = None
    want = lean.forward(ids, pos, lean.new_cache())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name


def test_fused_layer_decodes_with_the_scripted_halves_bits():
    """The C++ halves (infer/cpu/fused.py) on a SmolLM2-shaped layer (576 wide, 9 / 3 heads of 64, a
    1536 MLP): a prefill, 1-token steps and an exact tree verify give the TorchScript halves' logits and
    aux states bit for bit, and the K/V they write into the cache."""
    if fused_layer.extension()[0] is None:
        pytest.skip("the fused layer does not build here (no C++ toolchain)")
    m = bf16_model(T.LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536,
                                 num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                                 max_position_embeddings=512))
    lean = lean_of(m, [0, 1])
    assert lean is not None and lean.fused is not None
    halves = lean.fused
    gen = torch.Generator().manual_seed(5)
    keep, key_pos = random_tree_mask(9, 70, gen)
    tree_tokens = ids_of(6, 9)

    def decode(fused):
        lean.fused = fused
        cache, outs = lean.new_cache(), []
        outs.append(lean.forward(ids_of(4, 60), torch.arange(60), cache))
        for t, tok in enumerate(ids_of(5, 10).tolist()):
            outs.append(lean.forward(torch.tensor([tok]), torch.tensor([60 + t]), cache))
        outs.append(lean.forward(tree_tokens, key_pos[70:], cache, keep))
        return outs, cache.kv[:, :, :, :cache.length].clone()

    got, got_kv = decode(halves)
    want, want_kv = decode(None)
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert torch.equal(got_kv, want_kv)


def test_fused_layer_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("EAGLERAY_FUSED_LAYER", "0")
    ext, why = fused_layer.extension.__wrapped__()
    assert ext is None and why == "EAGLERAY_FUSED_LAYER=0"


def test_a_layer_the_script_does_not_reproduce_keeps_the_modules_path():
    m = bf16_model(FAMILIES["llama"]())
    norm = m.model.layers[0].post_attention_layernorm

    class Offset(type(norm)):  # a variant (a Gemma-like shift) with the same attributes as LlamaRMSNorm
        def forward(self, x):
            return super().forward(x) + 1

    norm.__class__ = Offset
    lean = lean_of(m, default_aux_layers(6))
    assert lean is not None and lean.packed is not None and lean.script_args is None
    ids = ids_of(4, 20)
    logits, _ = lean.forward(ids, torch.arange(20), lean.new_cache())
    with torch.no_grad():
        assert torch.equal(logits, m(input_ids=ids[None]).logits[0].float())


@pytest.mark.parametrize("order", ["creation", "shuffled"])
def test_verified_tree_rows_equal_hf_one_token_steps_bit_for_bit(model, order):
    """Every node's logits from one verify forward equal HF decoding that node's path one token at a time
    after the same prefix: the verify rounds like the steps it replaces. "shuffled" lays the nodes out in
    an order that is not depth by depth (the gathered-rows path); one SDPA call per key count."""
    name, m = model
    lean = lean_of(m, default_aux_layers(6))
    prefix = ids_of(2, 60)
    cands = Candidates([11, 12, 13, 14, 15, 16], [-1, -1, 0, 0, 2, 4], [-.1, -.2, -.3, -.4, -.5, -.6],
                       [1, 1, 2, 2, 3, 4])
    tree = finalize(7, cands, [0, 1, 2, 3, 4, 5])
    perm = torch.arange(tree.size) if order == "creation" else torch.tensor([3, 0, 5, 1, 6, 2, 4])
    visible = tree.mask[perm][:, perm]
    hidden = (~torch.cat([torch.ones(tree.size, 60, dtype=torch.bool), visible], 1))[None, None]
    additive = torch.zeros(hidden.shape, dtype=torch.bfloat16).masked_fill(hidden, float("-inf"))
    positions = tree.positions(60)[perm]
    paths = PathGroups(additive, torch.cat([torch.arange(60), positions]))
    assert len(paths.groups) == 5  # keys seen: 61..65 (depths 0..4)
    assert paths.in_order == (order == "creation")
    cache = lean.new_cache()
    lean.forward(prefix, torch.arange(60), cache, last_only=True)
    got, _ = lean.forward(tree.tokens[perm], positions, cache, additive)
    parents = tree.parents.tolist()
    for row, j in enumerate(perm.tolist()):
        path = [j]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        with torch.no_grad():
            out = m(input_ids=prefix[None], use_cache=True)
            for node in path:
                out = m(input_ids=tree.tokens[node].view(1, 1), past_key_values=out.past_key_values,
                        use_cache=True)
        assert torch.equal(got[row], out.logits[0, -1].float()), (name, order, j)


def test_bf16_greedy_tree_identical_to_hf_generate(model):
    name, m = model
    torch.manual_seed(1)
    head = Eagle3Head(head_config_from_target(m.config, VOCAB))
    gen = EagleGenerator(m, None, head, default_aux_layers(6))
    gen.eos = set()
    assert gen.target.lean is not None and gen.target.lean.packed is not None
    for seed in range(2):
        ids = ids_of(10 + seed, 40).tolist()
        with torch.no_grad():
            want = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, 40, dtype=torch.long),
                              max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        for shape in (dict(mode="tree", top_k=3, depth=4, total_tokens=10), dict(mode="chain", depth=4)):
            got = gen.generate(ids, SpecSettings(**shape, max_new_tokens=24))
            assert got.tokens == want[0, 40:].tolist(), (name, seed, shape["mode"])


def random_tree_mask(n: int, prefix: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of n nodes in creation order after `prefix` committed slots -> (keep [1, 1, n,
    prefix + n] bool, key positions [prefix + n])."""
    parents = [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]
    depth, vis = [0] * n, torch.eye(n, dtype=torch.bool)
    for j in range(1, n):
        depth[j] = depth[parents[j]] + 1
        vis[j] |= vis[parents[j]]
    keep = torch.cat([torch.ones(n, prefix, dtype=torch.bool), vis], 1)[None, None]
    return keep, torch.cat([torch.arange(prefix), prefix + torch.tensor(depth)])


def test_path_attention_rows_equal_their_own_unmasked_calls():
    """Kernel-level: every row of path_attention (one call per key count) has the bits of an unmasked
    1-row SDPA call over exactly its keys, across prefixes that cross the kernel's 512-key split, with the
    keys built per call or read from prefix copies (brought up to date first); one masked call over all
    rows does not, so this test can tell."""
    from infer.cpu.exact_attention import path_attention
    gen = torch.Generator().manual_seed(0)
    heads, kvh, D = 8, 2, 64
    fused_differs = 0
    for prefix in (45, 60, 100, 250, 505):
        n = 16
        keep, pos = random_tree_mask(n, prefix, gen)
        q = torch.randn(1, heads, n, D, generator=gen).bfloat16()
        kv = torch.randn(2, kvh, prefix + n, D, generator=gen).bfloat16()
        paths = PathGroups(keep, pos)
        got = path_attention(q, kv, paths, 0.125)
        # the same rows over 3 prefix copies (groups of 4+ rows split), synced up to a third of the prefix
        copies = torch.randn(2, 3, kvh, prefix + n + 7, D, generator=gen).bfloat16()
        copies[:, :, :, : prefix // 3] = kv[:, None, :, : prefix // 3]
        assert torch.equal(path_attention(q, kv, paths, 0.125, copies, prefix // 3, prefix), got), prefix
        assert torch.equal(copies[:, :, :, :prefix], kv[:, None, :, :prefix].expand(2, 3, kvh, prefix, D))
        order = pos.argsort()  # the fused call: every row at once, keys in position order, masked
        fused = F.scaled_dot_product_attention(q, kv[0, None][:, :, order], kv[1, None][:, :, order],
                                               attn_mask=keep[..., order], scale=0.125, enable_gqa=True)
        for i in range(n):
            keys = keep[0, 0, i].nonzero().flatten()
            keys = keys[pos[keys].argsort()]
            want = F.scaled_dot_product_attention(q[:, :, i:i + 1], kv[0, None][:, :, keys],
                                                  kv[1, None][:, :, keys], scale=0.125, enable_gqa=True)
            assert torch.equal(got[i], want[0, :, 0][:, None]), (prefix, i)
            fused_differs += not torch.equal(fused[0, :, i], want[0, :, 0])
    assert fused_differs > 0


def test_fused_packing_gives_each_linears_own_rows():
    gen = torch.Generator().manual_seed(1)
    parts = [torch.nn.Linear(96, n, bias=b).bfloat16() for n, b in ((64, True), (32, False), (32, True))]
    lin = PackedLinear.pack_fused(parts)
    assert lin is not None
    x = torch.randn(1, 9, 96, generator=gen).bfloat16()
    for got, m in zip(lin(x).split([64, 32, 32], dim=-1), parts):
        assert torch.equal(got, m(x))


def test_bf16_draft_fuses_its_projections_and_steps_like_the_plain_head():
    from infer.draft import DraftRunner

    cfg = head_config_from_target(T.LlamaConfig(**COMMON, head_dim=32), draft_vocab_size=64)
    torch.manual_seed(0)
    head = Eagle3Head(cfg).bfloat16().eval()
    embed = torch.randn(VOCAB, cfg.hidden_size).bfloat16()
    runner = DraftRunner(head, embed)
    attn, mlp = runner.head.midlayer.self_attn, runner.head.midlayer.mlp
    assert isinstance(attn.fused_qkv, PackedLinear) and isinstance(mlp.fused_gate_up, PackedLinear)
    assert head.midlayer.self_attn.fused_qkv is None  # the caller's head is left as it was
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(1, 5, cfg.hidden_size, generator=gen).bfloat16()
    tokens, pos = ids_of(3, 5)[None], torch.arange(5)[None]
    with torch.no_grad():
        want_q = head.qkv(h, F.embedding(tokens, embed), pos)
        got_q = runner.head.qkv(h, F.embedding(tokens, embed), pos)
        for got, want in zip(got_q, want_q):
            assert torch.equal(got, want)
        attn_out = torch.randn(1, cfg.num_attention_heads, 5, cfg.head_dim, generator=gen).bfloat16()
        assert torch.equal(runner.head.finish(h, attn_out), head.finish(h, attn_out))
        # the scripted step (infer/cpu/scripted.py), through the C++ halves where they build
        # (infer/cpu/fused.py), is the modules' step, bit for bit
        assert runner.script_args is not None
        assert (runner.fused is not None) == (fused_layer.extension()[0] is not None)
        mask = torch.ones(5, 5, dtype=torch.bool).tril()
        got = runner._step(h[0], tokens[0], pos[0], 0, mask)
        runner.script_args = None
        want = runner._step(h[0], tokens[0], pos[0], 0, mask)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
