"""Block-sparse attention over a paged pool (:func:`kvgen.masks.paged_block_mask`, flex_attention): the GPU's way
for the serving engine, run here on the CPU with torch's eager flex_attention (which applies the mask function to
every slot) and once compiled (which reads only the blocks the mask lists)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

import kvgen
from kvgen.cache.paged import PagedAttentionCache
from kvgen.masks import Q_BLOCK, paged_block_mask
from kvgen.serving import ContinuousBatchingConfig
from kvgen.serving.graphs import batch_sizes

BLOCK = 4


def dense_rule(row_seq, row_pos, tables, num_slots, window):
    """(T, slots): whether row i may read slot x, from the tables one by one."""
    allowed = torch.zeros(len(row_seq), num_slots, dtype=torch.bool)
    for i, (s, p) in enumerate(zip(row_seq.tolist(), row_pos.tolist())):
        for j, block in enumerate(tables[s].tolist()):
            for offset in range(BLOCK):
                position = j * BLOCK + offset
                if block >= 0 and position <= p and (window is None or position > p - window):
                    allowed[i, block * BLOCK + offset] = True
    return allowed


@pytest.mark.parametrize("window", [None, 6])
def test_the_block_mask_lists_each_row_blocks_and_keeps_rows_to_their_own(window):
    """Three sequences sharing a two-block prefix (blocks 7 and 2), one with a block slid out (-1), 21 rows over
    two row blocks: the mask function equals the rule slot by slot, and each row block lists every block one of
    its rows reads, once, and no other."""
    tables = torch.tensor([[7, 2, 5, 9, -1], [7, 2, 0, -1, -1], [-1, 2, 3, 4, 8]])
    lengths = [17, 11, 19]
    row_seq = torch.tensor([0] * 8 + [1] * 4 + [2] * 9)
    row_pos = torch.cat([torch.arange(9, 17), torch.arange(7, 11), torch.arange(10, 19)])
    assert [int(row_pos[row_seq == s].max()) + 1 for s in range(3)] == lengths
    num_slots = 12 * BLOCK
    mask = paged_block_mask(row_seq, row_pos, tables, BLOCK, num_slots, window)
    expected = dense_rule(row_seq, row_pos, tables, num_slots, window)

    q, kv = torch.meshgrid(torch.arange(len(row_seq)), torch.arange(num_slots), indexing="ij")
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(mask.mask_mod(zero, zero, q, kv), expected)

    counts, indices = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    assert counts.shape == (2,)
    for g in range(2):
        listed = indices[g, :counts[g]].tolist()
        rows = expected[g * Q_BLOCK:(g + 1) * Q_BLOCK].view(-1, num_slots // BLOCK, BLOCK).any(dim=(0, 2))
        assert len(listed) == len(set(listed))
        assert sorted(listed) == rows.nonzero().flatten().tolist()


CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**BASE),
    "gemma2": lambda: transformers.Gemma2Config(**BASE, sliding_window=6, query_pre_attn_scalar=24,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(**BASE, sliding_window=6, sliding_window_pattern=2),
}
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def serve(model, prompts, block_sparse: bool, decode_graphs: bool = False, runs: list | None = None):
    config = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=64, max_batch_tokens=16, block_sparse=block_sparse,
                                      decode_graphs=decode_graphs, pack_weights=False)
    manager = model.init_continuous_batching(continuous_batching_config=config)
    if runs is not None:  # the sizes of the decode steps the graphs ran
        run = manager.runner.graphs.run
        manager.runner.graphs.run = lambda ids, *rest: runs.append(len(ids)) or run(ids, *rest)
    ids = [manager.add_request(p, max_new_tokens=10, eos_token_id=[], top_logprobs=2) for p in prompts]
    with manager:
        return [manager.get_result(i, timeout=120) for i in ids]


def test_the_engine_reads_each_sequence_blocks_alike(model):
    """Three requests, two sharing a cached 8-token prefix, prompts chunked over steps of 16 tokens, decoding past
    Gemma's sliding window: the engine with block-sparse attention gives the dense masks' tokens and logprobs
    (eager flex_attention against kvgen's attention over the same float32 pool: within float32 rounding)."""
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 128, (8,), generator=generator).tolist()
    prompts = [shared + [5, 9, 11], torch.randint(3, 128, (21,), generator=generator).tolist(), shared + [17]]
    sparse, dense = serve(model, prompts, True), serve(model, prompts, False)
    for a, b in zip(sparse, dense):
        assert a.generated_tokens == b.generated_tokens and len(a.generated_tokens) == 10
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_the_decode_graphs_static_buffers_give_the_runner_steps(model):
    """The decode graphs' eager twin (their static buffers, padded to 1, 2, 4, ... rows, run without capture):
    the tokens and logprobs of the runner's own steps, the spare block's padded rows reading nothing of the
    sequences'."""
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (7, 12, 3)]
    runs = []
    graphs, dense = serve(model, prompts, True, decode_graphs=True, runs=runs), serve(model, prompts, False)
    assert 3 in runs and len(runs) >= 9  # decode steps of three rows (padded to 4) went through the buffers
    for a, b in zip(graphs, dense):
        assert a.generated_tokens == b.generated_tokens and len(a.generated_tokens) == 10
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host, which CUDA graph capture forbids."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)
        return func(*args, **(kwargs or {}))


def test_a_decode_graph_step_reads_no_value_on_the_host(monkeypatch):
    """What a CUDA graph captures may not read tensor values on the host: a graph step of 4 rows over the buffers
    (its block mask included) reads none. (Eager flex_attention, which cannot run under a dispatch mode, is
    replaced by a stand-in that uses its inputs.)"""
    import kvgen.models.sdpa as sdpa

    model = kvgen.AutoModelForCausalLM.from_config(kvgen.PretrainedConfig(**BASE, model_type="llama"))
    config = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=16, max_num_seqs=4, block_sparse=True,
                                      decode_graphs=True, pack_weights=False)
    graphs = model.init_continuous_batching(continuous_batching_config=config).runner.graphs
    masks = []
    monkeypatch.setattr(sdpa, "flex_attention", lambda q, k, v, block_mask, **_: masks.append(block_mask) or q * 0)
    with HostReads() as mode:
        logits = graphs._forward(4)
    assert mode.reads == 0 and logits.shape == (4, 128) and len(masks) == 2
    assert masks[0].kv_num_blocks.tolist() == [[[1]]]  # the four padded rows read the spare block


def test_decode_graphs_need_a_block_sparse_pool(model):
    config = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=8, block_sparse=False, decode_graphs=True)
    with pytest.raises(ValueError, match="block_sparse=True"):
        model.init_continuous_batching(continuous_batching_config=config)


def test_decode_graph_sizes():
    assert batch_sizes(1) == [1] and batch_sizes(8) == [1, 2, 4, 8] and batch_sizes(9) == [1, 2, 4, 8, 16]
    assert batch_sizes(256)[-2:] == [240, 256] and len(batch_sizes(256)) == 20


def test_a_block_sparse_pool_has_a_spare_block_for_padded_rows():
    config = transformers.LlamaConfig(**BASE)
    cache = PagedAttentionCache(config, num_blocks=5, block_size=BLOCK, block_sparse=True)
    assert cache.spare_slot == 5 * BLOCK and cache.layers[0].pool_keys.shape[2] == 6 * BLOCK
    assert PagedAttentionCache(config, num_blocks=5, block_size=BLOCK).layers[0].pool_keys.shape[2] == 5 * BLOCK


def test_compiled_flex_attention_reads_only_the_listed_blocks():
    """Compiled, flex_attention visits only the blocks each row block lists (eager, it scores every slot): on a
    pool whose unlisted slots hold huge values, the compiled result equals the eager one and attention over
    each row's own slots gathered densely."""
    torch.manual_seed(0)
    tables = torch.tensor([[3, 1, -1], [0, 4, 6]])
    row_seq, row_pos = torch.tensor([0, 0, 1]), torch.tensor([5, 6, 10])
    num_slots = 8 * BLOCK
    mask = paged_block_mask(row_seq, row_pos, tables, BLOCK, num_slots)
    q = torch.randn(1, 4, 3, 16)
    k, v = torch.randn(1, 2, num_slots, 16), torch.randn(1, 2, num_slots, 16)
    unlisted = torch.ones(num_slots, dtype=torch.bool)
    for block in (3, 1, 0, 4, 6):
        unlisted[block * BLOCK:(block + 1) * BLOCK] = False
    k[:, :, unlisted], v[:, :, unlisted] = 1e4, 1e4
    compiled = torch.compile(flex_attention, fullgraph=True)(q, k, v, block_mask=mask, enable_gqa=True)
    eager = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    allowed = dense_rule(row_seq, row_pos, tables, num_slots, None)
    expected = torch.stack([torch.nn.functional.scaled_dot_product_attention(
        q[:, :, i:i + 1], k[:, :, allowed[i]], v[:, :, allowed[i]], enable_gqa=True)[:, :, 0] for i in range(3)], 2)
    assert (compiled - expected).abs().max() < 1e-5 and (eager - expected).abs().max() < 1e-5


def test_a_torch_without_block_masks_from_key_blocks_is_told_what_to_do(monkeypatch):
    import kvgen.cache.paged as paged

    monkeypatch.setattr(paged, "BLOCK_MASKS", False)
    with pytest.raises(ValueError, match="needs torch 2.9 or later .* block_sparse=False"):
        PagedAttentionCache(transformers.LlamaConfig(**BASE), num_blocks=4, block_sparse=True)
