"""Whisper: parity with transformers on a small random checkpoint that transformers builds and saves.

The checkpoint keeps Whisper's layout of special tokens at the top of a small vocabulary
(start, ``<|notimestamps|>`` with the timestamps after it) and a generation config like
whisper-tiny.en's (forced ``<|notimestamps|>``, suppressed tokens, begin-suppressed EOS),
with an EOS that the random model does emit, so sequences end at different lengths.
Features come from transformers' ``WhisperFeatureExtractor`` on synthetic audio.
Encoder outputs and decoder logits match within 1e-4 (float32); generated ids are equal for
greedy, sampling and beam search (token suppression included),
with and without a cache, for every combination of dynamic and static halves of the
``EncoderDecoderCache``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from transformers.models.whisper.configuration_whisper import NON_SPEECH_TOKENS

import kvgen
from kvgen import AutoModelForSpeechSeq2Seq, DynamicCache, EncoderDecoderCache, StaticCache
from kvgen.config import PretrainedConfig
from kvgen.models.whisper import WhisperForConditionalGeneration

ATOL = 1e-4
VOCAB, EOS, START, NO_TIMESTAMPS = 111, 14, 101, 110  # no timestamp ids (they would follow 110)
FRAMES = 400  # 4 s of features (30 s in real Whisper): the first 4 s of each clip
EOS_SCALE = 4.0  # a larger EOS row: the random model ends two of the three sequences early
CONFIG = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, num_mel_bins=80,
              max_source_positions=FRAMES // 2, max_target_positions=64, init_std=0.5, pad_token_id=EOS,
              bos_token_id=EOS, eos_token_id=EOS, decoder_start_token_id=START, begin_suppress_tokens=[4, EOS])
GENERATION = dict(decoder_start_token_id=START, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS,
                  forced_decoder_ids=[[1, NO_TIMESTAMPS]], no_timestamps_token_id=NO_TIMESTAMPS, is_multilingual=False,
                  suppress_tokens=[1, 2, 7, 102, 103, 104, 105, 106, 107], begin_suppress_tokens=[4, EOS],
                  max_length=40, return_timestamps=False)


def save_pair(folder, config: dict, generation: dict, eos_row_seed: int = 0):
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**config))
    with torch.no_grad():  # transformers zeroes the padding (= EOS) embedding, which would never be predicted
        row = torch.randn(config["d_model"], generator=torch.Generator().manual_seed(eos_row_seed))
        model.model.decoder.embed_tokens.weight[config["pad_token_id"]] = row * config["init_std"] * EOS_SCALE
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(generation))  # as published (not _from_model_config)
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(folder).eval()
    return hf, AutoModelForSpeechSeq2Seq.from_pretrained(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("whisper"), CONFIG, GENERATION)


def synthetic_features() -> torch.Tensor:
    """(3, 80, FRAMES) log-mel features of three synthetic clips (modulated chirps with noise)."""
    rate, clips = 16000, []
    for i, (freq, seconds) in enumerate([(220, 2.0), (440, 3.0), (880, 4.0)]):
        t = np.arange(int(rate * seconds)) / rate
        chirp = np.sin(2 * np.pi * freq * t * (1 + 0.5 * t)) * (1 + np.sin(2 * np.pi * (i + 1) * t))
        clips.append((0.3 * chirp + 0.05 * np.random.default_rng(i).standard_normal(len(t))).astype(np.float32))
    features = transformers.WhisperFeatureExtractor()(clips, sampling_rate=rate, return_tensors="pt").input_features
    return features[:, :, :FRAMES]  # (3, 80, 3000) -> the first FRAMES


@pytest.fixture(scope="module")
def features():
    return synthetic_features()


def test_loads_as_whisper_with_tied_output(pair):
    hf, ours = pair
    assert type(ours) is WhisperForConditionalGeneration
    assert ours.proj_out.weight is ours.model.decoder.embed_tokens.weight
    assert ours.model.decoder.layers[0].encoder_attn.k_proj.bias is None


@torch.no_grad()
def test_encoder_output_matches(pair, features):
    hf, ours = pair
    ref = hf.model.encoder(features).last_hidden_state
    got = ours.get_encoder()(features).last_hidden_state
    assert got.shape == (3, FRAMES // 2, 64)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@torch.no_grad()
def test_decoder_logits_without_and_with_cache(pair, features):
    hf, ours = pair
    ids = torch.tensor([[START, NO_TIMESTAMPS, 25, 37, 9, 40, 78, 3]] * 3)
    ref = hf(features, decoder_input_ids=ids).logits
    out = ours(features, decoder_input_ids=ids)
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)
    assert isinstance(out.past_key_values, EncoderDecoderCache) and out.past_key_values.get_seq_length() == 8
    uncached = ours(features, decoder_input_ids=ids, use_cache=False)
    torch.testing.assert_close(uncached.logits, ref, atol=ATOL, rtol=0)
    assert uncached.past_key_values is None

    # prefill 3 tokens, then one token per step: the encoder runs once, cross-attention is read back
    encoder = hf.model.encoder(features)
    hf_cache = transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())
    cache = EncoderDecoderCache(DynamicCache(), StaticCache(config=ours.config, max_cache_len=FRAMES // 2))
    for start, end in [(0, 3), (3, 4), (4, 5), (5, 6), (6, 8)]:
        want = hf(encoder_outputs=encoder, decoder_input_ids=ids[:, start:end], past_key_values=hf_cache).logits
        got = ours(features if start == 0 else None, decoder_input_ids=ids[:, start:end], past_key_values=cache,
                   cache_position=torch.arange(start, end)).logits
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(got, ref[:, start:end], atol=ATOL, rtol=0)
    assert cache.get_seq_length() == 8 and cache.cross_attention_cache.layers[1].keys.shape[2] == FRAMES // 2

    # a legacy tuple of 4-tuples goes in and comes back out
    legacy = ours(features, decoder_input_ids=ids[:, :5], past_key_values=()).past_key_values
    assert isinstance(legacy, tuple) and len(legacy) == 2 and len(legacy[0]) == 4
    step = ours(decoder_input_ids=ids[:, 5:], past_key_values=legacy)
    torch.testing.assert_close(step.logits, ref[:, 5:], atol=ATOL, rtol=0)
    assert step.past_key_values[0][0].shape[2] == 8


@torch.no_grad()
def test_left_padded_decoder_batch(pair, features):
    hf, ours = pair
    ids = torch.tensor([[EOS, EOS, START, NO_TIMESTAMPS, 25, 37], [START, NO_TIMESTAMPS, 9, 40, 78, 3],
                        [EOS, START, NO_TIMESTAMPS, 12, 13, 14]])
    mask = (torch.arange(6)[None] >= torch.tensor([[2], [0], [1]])).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ref = hf(features, decoder_input_ids=ids, decoder_attention_mask=mask, decoder_position_ids=positions).logits
    got = ours(features, decoder_input_ids=ids, decoder_attention_mask=mask, decoder_position_ids=positions).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def greedy(pair, features):
    hf, _ = pair
    return hf.generate(features), hf.generate(features, return_dict_in_generate=True).sequences


def test_greedy_generate_matches_transformers(pair, features, greedy):
    hf, ours = pair
    ref, ref_full = greedy
    # the scenario is meaningful: forced prompt, rows that end at different lengths, suppressed tokens absent
    assert ref_full[:, :2].tolist() == [[START, NO_TIMESTAMPS]] * 3
    ends = [(row == EOS).nonzero()[0].item() if (row == EOS).any() else len(row) for row in ref_full[:, 2:]]
    assert len(set(ends)) == 3 and max(ends) == 40 and ref.shape[1] == 40  # one row runs to max_length
    assert not torch.isin(ref_full[:, 2:], torch.tensor(GENERATION["suppress_tokens"])).any()
    got = ours.generate(features)
    assert got.tolist() == ref.tolist()
    out = ours.generate(features, return_dict_in_generate=True)
    assert out.sequences.tolist() == ref_full.tolist()
    assert isinstance(out.past_key_values, EncoderDecoderCache)
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1


@pytest.mark.parametrize("settings", [dict(use_cache=False), dict(cache_implementation="static"),
                                      dict(cache_implementation="offloaded"), dict(max_new_tokens=5),
                                      dict(max_new_tokens=12, eos_token_id=25)],
                         ids=["uncached", "static", "offloaded", "max_new_tokens", "eos_token_id"])
def test_generate_settings_match_transformers(pair, features, greedy, settings):
    hf, ours = pair
    if "max_new_tokens" in settings:
        ref = hf.generate(features, return_dict_in_generate=True, **settings).sequences
    else:
        ref = greedy[1]
    got = ours.generate(features, disable_compile=True, return_dict_in_generate=True, **settings).sequences
    assert got.tolist() == ref.tolist()


CACHES = {
    "dynamic+static": lambda c: EncoderDecoderCache(DynamicCache(), StaticCache(config=c, max_cache_len=FRAMES // 2)),
    "static+dynamic": lambda c: EncoderDecoderCache(StaticCache(config=c, max_cache_len=64), DynamicCache()),
    "static+static": lambda c: EncoderDecoderCache(StaticCache(config=c, max_cache_len=64),
                                                   StaticCache(config=c, max_cache_len=FRAMES // 2)),
    "plain static": lambda c: StaticCache(config=c, max_cache_len=64),  # becomes the self-attention half
}


@pytest.mark.parametrize("name", sorted(CACHES))
def test_cache_combinations_give_the_same_ids(pair, features, greedy, name):
    _, ours = pair
    cache = CACHES[name](ours.config)
    out = ours.generate(features, past_key_values=cache, disable_compile=True, return_dict_in_generate=True)
    assert out.sequences.tolist() == greedy[1].tolist()
    filled = out.past_key_values
    assert filled is cache or filled.self_attention_cache is cache
    # the cache is reset and refilled by another call (its states depend on the audio)
    again = ours.generate(features.flip(0), past_key_values=filled, disable_compile=True, max_new_tokens=4)
    assert again.tolist() == greedy[0].flip(0)[:, :4].tolist()


def test_sampling_matches_transformers(pair, features):
    hf, ours = pair
    torch.manual_seed(5)
    ref = hf.generate(features, max_new_tokens=10, temperature=0.8)  # transformers samples when given a temperature
    torch.manual_seed(5)
    got = ours.generate(features, max_new_tokens=10, do_sample=True, temperature=0.8)
    assert got.tolist() == ref.tolist()
    torch.manual_seed(3)
    ref = hf.generate(features, max_new_tokens=6, do_sample=True, temperature=0.9, num_return_sequences=2)
    torch.manual_seed(3)
    got = ours.generate(features, max_new_tokens=6, do_sample=True, temperature=0.9, num_return_sequences=2)
    assert got.shape == (6, 6) and got.tolist() == ref.tolist()


def test_beam_search_matches_transformers(pair, features):
    hf, ours = pair
    off = dict(suppress_tokens=[], begin_suppress_tokens=[])  # see the next test
    ref = hf.generate(features, max_new_tokens=8, num_beams=3, **off)
    assert ours.generate(features, max_new_tokens=8, num_beams=3, **off).tolist() == ref.tolist()
    assert ours.generate(features, max_new_tokens=8, num_beams=3, use_cache=False, **off).tolist() == ref.tolist()


def test_beam_search_with_suppressed_tokens_matches_transformers(pair, features):
    hf, ours = pair
    ref = hf.generate(features, max_new_tokens=8, num_beams=3, suppress_tokens=[34])  # a frequent token
    assert ours.generate(features, max_new_tokens=8, num_beams=3, suppress_tokens=[34]).tolist() == ref.tolist()


def test_plain_output_and_begin_suppression_match_transformers(pair, features):
    hf, ours = pair
    settings = dict(eos_token_id=34, pad_token_id=34, max_new_tokens=20)  # both clips end early, at 34
    ref = hf.generate(features[:2], **settings)
    assert ref.shape == (2, 5)  # the longer one's 5 tokens (its EOS dropped), the shorter padded
    assert ours.generate(features[:2], **settings).tolist() == ref.tolist()
    firsts = hf.generate(features, max_new_tokens=1)[:, 0].tolist()
    settings = dict(begin_suppress_tokens=firsts, max_new_tokens=4)  # the usual first tokens are barred
    ref = hf.generate(features, **settings)
    assert not set(ref[:, 0].tolist()) & set(firsts)
    assert ours.generate(features, **settings).tolist() == ref.tolist()


def test_a_passed_generation_config_keeps_whisper_settings(pair, features):
    hf, ours = pair
    ref = hf.generate(features, generation_config=transformers.GenerationConfig(max_new_tokens=5),
                      return_dict_in_generate=True).sequences
    got = ours.generate(features, generation_config=kvgen.GenerationConfig(max_new_tokens=5),
                        return_dict_in_generate=True).sequences
    assert got[:, :2].tolist() == [[START, NO_TIMESTAMPS]] * 3 and got.tolist() == ref.tolist()


def test_decoder_input_ids_replace_the_prompt(pair, features):
    hf, ours = pair
    prompt = torch.tensor([[START, NO_TIMESTAMPS, 25, 37]] * 3)
    ref = hf.generate(features, decoder_input_ids=prompt, max_new_tokens=6)
    assert ours.generate(features, decoder_input_ids=prompt, max_new_tokens=6).tolist() == ref.tolist()
    encoder = ours.get_encoder()(features)
    got = ours.generate(encoder_outputs=encoder, decoder_input_ids=prompt, max_new_tokens=6)
    assert got.tolist() == ref.tolist()


def test_tiny_en_prompt_and_suppression(tmp_path):
    """Real token ids: an English-only prompt is <|startoftranscript|><|notimestamps|> (here without forced ids)."""
    config = {**CONFIG, "vocab_size": 51864, "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
              "max_source_positions": 50, "pad_token_id": 50256, "bos_token_id": 50256, "eos_token_id": 50256,
              "decoder_start_token_id": 50257, "begin_suppress_tokens": [220, 50256]}
    generation = {**GENERATION, "decoder_start_token_id": 50257, "bos_token_id": 50257, "eos_token_id": 50256,
                  "pad_token_id": 50256, "forced_decoder_ids": None, "no_timestamps_token_id": 50362,
                  "suppress_tokens": NON_SPEECH_TOKENS[:-3] + [50357, 50358, 50359, 50360, 50361],
                  "begin_suppress_tokens": [220, 50256], "max_length": 448}
    hf, ours = save_pair(tmp_path, config, generation)
    features = torch.randn(2, 80, 100)
    ref = hf.generate(features, max_new_tokens=4, return_dict_in_generate=True).sequences
    got = ours.generate(features, max_new_tokens=4, return_dict_in_generate=True).sequences
    assert got[:, :2].tolist() == [[50257, 50362]] * 2 and got.tolist() == ref.tolist()


@torch.no_grad()
def test_loads_from_a_config_dict_and_state_dict(pair, features):
    hf, ours = pair
    config = PretrainedConfig.from_dict(hf.config.to_dict())
    state = {name: t.clone() for name, t in hf.state_dict().items()}
    model = WhisperForConditionalGeneration._from_state_dict(config, state, torch.float32, torch.device("cpu"))
    ids = torch.tensor([[START, NO_TIMESTAMPS, 25]])
    torch.testing.assert_close(model(features[:1], decoder_input_ids=ids).logits,
                               ours(features[:1], decoder_input_ids=ids).logits, atol=0, rtol=0)
    state = {name: t.clone() for name, t in hf.state_dict().items() if "fc1" not in name}
    with pytest.raises(ValueError, match="missing"):
        WhisperForConditionalGeneration._from_state_dict(config, state, torch.float32, torch.device("cpu"))


def test_clear_errors(pair, features):
    _, ours = pair
    ids = torch.tensor([[START]])
    with pytest.raises(ValueError, match=f"80 mel bins, {FRAMES} frames"):
        ours(torch.zeros(1, 128, FRAMES), decoder_input_ids=ids)
    with pytest.raises(ValueError, match=f"{FRAMES} frames"):
        ours.generate(torch.zeros(1, 80, 3000))
    with pytest.raises(ValueError, match="input_features"):
        ours(decoder_input_ids=ids)
    with pytest.raises(ValueError, match="input_features"):
        ours.generate()
    with pytest.raises(ValueError, match="max_target_positions"):
        ours.generate(features, max_new_tokens=63)
    with pytest.raises(ValueError, match="multilingual"):
        ours.generate(features, language="fr")
    with pytest.raises(NotImplementedError, match="timestamps"):
        ours.generate(features, return_timestamps=True)
    with pytest.raises(TypeError, match="does not know"):
        ours.generate(features, no_such_setting=1)
    with pytest.raises(ValueError, match="not both"):
        ours.generate(features, past_key_values=DynamicCache(), cache_implementation="static")
    assert kvgen.AutoModelForSpeechSeq2Seq is AutoModelForSpeechSeq2Seq
