"""The fused decode stack (``kvgen::decoder_layers``, :mod:`kvgen.models.decode_stack`) and the cache seam it uses.

The stack runs the per-layer C++ functions in the per-layer order, so its logits and cache contents must
equal the per-layer path's bit for bit: on random Llama, Gemma 2 (soft-caps), Gemma 3 (q/k norms,
local rope) and Qwen2 (q/k/v biases) checkpoints quantized to int8 at load, with a growing cache, a
sliding-window cache past its window, and a left-padded batch.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers

import kvgen
from kvgen.cache.base import Cache
from kvgen.cache.dynamic import DynamicLayer, DynamicSlidingWindowLayer
from kvgen.cache.static import StaticLayer
from kvgen.kernels import kernels_available
from kvgen.models.decode_stack import DecodeStack
from kvgen.models.llama import layer_parts
from kvgen.models.packed import PackedWeight, tile_rows, untile_rows
from kvgen.quantization import TorchAoConfig

pytestmark = pytest.mark.skipif(not kernels_available(), reason="kvgen's C++ kernels could not be built here")

WINDOW = 6
BASE = dict(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=128, initializer_range=0.2)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**BASE),
    "gemma2": lambda: transformers.Gemma2Config(**BASE, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(**BASE, sliding_window=WINDOW, sliding_window_pattern=2),
    "qwen2": lambda: transformers.Qwen2Config(**BASE),  # biases on the q/k/v products
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):  # (biases start at 0)
                param.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     quantization_config=TorchAoConfig("int8_weight_only"))


def reversed_rows(weight: PackedWeight) -> torch.Tensor:
    """The stored bytes of a one-segment ``weight`` with its rows in reverse order, in its layout (rows, or tiles of 16
    rows where int8 takes integer dot products): another valid weight of the same shape."""
    ((format, data),) = untile_rows(weight).segments
    ((_, out),) = tile_rows(PackedWeight([(format, torch.flip(data, [0]).contiguous())], weight.in_features)).segments
    return out


def decode(model, ids, padding, cache, steps, fused: bool, monkeypatch):
    """Logits of a prefill and ``steps`` greedy steps, and how many steps the stack ran."""
    stack_runs, logits = [], []
    run = model.decode_stack.run

    def counted(*args):
        stack_runs.append(run(*args) if fused else None)
        return stack_runs[-1]

    with monkeypatch.context() as m:
        m.setattr(model.decode_stack, "run", counted)
        with torch.no_grad():
            for _ in range(steps + 1):
                out = model(ids, attention_mask=padding, past_key_values=cache).logits[:, -1]
                logits.append(out)
                ids = out.argmax(-1, keepdim=True)
                padding = torch.cat([padding, torch.ones_like(ids)], dim=1)
    return logits, sum(r is not None for r in stack_runs)


@pytest.mark.parametrize("cache_kind", ["dynamic", "dynamic_windowed", "padded", "static"])
def test_the_stack_gives_the_per_layer_bits(model, cache_kind, monkeypatch):
    """Logits and stored keys/values equal to the per-layer path, past the sliding window (prompt 17, 12 steps; the
    padded prefill of 2 x 17 rows, more than STACK_ROWS, layer by layer in both)."""
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    padding = torch.ones_like(ids)
    if cache_kind == "padded":
        padding[1, :4] = 0
    else:
        ids, padding = ids[:1], padding[:1]

    def new_cache():
        if cache_kind == "static":
            return kvgen.StaticCache(config=model.config, max_cache_len=32)
        return kvgen.DynamicCache(config=model.config) if cache_kind == "dynamic_windowed" else kvgen.DynamicCache()

    caches = new_cache(), new_cache()
    fused, runs = decode(model, ids, padding, caches[0], 12, True, monkeypatch)
    plain, _ = decode(model, ids, padding, caches[1], 12, False, monkeypatch)
    assert runs == 12  # every decode step fused (not the prefill)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(caches[0], caches[1]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    if cache_kind == "dynamic_windowed" and model.config.model_type.startswith("gemma"):  # (the sliding ones)
        assert min(keys.shape[2] for keys, _ in caches[0]) < 17 + 12  # a sliding layer dropped what it may


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_a_paged_pool_step_gives_the_per_layer_bits(model, kv_dtype, monkeypatch):
    """The serving engine's decode steps over its paged pool (two sequences' rows side by side, their blocks of 4
    interleaved, their new keys and values stored in the pool's precision where the runner placed them; past the
    sliding window): the per-layer path's tokens, logprobs and pool contents, bit for bit."""
    from kvgen.serving import ContinuousBatchingConfig

    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (9, 5)]

    def serve(fused: bool):
        runs, run = [], model.decode_stack.run

        def counted(*args):
            runs.append(run(*args) if fused else None)
            return runs[-1]

        config = ContinuousBatchingConfig(block_size=4, num_blocks=32, kv_dtype=kv_dtype, pack_weights=False)
        with monkeypatch.context() as m:
            m.setattr(model.decode_stack, "run", counted)
            manager = model.init_continuous_batching(continuous_batching_config=config)
            ids = [manager.add_request(p, max_new_tokens=12, eos_token_id=[], top_logprobs=1) for p in prompts]
            with manager:
                outputs = [manager.get_result(i, timeout=120) for i in ids]
        pools = [t.clone() for layer in manager.cache.layers for t in (layer.pool_keys, layer.pool_values)]
        return outputs, pools, sum(r is not None for r in runs)

    (fused, fused_pools, runs), (plain, plain_pools, _) = serve(True), serve(False)
    assert runs >= 10  # the decode steps of two rows (not the prefill)
    for a, b in zip(fused, plain):
        assert a.generated_tokens == b.generated_tokens and len(a.generated_tokens) == 12
        assert a.logprobs == b.logprobs
    for a, b in zip(fused_pools, plain_pools):
        assert torch.equal(a, b)


def test_decode_steps_of_up_to_stack_rows_run_through_the_stack(model, monkeypatch):
    """Decode steps of 12 batch rows (past the 8 of the per-layer fused ops, at most STACK_ROWS) run through the
    stack: within float32 summation error of the per-layer path, whose attention over a batch is torch's SDPA."""
    from kvgen.models.decode_stack import STACK_ROWS

    ids = torch.randint(3, 128, (12, 5), generator=torch.Generator().manual_seed(3))
    assert 8 < ids.shape[0] <= STACK_ROWS
    padding = torch.ones_like(ids)
    padding[1, :2] = 0
    fused, runs = decode(model, ids, padding, kvgen.DynamicCache(config=model.config), 6, True, monkeypatch)
    plain, _ = decode(model, ids, padding, kvgen.DynamicCache(config=model.config), 6, False, monkeypatch)
    assert runs == 6  # (not the prefill: 60 rows)
    assert max((a - b).abs().max().item() for a, b in zip(fused, plain)) < 1e-4


@pytest.mark.parametrize("threads", [1, 3])
def test_the_stack_gives_the_same_bits_with_any_thread_count(model, threads, monkeypatch):
    """The stack's layers run in one parallel region whose threads split each product's rows and take attention
    items as they come: 1 thread and 3 (more than this machine's cores: its barriers must yield) give the bits of
    the per-layer path at the default count."""
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(2))  # (a prefill past STACK_ROWS)
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    plain, _ = decode(model, ids, padding, kvgen.DynamicCache(config=model.config), 8, False, monkeypatch)
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, runs = decode(model, ids, padding, kvgen.DynamicCache(config=model.config), 8, True, monkeypatch)
    finally:
        torch.set_num_threads(default)
    assert runs == 8
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


def prefill_with(model, ids, padding, fused: bool, monkeypatch):
    """Logits and layer 1's cached keys of a prefill, the fused prefill ops on or off; how many calls they took."""
    from kvgen.models import native

    calls = []
    with monkeypatch.context() as m:
        for name in ("decoder_attention_inputs", "decoder_mlp"):
            def spy(x, *args, op=getattr(native, name), **kwargs):
                out = op(x, *args, **kwargs) if fused else None
                calls.append(out is not None)
                return out

            m.setattr(native, name, spy)
        cache = kvgen.DynamicCache()
        with torch.no_grad():
            logits = model(ids, attention_mask=padding, past_key_values=cache).logits
    return logits, cache.layers[1].keys.clone(), sum(calls)


def test_a_prefill_through_the_fused_ops_gives_the_module_bits(model, monkeypatch):
    """A prefill of more rows than the stack takes (2 x 24: int8 rows take kvgen::qmatmul up to QMATMUL_ROWS rows,
    as the fused ops do) runs the fused attention inputs and MLP half of every layer,
    with the modules' bits."""
    from kvgen.models.decode_stack import STACK_ROWS
    from kvgen.models.quantized_linear import QMATMUL_ROWS

    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    assert STACK_ROWS < ids.numel() <= QMATMUL_ROWS
    padding = torch.ones_like(ids)
    padding[1, :5] = 0
    fused = prefill_with(model, ids, padding, True, monkeypatch)
    modules = prefill_with(model, ids, padding, False, monkeypatch)
    assert fused[2] == 2 * model.config.num_hidden_layers and modules[2] == 0
    assert torch.equal(fused[0], modules[0]) and torch.equal(fused[1], modules[1])


def test_a_static_cache_written_elsewhere_than_after_its_filled_slots_takes_the_per_layer_path(model, monkeypatch):
    """A static cache's slot i holds position i, and a step may write anywhere (here past a gap): the stack reserves
    only the slots after the filled ones, so such a step runs layer by layer, with the same bits."""
    ids = torch.tensor([[5, 6, 7]])
    logits = []
    for fused in (True, False):
        cache = kvgen.StaticCache(config=model.config, max_cache_len=16)
        runs = []
        with monkeypatch.context() as m:
            run = model.decode_stack.run
            m.setattr(model.decode_stack, "run", lambda *a, _f=fused: runs.append(run(*a) if _f else None) or runs[-1])
            with torch.no_grad():
                model(ids, past_key_values=cache)
                logits.append(model(ids[:, :1], past_key_values=cache, cache_position=torch.tensor([5])).logits)
                assert cache.get_seq_length() == 6
        assert sum(r is not None for r in runs) == 0
    assert torch.equal(*logits)


def test_a_replaced_weight_is_read_by_the_next_step(model, monkeypatch):
    """The stack keeps its gathered arguments only while the layers hold the same tensors."""
    ids = torch.tensor([[5, 6, 7]])
    padding = torch.ones_like(ids)
    decode(model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)  # gathers the arguments
    down = model.model.layers[1].mlp.down_proj
    saved = down.weight
    try:
        ((fmt, _),) = saved.segments
        down.weight = PackedWeight([(fmt, reversed_rows(saved))], saved.in_features)
        fused, runs = decode(model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)
        plain, _ = decode(model, ids, padding, kvgen.DynamicCache(), 2, False, monkeypatch)
    finally:
        down.weight = saved
    assert runs == 2 and all(torch.equal(a, b) for a, b in zip(fused, plain))
    before, _ = decode(model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)
    assert not torch.equal(before[-1], fused[-1])


def test_a_weight_whose_data_is_set_anew_is_read_by_the_next_step(model, monkeypatch):
    """``param.data = ...`` (as ``module.to(...)`` does) keeps the tensor object and changes no module dict: the stack
    sees the data move and registers the weights anew, so its steps still give the per-layer path's bits."""
    ids = torch.tensor([[5, 6, 7]])
    padding = torch.ones_like(ids)
    before, runs = decode(model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)  # registers the weights
    norm, down = model.model.layers[1].post_attention_layernorm, model.model.layers[1].mlp.down_proj
    weight, packed = norm.weight.data, down.packed_0.data
    try:
        norm.weight.data = weight * 2
        down.packed_0.data = reversed_rows(down.weight)
        fused, runs = decode(model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)
        plain, _ = decode(model, ids, padding, kvgen.DynamicCache(), 2, False, monkeypatch)
    finally:
        norm.weight.data, down.packed_0.data = weight, packed
    assert runs == 2 and all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert not torch.equal(before[-1], fused[-1])
    again, _ = decode(model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)  # the data put back
    assert all(torch.equal(a, b) for a, b in zip(before, again))


def test_a_setting_changed_after_registration_is_read_by_the_next_step(model, monkeypatch):
    """The stack copies the layers' settings (attention scales, the norms' epsilon, the activation) into C++ when it
    registers the weights; a setting assigned afterwards counts as a change, so the next step registers them again
    and gives the per-layer path's bits with the new setting."""
    ids = torch.tensor([[5, 6, 7]])
    padding = torch.ones_like(ids)
    before, _ = decode(model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)  # registers the weights
    parts = [model.decode_stack.parts(layer) for layer in model.model.layers]
    attn, mlps = parts[1].attn, [p.mlp for p in parts]
    norms = [n for p in parts for n in (p.input_norm, p.pre_feedforward)]
    settings = attn.scaling, norms[0].eps, mlps[0].act_name
    other = "silu" if settings[2] == "gelu_pytorch_tanh" else "gelu_pytorch_tanh"  # both fused activations

    def assign(scaling, eps, act_name):
        attn.scaling = scaling  # one layer's (the stack takes one per layer)
        for norm in norms:  # every layer's alike (the stack takes one epsilon, one activation)
            norm.eps = eps
        for mlp in mlps:
            mlp.act_name = act_name

    try:
        assign(settings[0] * 0.5, 0.25, other)
        fused, runs = decode(model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)
        plain, _ = decode(model, ids, padding, kvgen.DynamicCache(), 2, False, monkeypatch)
    finally:
        assign(*settings)
    assert runs == 2 and all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert not torch.equal(before[-1], fused[-1])
    again, _ = decode(model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)  # the settings put back
    assert all(torch.equal(a, b) for a, b in zip(before, again))


def test_the_plan_is_gathered_again_after_any_change_below_the_layers_and_only_then(model, monkeypatch):
    """Steps reuse the gathered plan until a module, parameter, buffer or hook below the layers changes, by any of
    the ways torch and users change them (the stack counts the changes of the dicts that hold them)."""
    stack, layers = model.decode_stack, model.model.layers
    gathered = []
    gather = stack._gather
    monkeypatch.setattr(stack, "_gather", lambda layers: gathered.append(1) or gather(layers))

    def steps_gather() -> int:
        gathered.clear()
        cache = kvgen.DynamicCache()
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]), past_key_values=cache)
            for token in (8, 9):
                model(torch.tensor([[token]]), past_key_values=cache)
        return len(gathered)

    steps_gather()
    assert steps_gather() == 0  # nothing changed: no step gathers
    norm, down, mlp = layers[1].post_attention_layernorm, layers[1].mlp.down_proj, layers[1].mlp
    weight, packed = norm.weight, down.packed_0
    changes = [
        lambda: setattr(norm, "weight", torch.nn.Parameter(weight.clone(), requires_grad=False)),
        lambda: setattr(norm, "weight", weight),
        lambda: down._buffers.__setitem__("packed_0", packed.clone()),
        lambda: down._buffers.update(packed_0=packed),
        lambda: down._buffers.setdefault("extra", None),
        lambda: down._buffers.pop("extra"),
        lambda: mlp._modules.update(down_proj=down),
        lambda: layers.__setitem__(1, layers[1]),
        lambda: model.model.layers[0].register_forward_pre_hook(lambda *a: None).remove(),
    ]
    for change in changes:
        change()
        assert steps_gather() == 1  # the step after the change gathers, the next ones reuse it
    assert norm.weight is weight and down.packed_0 is packed


def test_layer_hooks_still_run(model):
    seen = []
    handle = model.model.layers[0].register_forward_hook(lambda *a: seen.append(1))
    try:
        cache = kvgen.DynamicCache()
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]), past_key_values=cache)
            model(torch.tensor([[8]]), past_key_values=cache)
    finally:
        handle.remove()
    assert len(seen) == 2


def test_a_failed_step_gives_its_slots_back(model, monkeypatch):
    cache = kvgen.DynamicCache()
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), past_key_values=cache)

        def broken(*args):
            raise RuntimeError("broken")

        monkeypatch.setattr(torch.ops.kvgen, "decoder_layers", broken)
        with pytest.raises(RuntimeError, match="broken"):
            model(torch.tensor([[8]]), past_key_values=cache)
    assert cache.get_seq_length() == 3 and all(keys.shape[2] == 3 for keys, _ in cache)


def test_a_refused_reservation_leaves_the_cache_as_it_was(model):
    """A cache filled at batch 1 refuses a batch-2 step in its last layer: the layers before it give back what they
    had reserved, and the error is update()'s."""
    cache = kvgen.DynamicCache()
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), past_key_values=cache)
        last = cache.layers[-1]
        last._k, last._v = last._k.repeat(2, 1, 1, 1), last._v.repeat(2, 1, 1, 1)  # batch 2 in the last layer only
        with pytest.raises(ValueError, match="one cache per batch shape"):
            model(torch.tensor([[8]]), past_key_values=cache)
    assert cache.get_seq_length() == 3 and all(keys.shape[2] == 3 for keys, _ in cache)


# -- the cache seam ----------------------------------------------------------------------------------


def test_reserve_returns_what_update_returns_once_written():
    k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    new_k, new_v = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
    for make in (DynamicLayer, lambda: DynamicSlidingWindowLayer(4)):
        updated, reserved = make(), make()
        for layer in (updated, reserved):
            layer.update(k, v, torch.arange(5))
        expected = updated.update(new_k, new_v, torch.tensor([5]))
        keys, values, start, end, slots = reserved.reserve(new_k, new_v, 5)
        assert slots is None  # (the last T of start .. end - 1)
        keys, values = keys[:, :, start:end], values[:, :, start:end]
        keys[:, :, -1:] = new_k
        values[:, :, -1:] = new_v
        assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
        assert reserved.get_seq_length() == 6 and torch.equal(reserved.keys, updated.keys)


def test_a_cache_reserves_for_all_layers_or_none():
    k = torch.randn(1, 2, 3, 8)
    cache = Cache(layers=[DynamicLayer(), kvgen.SlidingWindowLayer(sliding_window=4, max_cache_len=8)])
    cache.update(k, k, 0, {"cache_position": torch.arange(3)})
    assert not cache.reserves()
    assert cache.reserve([k[:, :, :1]] * 2, [k[:, :, :1]] * 2, 3) is None  # a ring layer stores only through update
    assert cache.layers[0].get_seq_length() == 3  # and nothing was reserved
    static = Cache(layers=[StaticLayer(max_cache_len=4), StaticLayer(max_cache_len=8)])
    for i in range(2):
        static.update(k, k, i, {"cache_position": torch.arange(3)})
    assert static.reserves() and static.reserve([k] * 2, [k] * 2, 3) is None  # 6 slots do not fit the first layer
    assert [layer.get_seq_length() for layer in static.layers] == [3, 3]  # the second's reservation undone
    assert static.reserve([k[:, :, :1]] * 2, [k[:, :, :1]] * 2, 2) is None  # not where the new tokens go
    assert static.reserve([k[:, :, :1]] * 2, [k[:, :, :1]] * 2, 3) is not None and static.get_seq_length() == 4
    both = kvgen.DynamicCache()
    reserved = both.reserve([k] * 2, [k] * 2, 0)
    assert [(keys.shape[:2], keys.shape[3], end - start) for keys, _, start, end, _ in reserved] == [((1, 2), 8, 3)] * 2
    assert both.get_seq_length() == 3


def test_each_mask_group_is_asked_once_and_worked_out_again_when_the_cache_layers_change():
    stack = DecodeStack(layer_parts)
    asked = []

    def masks(i, window):
        asked.append(i)
        return f"mask of {i}", False

    cache = Cache(layers=[DynamicLayer() for _ in range(4)])
    assert stack._layer_masks(masks, cache, [None] * 4) == ["mask of 0"] * 4 and asked == [0]
    assert stack._layer_masks(masks, cache, [None, 3, None, 3]) == ["mask of 0", "mask of 1"] * 2
    cache.layers[2] = DynamicSlidingWindowLayer(5)  # another kind of layer: another group
    asked.clear()
    assert stack._layer_masks(masks, cache, [None] * 4) == ["mask of 0", "mask of 0", "mask of 2", "mask of 0"]
    assert sorted(asked) == [0, 2]
    assert stack._layer_masks(lambda i, window: (None, i == 2), cache, [None] * 4) is None  # causal: no fused step
    layer = weakref.ref(cache.layers[0])
    del cache
    gc.collect()
    assert layer() is None  # the stack keeps no cache alive


def test_a_replaced_plan_forgets_its_registered_weights(model, monkeypatch):
    """The weights registered for a stack are released in C++ once the stack gathers them anew."""
    ids = torch.tensor([[5, 6, 7]])
    padding = torch.ones_like(ids)
    decode(model, ids, padding, kvgen.DynamicCache(), 1, True, monkeypatch)
    old = model.decode_stack._plan.weights.id
    model.decode_stack._layers = None  # as if the layers had changed: gathered and registered again
    decode(model, ids, padding, kvgen.DynamicCache(), 1, True, monkeypatch)
    assert model.decode_stack._plan.weights.id != old
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no registered stack {old}"):
        torch.ops.kvgen.decoder_layers(torch.zeros(1, 1, 128), [], [], [], [], [], [], [], [], [], old)


def test_a_deep_copy_steps_with_its_own_weights(model, monkeypatch):
    """A copied model's stack reads the copy's tensors (not those its original registered): with one of the copy's
    weights changed, its fused steps still give its per-layer path's bits."""
    import copy

    ids = torch.tensor([[5, 6, 7]])
    padding = torch.ones_like(ids)
    decode(model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)  # the original registers its weights
    twin = copy.deepcopy(model)
    (_, data), = twin.model.layers[1].mlp.down_proj.weight.segments
    data.copy_(reversed_rows(twin.model.layers[1].mlp.down_proj.weight))
    fused, runs = decode(twin, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)
    plain, _ = decode(twin, ids, padding, kvgen.DynamicCache(), 2, False, monkeypatch)
    assert runs == 2 and all(torch.equal(a, b) for a, b in zip(fused, plain))


# -- float32 models: their own weights read in place as F32 rows ------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "gemma3"])
def float_model(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    folder = tmp_path_factory.mktemp(f"float-{request.param}")
    hf.save_pretrained(folder)
    return kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def test_a_float32_model_decodes_through_the_stack(float_model, monkeypatch):
    """A float32 model's decode steps run as one op over its own weights (no copy): the bits of the per-layer fused
    ops, and within float32 summation error of the modules' torch operations (the fused ops off)."""
    from kvgen.models import native

    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(4))  # (a prefill past STACK_ROWS)
    padding = torch.ones_like(ids)
    padding[1, :3] = 0

    def new_cache():
        return kvgen.DynamicCache(config=float_model.config)

    fused, runs = decode(float_model, ids, padding, new_cache(), 8, True, monkeypatch)
    per_layer, _ = decode(float_model, ids, padding, new_cache(), 8, False, monkeypatch)
    with monkeypatch.context() as m:
        for name in ("decoder_attention_inputs", "decoder_mlp"):
            m.setattr(native, name, lambda *args, **kwargs: None)
        modules, _ = decode(float_model, ids, padding, new_cache(), 8, False, monkeypatch)
    assert runs == 8 and all(torch.equal(a, b) for a, b in zip(fused, per_layer))
    # logits of a few units: float32 sums of 128-192 products in another order differ by ~1e-6 of them
    assert max((a - b).abs().max().item() for a, b in zip(fused, modules)) < 1e-4
    assert float_model.model.layers[0].mlp.down_proj.weight.data_ptr() in \
        {w.data_ptr() for w in float_model.model.layers[0].mlp.down_proj._segments}  # read in place


def test_a_float32_weight_changed_in_place_or_set_anew_is_read_by_the_next_step(float_model, monkeypatch):
    """The stack reads a float model's parameters where they are: an in-place change is in the next step, and
    ``param.data = ...`` (a new storage) is seen, the weights registered anew."""
    from kvgen.models.decode_blocks import eager_blocks

    ids = torch.tensor([[5, 6, 7]])
    padding = torch.ones_like(ids)
    with eager_blocks():  # the stack against the per-layer fused ops, both reading the weights as they are now
        before, _ = decode(float_model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)  # registers them
    down = float_model.model.layers[1].mlp.down_proj
    saved = down.weight.data
    for change in ("in place", "set anew"):
        try:
            if change == "in place":
                down.weight.data.mul_(-1)
            else:
                down.weight.data = torch.flip(saved, [0]).contiguous()
            with eager_blocks():
                fused, runs = decode(float_model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)
                plain, _ = decode(float_model, ids, padding, kvgen.DynamicCache(), 2, False, monkeypatch)
        finally:
            if change == "in place":
                down.weight.data.mul_(-1)
            else:
                down.weight.data = saved
        assert runs == 2 and all(torch.equal(a, b) for a, b in zip(fused, plain)), change
        assert not torch.equal(before[-1], fused[-1]), change
    with eager_blocks():
        again, _ = decode(float_model, ids, padding, kvgen.DynamicCache(), 2, True, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(before, again))


def test_a_fused_float32_model_compiles_no_block(float_model):
    """Where the fused C++ ops compute a float32 model's layers, its decode blocks (a short prefill, the head) run
    eagerly, as under eager_blocks(), and generate()'s static-cache steps run the stack op rather than a compiled
    forward: compiling added only tracing (SmolLM2 in float32, a fresh process's first 30 tokens: 17.3 s with a cold
    compile cache, 0.84 s now; generate()'s static steps on the Xeon 39.9-40.4 tok/s against 27.1-27.8 compiled)."""
    from torch._dynamo.utils import counters

    from kvgen.models.decode_blocks import eager_blocks

    assert float_model.runs_fused() and all(layer.runs_fused() for layer in float_model.model.layers)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(6))

    def static_steps():
        cache = kvgen.StaticCache(config=float_model.config, max_cache_len=16)
        with torch.no_grad():
            logits = [float_model(ids, past_key_values=cache).logits[:, -1]]
            for t in range(5, 9):
                logits.append(float_model(logits[-1].argmax(-1, keepdim=True), past_key_values=cache,
                                          cache_position=torch.tensor([t])).logits[:, -1])
        return torch.stack(logits)

    def generated():
        return [float_model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation=kind)
                for kind in (None, "static")]

    torch._dynamo.reset()
    counters.clear()
    got = generated(), static_steps()
    assert counters["stats"]["unique_graphs"] == 0 and getattr(float_model, "_compiled_forward", None) is None
    with eager_blocks():
        assert all(torch.equal(a, b) for a, b in zip(got[0], generated()))
        assert torch.equal(got[1], static_steps())
