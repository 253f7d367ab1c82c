"""Offloaded caches: the prefetch/evict schedule, identical outputs, host-side operations, the OOM fallback.

No GPU here, so the schedule is checked with :class:`RecordingPlacement`: a fake placement
with two "devices" on the CPU whose side-stream copies are *asynchronous*: a copy lands
only when an event recorded after it is waited for, and until then its destination holds
garbage (NaN). A missing wait, a prefetch that reads an eviction still in flight, or a
host read of a tensor being copied shows up as NaN logits or a wrong schedule.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import kvgen
from kvgen import (DynamicCache, OffloadedCache, OffloadedStaticCache, QuantizedCache, StaticCache,
                   enable_offloading)
from kvgen.cache import create_cache
from kvgen.cache.dynamic import DynamicSlidingWindowLayer
from kvgen.cache.offload import OffloadedLayer, Offloader, Placement
from kvgen.config import PretrainedConfig
from kvgen.models.decode_blocks import eager_blocks

N_LAYERS = 4
CONFIG = PretrainedConfig(model_type="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=N_LAYERS, vocab_size=64, intermediate_size=64,
                          max_position_embeddings=256)
MIXED = PretrainedConfig(model_type="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=6, vocab_size=64, intermediate_size=64, sliding_window=5,
                         layer_types=["sliding_attention", "full_attention"] * 3)
FIXED = dict(eos_token_id=None, pad_token_id=0)


@pytest.fixture(autouse=True)
def _eager():
    with eager_blocks():  # compiled CPU blocks would only add compile time here
        yield


def make_model(config=CONFIG):
    torch.manual_seed(0)
    return kvgen.LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def model():
    return make_model()


def prompt(batch=2, length=6, seed=1):
    return torch.randint(1, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


# -- the fake placement -----------------------------------------------------------------------------------

class _Copy:
    def __init__(self, out, src):
        self.out, self.src, self.done = out, src, False

    def land(self):
        if not self.done:
            self.out.copy_(self.src)
            self.done = True


class RecordingPlacement(Placement):
    """Two devices on the CPU ("compute", "offload") with asynchronous side-stream copies.

    A copy issued on a side stream lands when an event recorded after it is waited for;
    copies on the compute stream land at once (stream order). Every tensor it makes is
    kept, so ids identify them; tensors it did not make were made by layers on the
    compute device.
    """

    moves = True

    def __init__(self):
        super().__init__("cpu", "cpu")
        self.location: dict[int, str] = {}
        self.made: list[torch.Tensor] = []
        self.pending: dict[int, _Copy] = {}
        self.issued: dict[str, list[_Copy]] = {"compute": [], "prefetch": [], "evict": []}
        self.stream = "compute"
        self.log: list[tuple] = []

    def bind(self, device):
        pass

    def _copy(self, t, where):
        out = torch.empty_like(t)
        out.fill_(float("nan") if out.is_floating_point() else torch.iinfo(out.dtype).max)  # garbage until it lands
        self.location[id(out)] = where
        self.made.append(out)
        self.log.append(("copy", self.stream, where))
        c = _Copy(out, t)
        if self.stream == "compute":
            c.land()
        else:
            self.issued[self.stream].append(c)
            self.pending[id(out)] = c
        return out

    def to_compute(self, t):
        return self._copy(t, "compute")

    def to_offload(self, t):
        return self._copy(t, "offload")

    @contextlib.contextmanager
    def side_stream(self, purpose):
        previous, self.stream = self.stream, purpose
        try:
            yield
        finally:
            self.stream = previous

    def record_event(self):
        self.log.append(("record", self.stream))
        return [c for c in self.issued[self.stream] if not c.done]

    def wait_event(self, event):
        self.log.append(("wait", self.stream))
        for c in event or ():
            c.land()
            self.pending.pop(id(c.out), None)

    def synchronize(self, event):
        self.log.append(("synchronize", self.stream))
        self.wait_event(event)

    def hold(self, t):
        self.log.append(("hold", self.stream))
        return t

    # -- what the tests read --------------------------------------------------------------------------
    def where(self, layer) -> str:
        """``compute``/``offload`` (+ ``*`` while a copy to it is in flight), or ``empty``, for a wrapped layer."""
        tensors = []
        getattr(layer, "inner", layer).map_tensors(lambda t: tensors.append(t) or t)  # inner layer: no settling
        if not tensors:
            return "empty"
        places = {self.location.get(id(t), "compute") for t in tensors}
        assert len(places) == 1, f"a layer split across devices: {places}"
        in_flight = any(id(t) in self.pending for t in tensors)
        return places.pop() + ("*" if in_flight else "")


def offloaded(cache, placement=None):
    placement = placement or RecordingPlacement()
    return enable_offloading(cache, placement=placement), placement


def run_steps(model, cache, ids, steps=3):
    """Prefill ``ids``, then feed ``steps`` greedy tokens one at a time; the logits of every forward."""
    out = model(ids, past_key_values=cache, use_cache=True)
    logits = [out.logits]
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(nxt, past_key_values=cache, use_cache=True)
        logits.append(out.logits)
    return logits


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert not g.isnan().any(), "NaN logits: a tensor was used before its copy landed"
        assert torch.equal(g, w)


# -- the schedule ------------------------------------------------------------------------------------

def record_schedule(cache, placement):
    """Wrap each inner layer's ``update``: record where every layer is when layer ``i`` is computed."""
    steps = []
    for i, layer in enumerate(cache.layers):
        original = layer.inner.update

        def update(*args, _i=i, _original=original, **kwargs):
            steps.append((_i, [placement.where(x) for x in cache.layers]))
            return _original(*args, **kwargs)

        layer.inner.update = update
    return steps


@pytest.mark.parametrize("make", [lambda: DynamicCache(config=CONFIG), lambda: DynamicCache(),
                                  lambda: StaticCache(config=CONFIG, max_batch_size=2, max_cache_len=32,
                                                      dtype=torch.float32)],
                         ids=["dynamic", "dynamic-lazy-layers", "static"])
def test_schedule_current_resident_next_prefetching_previous_evicted(model, make):
    cache, placement = offloaded(make())
    plain = make()
    forward_both(model, cache, plain, prompt(length=7))  # the prefill (creates the layers of a lazy cache)
    steps = record_schedule(cache, placement)
    for seed in range(3):
        forward_both(model, cache, plain, prompt(length=1, seed=seed))
    n = N_LAYERS
    assert [i for i, _ in steps] == list(range(n)) * 3
    for step, (i, where) in enumerate(steps):
        assert where[i] == "compute", (step, where)  # landed: the compute stream waited for its prefetch
        assert where[(i + 1) % n] == "compute*", (step, where)  # being prefetched (the last layer: layer 0)
        assert where[(i - 1) % n] == "offload*", (step, where)  # its eviction just issued
        others = [where[j] for j in range(n) if j not in (i, (i + 1) % n, (i - 1) % n)]
        assert all(w.startswith("offload") for w in others), (step, where)
    # between forward passes: the last layer is resident, layer 0 prefetched for the next pass
    assert [placement.where(x) for x in cache.layers] == ["compute*", "offload*", "offload*", "compute"]
    # tensors are held by the stream that uses them (no memory reuse before a copy is done)
    assert ("hold", "evict") in placement.log and ("hold", "compute") in placement.log


def test_only_non_sliding_keeps_sliding_layers_on_the_device():
    built = DynamicCache(config=MIXED, offloading=True, offload_only_non_sliding=True)
    kinds = ["offloaded" if isinstance(x, OffloadedLayer) else type(x).__name__ for x in built.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "offloaded"] * 3
    cache, placement = DynamicCache(config=MIXED), RecordingPlacement()
    enable_offloading(cache, only_non_sliding=True, placement=placement)
    everything, _ = offloaded(DynamicCache(config=MIXED))  # the default: sliding layers offloaded too
    assert all(isinstance(x, OffloadedLayer) for x in everything.layers)
    model = make_model(MIXED)
    want = run_steps(model, DynamicCache(config=MIXED), prompt(length=9), steps=6)
    assert_same(run_steps(model, cache, prompt(length=9), steps=6), want)
    assert_same(run_steps(model, everything, prompt(length=9), steps=6), want)
    # the schedule runs over the offloaded layers only: after a pass, 5 is resident, 1 prefetched, 3 evicted
    assert [placement.where(cache.layers[i]) for i in (1, 3, 5)] == ["compute*", "offload*", "compute"]
    assert placement.where(cache.layers[0]) == "compute"  # sliding layers never move


# -- outputs equal the plain caches' ----------------------------------------------------------------------

CACHES = {
    "dynamic": lambda: DynamicCache(config=CONFIG),
    "static": lambda: StaticCache(config=CONFIG, max_batch_size=2, max_cache_len=40, dtype=torch.float32),
    "static-lazy": lambda: StaticCache(config=CONFIG, max_cache_len=40),
    "quantized": lambda: QuantizedCache(backend="kivi", nbits=4, q_group_size=4, residual_length=4, config=CONFIG),
}


@pytest.mark.parametrize("name", sorted(CACHES))
def test_recorded_offloading_gives_identical_logits_and_greedy_ids(model, name):
    cache, placement = offloaded(CACHES[name]())
    assert_same(run_steps(model, cache, prompt(), steps=12), run_steps(model, CACHES[name](), prompt(), steps=12))
    assert sum(1 for entry in placement.log if entry[:3] == ("copy", "prefetch", "compute")) > 0
    cache, _ = offloaded(CACHES[name]())
    kwargs = dict(max_new_tokens=10, disable_compile=True, return_dict_in_generate=True, output_logits=True, **FIXED)
    got = model.generate(prompt(), past_key_values=cache, **kwargs)
    want = model.generate(prompt(), past_key_values=CACHES[name](), **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits, strict=True))


def test_quantized_codes_scales_and_residual_are_offloaded(model):
    cache, placement = offloaded(CACHES["quantized"]())
    run_steps(model, cache, prompt(length=10), steps=4)
    layer = cache.layers[1].inner
    assert layer.quantized_length > 0 and layer.residual_length_now > 0
    for store in (layer._kq, layer._vq):
        for t in (store.codes, store.scale, store.zero):
            assert placement.location.get(id(t)) == "offload"
    assert placement.location.get(id(layer._rk)) == "offload" == placement.location.get(id(layer._rv))
    # the shared dequantization workspace stays where it is computed
    assert all(id(b) not in placement.location for b in layer.workspace._buffers.values())


def test_quantized_and_offloaded_compose_on_cpu(model):
    settings = dict(backend="kivi", nbits=2, q_group_size=4, residual_length=4)
    cache = QuantizedCache(**settings, offloading=True)
    assert cache.layers == [] and isinstance(cache.layer(0), OffloadedLayer)  # layers made on first use
    with_config = QuantizedCache(config=MIXED, **settings, offloading=True, offload_only_non_sliding=True)
    assert [isinstance(x, OffloadedLayer) for x in with_config.layers] == [False, True] * 3
    kwargs = dict(max_new_tokens=16, disable_compile=True, **FIXED)
    want = model.generate(prompt(), past_key_values=QuantizedCache(**settings), **kwargs)
    assert torch.equal(model.generate(prompt(), past_key_values=QuantizedCache(**settings, offloading=True),
                                      **kwargs), want)
    assert torch.equal(model.generate(prompt(), past_key_values=enable_offloading(QuantizedCache(**settings)),
                                      **kwargs), want)


@pytest.mark.parametrize("offloaded_name, plain_name", [("offloaded", "dynamic"), ("offloaded_static", "static")])
def test_cache_implementation_names_on_cpu(model, offloaded_name, plain_name):
    kwargs = dict(max_new_tokens=8, disable_compile=True, return_dict_in_generate=True, output_logits=True, **FIXED)
    got = model.generate(prompt(), cache_implementation=offloaded_name, **kwargs)
    want = model.generate(prompt(), cache_implementation=plain_name, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits, strict=True))
    assert all(isinstance(layer, OffloadedLayer) for layer in got.past_key_values.layers)
    assert got.past_key_values.offloader.placement.moves is False  # compute device == offload device: no copies


def test_every_spelling_builds_an_offloaded_cache(model):
    spellings = {
        "OffloadedCache()": OffloadedCache(),
        "OffloadedCache(config)": OffloadedCache(config=CONFIG),
        "DynamicCache(offloading=True)": DynamicCache(config=CONFIG, offloading=True),
        "OffloadedStaticCache": OffloadedStaticCache(config=CONFIG, max_batch_size=2, max_cache_len=32,
                                                     device="cpu", dtype=torch.float32),
        "StaticCache(offloading=True)": StaticCache(config=CONFIG, max_batch_size=2, max_cache_len=32,
                                                    dtype=torch.float32, offloading=True),
        "create_cache": create_cache("offloaded_static", config=CONFIG, batch_size=2, max_cache_len=32,
                                     device=torch.device("cpu"), dtype=torch.float32),
    }
    want = model.generate(prompt(), max_new_tokens=6, disable_compile=True, **FIXED)
    for name, cache in spellings.items():
        got = model.generate(prompt(), past_key_values=cache, max_new_tokens=6, disable_compile=True, **FIXED)
        assert torch.equal(got, want), name
        assert cache.layers and all(isinstance(x, OffloadedLayer) for x in cache.layers), name
        assert not cache.is_compileable  # decode runs eagerly (host-side stream choreography)


def test_offloaded_static_preallocates_on_the_offload_device():
    cache = OffloadedStaticCache(config=CONFIG, max_batch_size=1, max_cache_len=16, device="cpu",
                                 dtype=torch.float16, offload_device="cpu")
    layer = cache.layers[0].inner
    assert layer._k.device.type == "cpu" and layer._k.dtype == torch.float16 and layer._k.shape[2] == 16
    assert cache.get_max_cache_shape() == 16 and cache.get_seq_length() == 0
    with pytest.raises(ValueError, match="layer_device_map"):
        OffloadedStaticCache(config=CONFIG, max_cache_len=16, layer_device_map={0: "cuda:0", 1: "cuda:1"})


def test_real_placement_on_cpu_moves_nothing(model):
    placement = Placement()
    cache = enable_offloading(DynamicCache(), placement=placement)
    model(prompt(), past_key_values=cache)
    layer = cache.layers[0].inner
    before = layer._k
    model(prompt(length=1), past_key_values=cache)
    assert placement.compute_device == torch.device("cpu") and not placement.moves
    assert cache.layers[0].inner._k is before  # never copied
    assert Placement("cpu", "cpu").record_event() is None


# -- host-side operations ----------------------------------------------------------------------------

def pair(make=lambda: DynamicCache(config=CONFIG)):
    cache, placement = offloaded(make())
    return cache, make(), placement


def forward_both(model, a, b, ids):
    got, want = model(ids, past_key_values=a).logits, model(ids, past_key_values=b).logits
    assert not got.isnan().any() and torch.equal(got, want)


@pytest.mark.parametrize("make", [lambda: DynamicCache(config=CONFIG), CACHES["static"], CACHES["quantized"]],
                         ids=["dynamic", "static", "quantized"])
def test_host_side_operations_follow_the_plain_cache(model, make):
    cache, plain, placement = pair(make)
    forward_both(model, cache, plain, prompt(length=9))
    forward_both(model, cache, plain, prompt(length=1, seed=3))
    assert cache.nbytes() == plain.nbytes() > 0  # every byte counted, wherever it lies
    assert cache.get_seq_length() == plain.get_seq_length() == 10
    for (k, v), (pk, pv) in zip(cache.to_legacy_cache(), plain.to_legacy_cache(), strict=True):
        assert torch.equal(k, pk) and torch.equal(v, pv)  # host reads wait for copies in flight
        assert placement.location.get(id(k), "compute") == "compute"  # on the model's device, as without offloading

    for beams in ((1, 0), torch.tensor([0, 0])):  # two reorders in a row compose: rows [1, 1]
        cache.reorder_cache(beams)
        plain.reorder_cache(beams)
    assert cache.layers[1]._rows is not None  # deferred for an offloaded layer: done after its next prefetch
    with pytest.raises(IndexError, match="holds 2 rows"):  # checked against the deferred rows
        cache.reorder_cache([0, 2])
    forward_both(model, cache, plain, prompt(length=1, seed=4))

    cache.crop(8)
    plain.crop(8)
    forward_both(model, cache, plain, prompt(length=2, seed=5))

    cache.batch_repeat_interleave(2)
    plain.batch_repeat_interleave(2)
    forward_both(model, cache, plain, prompt(batch=4, length=1, seed=6))
    cache.batch_select_indices([3, 0])
    plain.batch_select_indices(torch.tensor([3, 0]))
    forward_both(model, cache, plain, prompt(length=1, seed=7))
    assert cache.nbytes() == plain.nbytes()

    twin = copy.deepcopy(cache)
    assert twin.offloader is not cache.offloader and twin.layers[0].offloader is twin.offloader
    assert twin.offloader.layers == twin.layers
    ids = prompt(length=1, seed=8)
    want = model(ids, past_key_values=copy.deepcopy(plain)).logits
    assert torch.equal(model(ids, past_key_values=twin).logits, want)
    assert torch.equal(model(ids, past_key_values=cache).logits, want)  # the original did not move on

    cache.reset()
    plain.reset()
    assert cache.get_seq_length() == 0
    forward_both(model, cache, plain, prompt(length=5, seed=9))


def test_from_legacy_cache_and_layers_added_later(model):
    plain = DynamicCache()
    model(prompt(), past_key_values=plain)
    cache = OffloadedCache.from_legacy_cache(plain.to_legacy_cache())
    assert all(isinstance(x, OffloadedLayer) for x in cache.layers) and len(cache.layers) == N_LAYERS
    forward_both(model, cache, plain, prompt(length=1, seed=2))
    lazy = OffloadedCache()
    lazy.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 2)  # layers 0..2 created on demand
    assert [x._slot for x in lazy.layers] == [0, 1, 2]


def test_clear_errors():
    cache = DynamicCache(config=CONFIG, offloading=True)
    with pytest.raises(ValueError, match="offloaded already"):
        enable_offloading(cache, placement=RecordingPlacement())
    assert enable_offloading(cache) is cache  # calling again without a new placement is fine
    with pytest.raises(ValueError, match="offloaded already"):
        OffloadedLayer(cache.layers[0], Offloader(Placement()))
    with pytest.raises(ValueError, match="needs the model's config"):
        OffloadedStaticCache(max_cache_len=8)


def test_wrapper_passes_the_inner_layers_attributes():
    layer = OffloadedLayer(DynamicSlidingWindowLayer(4), Offloader(Placement()))
    assert layer.sliding_window == 4 and layer.get_max_cache_shape() == 4 and not layer.needs_rotary
    assert layer._seen == 0 and callable(layer.from_tensors)  # the inner layer's own names
    assert repr(layer) == "OffloadedLayer(DynamicSlidingWindowLayer, offloaded)"
    with pytest.raises(AttributeError):
        layer.no_such_attribute


# -- the seeds' out-of-memory fallback ------------------------------------------------------------------

# transformers 4 docs (seed 000), as written there
def resilient_generate(model, *args, **kwargs):
    oom = False
    try:
        return model.generate(*args, **kwargs)
    except torch.cuda.OutOfMemoryError as e:
        print(e)
        print("retrying with cache_implementation='offloaded'")
        oom = True
    if oom:
        torch.cuda.empty_cache()
        kwargs["cache_implementation"] = "offloaded"
        return model.generate(*args, **kwargs)


# transformers 5 docs (seed 004), as written there (import: from kvgen import infer_device)
def resilient_generate_v5(model, *args, **kwargs):
    from kvgen import infer_device

    oom = False
    device = infer_device()
    torch_device_module = getattr(torch, device, torch.cuda)
    try:
        return model.generate(*args, **kwargs)
    except torch.OutOfMemoryError as e:
        print(e)
        print("retrying with cache_implementation='offloaded'")
        oom = True
    if oom:
        torch_device_module.empty_cache()
        kwargs["cache_implementation"] = "offloaded"
        return model.generate(*args, **kwargs)


@pytest.fixture
def plain_caches_run_out_of_memory(monkeypatch):
    """Make every cache that is not offloaded raise CUDA's out-of-memory error, as on a small GPU."""
    original = kvgen.Cache.update
    calls = {"oom": 0}

    def update(self, *args, **kwargs):
        if getattr(self, "offloader", None) is None:
            calls["oom"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.83 GiB. GPU")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(kvgen.Cache, "update", update)
    return calls


@pytest.mark.parametrize("fallback", [resilient_generate, resilient_generate_v5], ids=["seed-000", "seed-004"])
def test_resilient_generate_retries_with_the_offloaded_cache(model, fallback, plain_caches_run_out_of_memory,
                                                             capsys, monkeypatch):
    inputs = {"input_ids": prompt(), "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    want = model.generate(**inputs, max_new_tokens=8, cache_implementation="offloaded", **FIXED)
    assert plain_caches_run_out_of_memory["oom"] == 0
    if kvgen.infer_device() == "cpu":  # seed 004 calls torch.cpu.empty_cache(), which torch lacks (so does HF)
        monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)
    out = fallback(model, **inputs, max_new_tokens=8, do_sample=False, **FIXED)
    assert plain_caches_run_out_of_memory["oom"] == 1
    assert capsys.readouterr().out.splitlines() == ["CUDA out of memory. Tried to allocate 4.83 GiB. GPU",
                                                    "retrying with cache_implementation='offloaded'"]
    assert torch.equal(out, want)
    with eager_blocks():
        plain = model.generate(**inputs, max_new_tokens=8, use_cache=False, **FIXED)
    assert torch.equal(out, plain)


def test_infer_device_names_a_torch_device():
    device = kvgen.infer_device()
    assert torch.device(device).type == device


# -- on a real GPU (skipped without one) ----------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offloaded_name, plain_name", [("offloaded", "dynamic"), ("offloaded_static", "static")])
def test_cuda_keeps_two_layers_on_the_gpu_in_pinned_memory_otherwise(offloaded_name, plain_name):
    device = torch.device("cuda")
    model = make_model().to(device)
    model.init_buffers(device)
    ids = prompt().to(device)
    cache = create_cache(offloaded_name, config=CONFIG, batch_size=2, max_cache_len=40, device=device,
                         dtype=torch.float32)
    on_gpu = []
    for layer in cache.layers:
        original = layer.inner.update

        def update(*args, _original=original, **kwargs):
            on_gpu.append(sum(1 for x in cache.layers if _on(x, "cuda")))
            return _original(*args, **kwargs)

        layer.inner.update = update
    kwargs = dict(max_new_tokens=12, disable_compile=True, return_dict_in_generate=True, output_logits=True, **FIXED)
    got = model.generate(ids, past_key_values=cache, **kwargs)
    want = model.generate(ids, cache_implementation=plain_name, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits, strict=True))
    assert max(on_gpu) <= 2  # the layer being computed and the one being prefetched
    layer = cache.layers[1].inner  # offloaded after the last step
    assert layer._k.device.type == "cpu" and layer._k.is_pinned()


def _on(layer, device_type):
    devices = set()
    layer.inner.map_tensors(lambda t: devices.add(t.device.type) or t)
    return device_type in devices
