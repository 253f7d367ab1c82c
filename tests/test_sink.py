"""SinkCache / StaticSinkCache (StreamingLLM attention sinks).

* unit tests on synthetic tensors: which tokens are kept, which positions the mask sees,
  and the sinks' re-rotation against rotating the raw key at its new position;
* the differential test: streaming through the cache gives the logits of a fresh forward
  pass over [sink tokens + last window] at in-cache positions ``0 .. n-1``, for default,
  linear and llama3-scaled RoPE and for phi3's partial rotary;
* generate() with ``past_key_values=SinkCache(...)`` and ``cache_implementation="sink"``
  past the window, the compiled static variant, the seeds' iterative-prompts example with
  its input cropping on the real default model, and the errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kvgen
from kvgen import AutoModelForCausalLM, SinkCache, SinkLayer, StaticSinkCache
from kvgen.config import PretrainedConfig
from kvgen.masks import attention_mask
from kvgen.rope import RotaryEmbedding, apply_rotary

ATOL = 1e-4
ROPES = {
    "default": ("llama", {}),
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama3": ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                             "rope_theta": 500000.0}}),
    "phi3-partial": ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5}}),
}


@pytest.fixture(autouse=True)
def eager_blocks(monkeypatch):
    """Decode blocks run eagerly (fast tests); the compiled tests turn compilation back on."""
    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")


def tiny_config(rope="default", **extra):
    model_type, rope_extra = ROPES[rope]
    base = dict(model_type=model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None,
                pad_token_id=None)  # no EOS, no padding: generated ids are never taken for padding
    return PretrainedConfig(**{**base, **rope_extra, **extra})


def tiny_model(rope="default", **extra):
    """A random model with weights large enough for peaked attention (so that position errors show)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(rope, **extra))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.eval()


def rotary(rope="default"):
    return RotaryEmbedding(tiny_config(rope))


def rotated_keys(rope_emb, raw, positions):
    """``raw`` (B, H, T, D) rotated at ``positions`` (T,), as a model does."""
    cos, sin = rope_emb(positions[None])
    return apply_rotary(raw, cos, sin)


def expected_window(s, r, first, last, concat):
    """Positions that the update for ``first..last`` attends to: sinks, then the window."""
    sinks = list(range(min(s, last + 1)))
    start = max(first, s) if concat else max(s, last - r + 1)
    return sinks + list(range(start, last + 1))


# -- unit tests on synthetic tensors ------------------------------------------------------------------

CHUNKS = [3, 1, 1, 2, 4, 1, 1, 1, 6, 1, 13, 1, 2, 1]  # 13 > ring: attends to sinks + the chunk


@pytest.mark.parametrize("sinks", [0, 3])
def test_eviction_keeps_sinks_and_last_window(sinks):
    """Every update returns sinks + the newest tokens; key_positions (asked first) labels each slot right."""
    w = 8
    r = w - sinks
    layer, rope = SinkLayer(window_length=w, num_sink_tokens=sinks), rotary()
    total = sum(CHUNKS)
    values = torch.arange(total, dtype=torch.float32).view(1, 1, total, 1).expand(1, 2, total, 16)  # value = position
    keys = torch.randn(1, 2, total, 16)
    start = 0
    for t in CHUNKS:
        pos = torch.arange(start, start + t)
        layer.check_cache_position(pos)
        labels = layer.key_positions(pos)
        _, v = layer.update(keys[:, :, pos], values[:, :, pos], pos, rotary_emb=rope)
        held = v[0, 0, :, 0].long()
        valid = labels >= 0
        assert torch.equal(held[valid], labels[valid]), f"chunk at {start}"
        concat = t - max(0, min(sinks - start, t)) > r
        assert sorted(labels[valid].tolist()) == expected_window(sinks, r, start, start + t - 1, concat)
        start += t
        # what stays: sinks and the last window - sinks tokens, oldest first
        assert layer.values[0, 0, :, 0].long().tolist() == list(range(min(sinks, start))) + \
            list(range(max(sinks, start - r), start))
        assert layer.get_seq_length() == start
    assert layer.keys.shape[2] == w


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rerotation_equals_rotating_the_raw_key_at_its_new_position(rope):
    """Sink slots hold the raw sink key rotated at (sink index + offset); window keys stay as the model rotated them."""
    w, s = 10, 4
    layer, emb = SinkLayer(window_length=w, num_sink_tokens=s), rotary(rope)
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(2, 2, 40, 16, generator=g)
    positions = torch.arange(40)
    model_keys = rotated_keys(emb, raw, positions)  # what the model hands to the cache
    layer.update(model_keys[:, :, :7], model_keys[:, :, :7], positions[:7], rotary_emb=emb)
    for p in range(7, 40):
        keys, _ = layer.update(model_keys[:, :, p:p + 1], model_keys[:, :, p:p + 1], positions[p:p + 1],
                               rotary_emb=emb)
        offset = max(0, p + 1 - w)  # evicted tokens between the sinks and the window
        want_sinks = rotated_keys(emb, raw[:, :, :s], torch.arange(s) + offset)
        torch.testing.assert_close(keys[:, :, :s], want_sinks, atol=2e-5, rtol=0, msg=f"position {p}")
        labels = layer.key_positions(torch.tensor([p]))
        for slot in range(s, keys.shape[2]):
            torch.testing.assert_close(keys[:, :, slot], model_keys[:, :, labels[slot]], atol=0, rtol=0)
    if rope == "phi3-partial":  # channels past rotary_dim are never touched
        assert emb.rotary_dim == 8
        torch.testing.assert_close(layer.keys[:, :, :s, 8:], raw[:, :, :s, 8:], atol=0, rtol=0)


def test_attention_through_the_layer_equals_attention_at_in_cache_positions():
    """Scores of a query at absolute position p equal those at in-cache positions (RoPE is relative)."""
    w, s = 8, 2
    emb, layer = rotary(), SinkLayer(window_length=w, num_sink_tokens=s)
    g = torch.Generator().manual_seed(1)
    raw_q, raw_k, v = (torch.randn(1, 2, 30, 16, generator=g) * 3 for _ in range(3))
    pos = torch.arange(30)
    q, k = rotated_keys(emb, raw_q, pos), rotated_keys(emb, raw_k, pos)
    for p in range(30):
        mask, _ = attention_mask(pos[p:p + 1], layer.key_positions(pos[p:p + 1]))
        keys, values = layer.update(k[:, :, p:p + 1], v[:, :, p:p + 1], pos[p:p + 1], rotary_emb=emb)
        out = F.scaled_dot_product_attention(q[:, :, p:p + 1], keys, values, attn_mask=mask)
        kept = expected_window(s, w - s, p, p, False)
        n = len(kept)
        in_cache = torch.arange(n)
        ref = F.scaled_dot_product_attention(rotated_keys(emb, raw_q[:, :, p:p + 1], in_cache[-1:]),
                                             rotated_keys(emb, raw_k[:, :, kept], in_cache), v[:, :, kept])
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=f"position {p}")


def test_crop_reset_and_batch_editing():
    w, s = 6, 2
    emb = rotary()
    layer = SinkLayer(window_length=w, num_sink_tokens=s)
    vals = torch.arange(20, dtype=torch.float32).view(1, 1, 20, 1).repeat(3, 1, 1, 16)
    vals[1] += 100
    vals[2] += 200
    layer.update(vals[:, :, :5], vals[:, :, :5], torch.arange(5), rotary_emb=emb)
    layer.crop(3)  # nothing evicted yet: an exact crop
    assert layer.get_seq_length() == 3 and layer.values[0, 0, :, 0].tolist() == [0, 1, 2]
    for p in range(3, 12):
        layer.update(vals[:, :, p:p + 1], vals[:, :, p:p + 1], torch.tensor([p]), rotary_emb=emb)
    assert layer.values[0, 0, :, 0].tolist() == [0, 1, 8, 9, 10, 11]
    layer.crop(10)  # evicted tokens do not come back: the window keeps 8, 9 and refills
    assert layer.values[0, 0, :, 0].tolist() == [0, 1, 8, 9]
    layer.update(vals[:, :, 10:12], vals[:, :, 10:12], torch.arange(10, 12), rotary_emb=emb)
    assert layer.values[0, 0, :, 0].tolist() == [0, 1, 8, 9, 10, 11]
    layer.crop(1)
    assert layer.values[0, 0, :, 0].tolist() == [0]
    layer.update(vals[:, :, 1:4], vals[:, :, 1:4], torch.arange(1, 4), rotary_emb=emb)
    assert layer.values[0, 0, :, 0].tolist() == [0, 1, 2, 3]

    copied = copy.deepcopy(layer)
    layer.batch_select_indices(torch.tensor([2, 0, 0]))
    assert layer.values[:, 0, 0, 0].tolist() == [200, 0, 0]
    assert copied.values[:, 0, 0, 0].tolist() == [0, 100, 200]
    copied.batch_repeat_interleave(2)
    assert copied.values[:, 0, 0, 0].tolist() == [0, 0, 100, 100, 200, 200]
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.keys.shape[2] == 0


def test_layer_compiles_fullgraph_once_for_every_decode_step(monkeypatch):
    """Static shapes and tensor bookkeeping: one graph for every step, through the wrap and the re-rotation."""
    monkeypatch.delenv("KVGEN_DISABLE_COMPILE")
    w, s = 6, 2
    emb = rotary()
    eager_layer, layer = SinkLayer(window_length=w, num_sink_tokens=s), SinkLayer(window_length=w, num_sink_tokens=s)

    def step(lay, q, k, v, pos):
        mask, _ = attention_mask(pos, lay.key_positions(pos), None, None, static=torch.compiler.is_compiling())
        keys, values = lay.update(k, v, pos, rotary_emb=emb)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    for lay in (eager_layer, layer):
        step(lay, q[:, :, :3], k[:, :, :3], v[:, :, :3], torch.arange(3))  # eager prefill
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(3, 20):
            sl = slice(t, t + 1)
            args = (q[:, :, sl].clone(), k[:, :, sl].clone(), v[:, :, sl].clone(), torch.tensor([t]))
            torch.testing.assert_close(compiled(layer, *args), step(eager_layer, *args), atol=1e-5, rtol=0,
                                       msg=f"position {t}")
    torch.testing.assert_close(layer.keys, eager_layer.keys, atol=1e-6, rtol=0)


# -- the differential test ------------------------------------------------------------------------------

STREAM = [7, 1, 1, 1, 1, 3, 1, 1, 4, 1, 1, 1, 2, 1, 1, 15, 1, 1, 1, 5, 1, 1]  # 15 > window - sinks


@pytest.mark.parametrize("cache_cls", [SinkCache, StaticSinkCache])
@pytest.mark.parametrize("rope", sorted(ROPES))
@torch.no_grad()
def test_streaming_equals_a_fresh_forward_over_sinks_and_window(rope, cache_cls):
    """One layer: a token's keys and values depend on the token alone, so streaming through the cache
    must give exactly the logits of a fresh forward over the tokens kept, at positions 0 .. n-1.

    (With more layers a kept token's deeper keys also carry what it saw before the eviction;
    the next test covers that case.)
    """
    w, s = 12, 3
    model = tiny_model(rope, num_hidden_layers=1)
    ids = torch.randint(3, 128, (2, sum(STREAM)), generator=torch.Generator().manual_seed(0))
    if cache_cls is SinkCache:
        cache = SinkCache(window_length=w, num_sink_tokens=s)
    else:
        cache = StaticSinkCache(config=model.config, window_length=w, num_sink_tokens=s)
    start = evicted = 0
    for t in STREAM:
        out = model(ids[:, start:start + t], past_key_values=cache, use_cache=True)
        concat = t - max(0, min(s - start, t)) > w - s
        kept = expected_window(s, w - s, start, start + t - 1, concat)
        fresh = model(ids[:, kept], use_cache=False).logits  # positions 0 .. len(kept) - 1
        torch.testing.assert_close(out.logits, fresh[:, -t:], atol=ATOL, rtol=0,
                                   msg=f"{rope}: chunk of {t} at position {start}")
        evicted = max(evicted, kept[-1] + 1 - len(kept))
        start += t
    assert evicted > 20  # the stream went far past the window
    assert cache.get_seq_length() == start and cache.layers[0].keys.shape[2] == w


def in_cache_legacy(cache, rope_emb, start, t, s, r):
    """The sink cache's kept keys/values, moved to positions 0 .. n-1 with the model's own rotary
    (rotation by a negative shift), as a legacy tuple: what the chunk ``start .. start+t-1`` attends to."""
    concat = t - max(0, min(s - start, t)) > r
    first = max(s, start + t - r)  # oldest window position the chunk may see
    legacy = []
    for layer in cache.layers:
        positions = layer.key_positions(torch.tensor([start - 1])).sort().values
        positions = positions[positions >= 0]  # what is held now, oldest first (as .keys orders it)
        keys, values = layer.keys, layer.values
        sinks = positions < s
        window = (positions >= first) & ~sinks & (not concat)
        old_shift = int(positions[s]) - s if positions.numel() > s else 0  # the sinks' current offset

        def move(x, shift):
            cos, sin = rope_emb(torch.tensor([[-shift]]))
            return apply_rotary(x, cos, sin)

        legacy.append((torch.cat([move(keys[:, :, sinks], old_shift), move(keys[:, :, window], first - s)], 2),
                       torch.cat([values[:, :, sinks], values[:, :, window]], 2)))
    return tuple(legacy)


@pytest.mark.parametrize("rope", sorted(ROPES))
@torch.no_grad()
def test_multi_layer_streaming_equals_its_kept_cache_at_in_cache_positions(rope):
    """Two layers: each chunk's logits equal those of the chunk run at in-cache positions against a plain
    DynamicCache holding the kept keys/values moved to positions 0 .. n-1 (re-rotated independently)."""
    w, s = 12, 3
    model = tiny_model(rope)
    ids = torch.randint(3, 128, (2, sum(STREAM)), generator=torch.Generator().manual_seed(0))
    cache = SinkCache(window_length=w, num_sink_tokens=s)
    start = 0
    for t in STREAM:
        ref = None
        if start:
            legacy = in_cache_legacy(cache, model.model.rotary_emb, start, t, s, w - s)
            n = legacy[0][0].shape[2]
            ref = model(ids[:, start:start + t], past_key_values=kvgen.DynamicCache.from_legacy_cache(legacy),
                        position_ids=torch.arange(n, n + t)[None].expand(2, -1)).logits
        out = model(ids[:, start:start + t], past_key_values=cache).logits
        if ref is not None:
            torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, msg=f"{rope}: chunk of {t} at position {start}")
        start += t


@torch.no_grad()
def test_the_differential_test_catches_missing_rerotation(monkeypatch):
    """Without re-rotating the sinks, streaming logits drift from the fresh forward (the check has teeth)."""
    model = tiny_model("default", num_hidden_layers=1)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(kvgen.cache.sink, "rotate_by", lambda x, shift, rotary_emb: x)
    cache = SinkCache(window_length=10, num_sink_tokens=3)
    model(ids[:, :10], past_key_values=cache)
    worst = 0.0
    for p in range(10, 30):
        out = model(ids[:, p:p + 1], past_key_values=cache).logits
        fresh = model(ids[:, expected_window(3, 7, p, p, False)], use_cache=False).logits[:, -1:]
        worst = max(worst, (out - fresh).abs().max().item())
    assert worst > 100 * ATOL


# -- generate ----------------------------------------------------------------------------------------------

def greedy_streaming_reference(model, ids, n, w, s):
    """Greedy tokens where each step runs a fresh forward over [sinks + last window] (no cache at all).

    Exact for one-layer models only (see the differential test)."""
    with torch.no_grad():
        for _ in range(n):
            t = ids.shape[1]
            kept = list(range(min(s, t))) + list(range(max(s, t - (w - s)), t))
            next_id = model(ids[:, kept], use_cache=False).logits[:, -1:].argmax(-1)
            ids = torch.cat([ids, next_id], dim=-1)
    return ids


@pytest.mark.parametrize("rope", ["default", "phi3-partial"])
def test_generate_with_a_sink_cache_past_the_window(rope):
    model = tiny_model(rope, num_hidden_layers=1)
    prompt = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    cache = SinkCache(window_length=16, num_sink_tokens=4)
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, greedy_streaming_reference(model, prompt, 40, 16, 4))
    assert cache.get_seq_length() == 49 and cache.layers[0].keys.shape[2] == 16
    # a dense cache gives other tokens once the window is full (the comparison is not vacuous)
    assert not torch.equal(out, model.generate(prompt, max_new_tokens=40, do_sample=False))
    # the cache continues a stream: the whole sequence in, only the new tokens fed; a deep copy does the same
    clone = copy.deepcopy(cache)
    more = model.generate(out, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert torch.equal(more, greedy_streaming_reference(model, out, 5, 16, 4))
    assert torch.equal(model.generate(out, past_key_values=clone, max_new_tokens=5, do_sample=False), more)


def test_cache_implementation_sink_with_cache_config():
    model = tiny_model(num_hidden_layers=1)
    prompt = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(4))
    got = model.generate(prompt, cache_implementation="sink", cache_config={"window_length": 12, "num_sink_tokens": 2},
                         max_new_tokens=25, do_sample=False, return_dict_in_generate=True)
    assert isinstance(got.past_key_values, SinkCache) and got.past_key_values.get_max_length() == 12
    assert torch.equal(got.sequences, greedy_streaming_reference(model, prompt, 25, 12, 2))


def test_static_sink_in_generates_compiled_path_matches_the_sink_cache(monkeypatch):
    model = tiny_model("phi3-partial")
    prompt = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(5))
    want = model.generate(prompt, past_key_values=SinkCache(window_length=10, num_sink_tokens=3), max_new_tokens=24,
                          do_sample=False)
    monkeypatch.delenv("KVGEN_DISABLE_COMPILE")
    cache = StaticSinkCache(config=model.config, window_length=10, num_sink_tokens=3, max_cache_len=64)
    assert cache.is_compileable
    compiled_forward, calls = model.compiled_forward, []
    monkeypatch.setattr(model, "compiled_forward", lambda: calls.append(1) or compiled_forward())
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):  # one graph for every step, through the wrap
        got = model.generate(prompt, past_key_values=cache, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, want) and calls  # decoded by generate's compiled static path
    by_name = model.generate(prompt, cache_implementation="static_sink", max_new_tokens=24, do_sample=False,
                             cache_config={"window_length": 10, "num_sink_tokens": 3})
    assert torch.equal(by_name, want)


# -- the seeds' iterative example ---------------------------------------------------------------------------

def test_iterative_prompts_with_input_cropping(smollm):
    """Seeds 000/002/003, "Iterative Generation with Cache", the SinkCache version with its input cropping.

    The seed's code with the import and model changed (max_new_tokens shortened). A cropped
    prompt does not continue what the cache holds, so generate() starts the cache afresh
    from it (only a common prefix is ever reused): each answer equals one generated from the
    cropped prompt with a new SinkCache.
    """
    model, tokenizer = smollm
    user_prompts = ["Hello, what's your name?", "Btw, yesterday I was on a rock concert."]

    past_key_values = SinkCache(window_length=30, num_sink_tokens=4)
    max_cache_length = past_key_values.get_max_length()

    messages = []
    cropped = []
    for prompt in user_prompts:
        messages.append({"role": "user", "content": prompt})
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True).to(model.device)

        if isinstance(past_key_values, SinkCache):
            inputs = {k: v[:, -max_cache_length:] for k, v in inputs.items()}
        input_length = inputs["input_ids"].shape[1]

        outputs = model.generate(**inputs, do_sample=False, max_new_tokens=24, past_key_values=past_key_values)
        completion = tokenizer.decode(outputs[0, input_length:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": completion})
        cropped.append((inputs, outputs))

    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert all(inputs["input_ids"].shape[1] == 30 for inputs, _ in cropped)  # both chats were longer than 30
    assert past_key_values.layers[0].keys.shape[2] == 30  # bounded however long the stream
    for inputs, outputs in cropped:
        fresh = model.generate(**inputs, do_sample=False, max_new_tokens=24,
                               past_key_values=SinkCache(window_length=30, num_sink_tokens=4))
        assert torch.equal(outputs, fresh)


# -- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, error", [
    ((4, 4), ValueError), ((3, 4), ValueError), ((8, -1), ValueError), ((8.0, 2), TypeError), ((8, None), TypeError),
])
def test_bad_sizes(args, error):
    with pytest.raises(error, match="window_length|num_sink_tokens"):
        SinkCache(*args)
    with pytest.raises(error, match="window_length|num_sink_tokens"):
        SinkLayer(*args)


def test_bad_cache_config_and_unsupported_models():
    model = tiny_model()
    prompt = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="needs cache_config"):
        model.generate(prompt, cache_implementation="sink", max_new_tokens=2)
    with pytest.raises(ValueError, match="unknown keys"):
        model.generate(prompt, cache_implementation="sink", max_new_tokens=2, cache_config={"window": 8})
    with pytest.raises(ValueError, match="lacks"):
        model.generate(prompt, cache_implementation="sink", max_new_tokens=2, cache_config={"window_length": 8})
    with pytest.raises(ValueError, match="window_length"):
        model.generate(prompt, cache_implementation="sink", max_new_tokens=2,
                       cache_config={"window_length": 2, "num_sink_tokens": 4})
    with pytest.raises(ValueError, match="sliding-window"):
        kvgen.cache.create_cache("sink", config=PretrainedConfig(model_type="mistral", hidden_size=64,
                                                                 num_attention_heads=4, num_hidden_layers=2),
                                 batch_size=1, max_cache_len=8, device="cpu", dtype=torch.float32,
                                 cache_config={"window_length": 8, "num_sink_tokens": 2})
    with pytest.raises(ValueError, match="needs the model's config"):
        StaticSinkCache(window_length=8, num_sink_tokens=2)
    with pytest.raises(ValueError, match="exceeds the cache's max_cache_len"):
        model.generate(prompt, past_key_values=StaticSinkCache(config=model.config, window_length=8, num_sink_tokens=2,
                                                               max_cache_len=10), max_new_tokens=20)


def test_bad_positions_and_missing_rotary():
    cache = SinkCache(window_length=6, num_sink_tokens=2)
    k = torch.zeros(1, 1, 8, 16)
    cache.update(k, k, 0, {"cache_position": torch.arange(8), "rotary_emb": rotary()})
    with pytest.raises(ValueError, match="next positions must be 8..8"):
        cache.check_cache_position(torch.tensor([3]))
    with pytest.raises(ValueError, match="rotary embedding"):
        cache.update(k[:, :, :1], k[:, :, :1], 0, {"cache_position": torch.tensor([8])})
    dynamic = RotaryEmbedding(tiny_config("default", max_position_embeddings=16,
                                          rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                           "rope_theta": 10000.0}))
    cache = SinkCache(window_length=6, num_sink_tokens=2)
    cache.update(k, k, 0, {"cache_position": torch.arange(8), "rotary_emb": dynamic})  # within its 16 positions
    with pytest.raises(ValueError, match="dynamic-NTK"):
        cache.update(torch.zeros(1, 1, 9, 16), torch.zeros(1, 1, 9, 16), 0,
                     {"cache_position": torch.arange(8, 17), "rotary_emb": dynamic})


def test_public_names_and_sizes():
    cache = SinkCache(window_length=256, num_sink_tokens=4)
    assert kvgen.SinkCache is SinkCache and "sink" in kvgen.cache_implementations()
    assert cache.get_max_length() == cache.get_max_cache_shape() == 256 and cache.get_seq_length() == 0
    static = StaticSinkCache(config=tiny_config(), window_length=16, num_sink_tokens=4, max_batch_size=1,
                             dtype=torch.float32)
    assert static.get_max_length() == 16 and static.get_max_cache_shape() == 512  # the config's positions
    assert len(static) == 2 and static.nbytes() > 0
