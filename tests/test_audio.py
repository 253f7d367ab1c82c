"""kvgen.audio against transformers' WhisperFeatureExtractor / WhisperTokenizerFast and analytic signals."""

from __future__ import annotations

import math
import shutil
import subprocess
import wave

import pytest
import torch

from kvgen.audio import (WhisperFeatureExtractor, WhisperProcessor, load_audio, mel_filter_bank, read_wav,
                         resample)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def extractors():
    return WhisperFeatureExtractor(), transformers.WhisperFeatureExtractor()


def hf_features(extractor, speech):
    if isinstance(speech, list):
        speech = [s.numpy() for s in speech]
    else:
        speech = speech.numpy()
    return extractor(speech, sampling_rate=16000, return_tensors="pt").input_features


def write_wav(path, samples: torch.Tensor, rate: int, width: int = 2) -> None:
    """Write (channels, samples) floats in [-1, 1] as PCM of ``width`` bytes (independent of kvgen's reader)."""
    full = 2 ** (8 * width - 1)
    ints = (samples.T.reshape(-1).double() * full).round().clamp(-full, full - 1).long()
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[width]
    if width == 1:
        ints = ints + 128
    with wave.open(str(path), "wb") as f:
        f.setnchannels(samples.shape[0])
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(ints.to(dtype).numpy().tobytes())


def sine(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> torch.Tensor:
    t = torch.arange(int(rate * seconds), dtype=torch.float64) / rate
    return amplitude * torch.sin(2 * math.pi * freq * t)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """espeak-ng saying a pangram, 22050 Hz mono 16-bit, resampled to 16 kHz."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (bash scripts/setup.sh --test installs it)")
    path = tmp_path_factory.mktemp("speech") / "fox.wav"
    subprocess.run(["espeak-ng", "-w", str(path), "the quick brown fox jumps over the lazy dog"], check=True)
    return load_audio(path)


# -- features --------------------------------------------------------------------------------------------

def test_mel_filters_match_transformers():
    from transformers.audio_utils import mel_filter_bank as hf_mel_filter_bank

    for mels in (80, 128):
        ours = mel_filter_bank(201, mels, 0.0, 8000.0, 16000)
        ref = hf_mel_filter_bank(num_frequency_bins=201, num_mel_filters=mels, min_frequency=0.0,
                                 max_frequency=8000.0, sampling_rate=16000, norm="slaney", mel_scale="slaney")
        assert ours.shape == (201, mels)
        torch.testing.assert_close(ours, torch.from_numpy(ref), rtol=0, atol=1e-12)


@pytest.mark.parametrize("signal", ["noise", "sine", "long", "short", "silence"])
def test_features_match_transformers(extractors, signal):
    g = torch.Generator().manual_seed(0)
    speech = {
        "noise": lambda: 0.1 * torch.randn(5 * 16000, generator=g),
        "sine": lambda: sine(440.0, 16000, 2.5).float(),
        "long": lambda: 0.3 * torch.randn(35 * 16000, generator=g),  # truncated to 30 s
        "short": lambda: 0.2 * torch.randn(123, generator=g),
        "silence": lambda: torch.zeros(16000),
    }[signal]()
    ours, hf = extractors
    features = ours(speech, sampling_rate=16000, return_tensors="pt").input_features
    assert features.shape == (1, 80, 3000) and features.dtype == torch.float32
    torch.testing.assert_close(features, hf_features(hf, speech), rtol=0, atol=1e-5)


def test_batch_features_match_transformers(extractors):
    g = torch.Generator().manual_seed(1)
    batch = [0.1 * torch.randn(8000, generator=g), 0.01 * torch.randn(30000, generator=g)]
    ours, hf = extractors
    features = ours(batch, sampling_rate=16000).input_features
    assert features.shape == (2, 80, 3000)
    torch.testing.assert_close(features, hf_features(hf, batch), rtol=0, atol=1e-5)
    # each example keeps its own dynamic range: the same as extracting it alone
    torch.testing.assert_close(features[1:], ours(batch[1], sampling_rate=16000).input_features, rtol=0, atol=1e-6)
    stacked = torch.stack([batch[0], batch[1][:8000]])  # a 2-D (batch, samples) tensor
    torch.testing.assert_close(ours(stacked, sampling_rate=16000).input_features,
                               hf_features(hf, [batch[0], batch[1][:8000]]), rtol=0, atol=1e-5)
    torch.testing.assert_close(ours(batch[0].tolist(), sampling_rate=16000).input_features, features[:1],
                               rtol=0, atol=1e-6)  # a plain list of floats


def test_128_mel_bins_match_transformers():
    speech = 0.1 * torch.randn(16000, generator=torch.Generator().manual_seed(2))
    ours = WhisperFeatureExtractor(feature_size=128)(speech, sampling_rate=16000).input_features
    ref = hf_features(transformers.WhisperFeatureExtractor(feature_size=128), speech)
    assert ours.shape == (1, 128, 3000)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_speech_features_match_transformers(extractors, speech):
    assert 2.0 < speech.shape[0] / 16000 < 6.0 and speech.abs().max() > 0.1
    ours, hf = extractors
    torch.testing.assert_close(ours(speech, sampling_rate=16000).input_features, hf_features(hf, speech),
                               rtol=0, atol=1e-5)


def test_feature_errors(extractors):
    ours, _ = extractors
    with pytest.raises(ValueError, match="44100 Hz but Whisper needs 16000 Hz.*resample"):
        ours(torch.zeros(100), sampling_rate=44100)
    with pytest.raises(ValueError, match="floats in \\[-1, 1\\].*int16"):
        ours(torch.zeros(100, dtype=torch.int16), sampling_rate=16000)
    with pytest.raises(ValueError, match="1-D mono.*average stereo"):
        ours(torch.zeros(2, 2, 100), sampling_rate=16000)
    with pytest.raises(ValueError, match="return_tensors='pt'"):
        ours(torch.zeros(100), sampling_rate=16000, return_tensors="np")


# -- WAV reading and resampling ------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [1, 2, 4])
def test_read_wav_pcm_widths(tmp_path, width):
    samples = sine(300.0, 16000, 0.25).float()[None]  # (1, 4000)
    write_wav(tmp_path / "a.wav", samples, 16000, width)
    read, rate = read_wav(tmp_path / "a.wav")
    assert rate == 16000 and read.shape == (1, 4000) and read.dtype == torch.float32
    torch.testing.assert_close(read, samples, rtol=0, atol=1.0 / 2 ** (8 * width - 1))


def test_stereo_is_averaged(tmp_path):
    left, right = sine(300.0, 16000, 0.5), sine(500.0, 16000, 0.5, amplitude=0.25)
    write_wav(tmp_path / "stereo.wav", torch.stack([left, right]).float(), 16000)
    read, rate = read_wav(tmp_path / "stereo.wav")
    assert read.shape == (2, 8000)
    torch.testing.assert_close(read[1], right.float(), rtol=0, atol=1 / 32768)
    torch.testing.assert_close(load_audio(tmp_path / "stereo.wav"), ((left + right) / 2).float(), rtol=0,
                               atol=1 / 32768)


@pytest.mark.parametrize("rate", [8000, 22050, 44100])
def test_load_audio_resamples_to_16k(tmp_path, rate):
    write_wav(tmp_path / "a.wav", sine(440.0, rate, 1.0)[None].float(), rate)
    speech = load_audio(tmp_path / "a.wav")
    expected = sine(440.0, 16000, 1.0)
    assert speech.shape == expected.shape
    interior = slice(320, -320)  # 20 ms from each edge, where the zero padding is outside the filter
    torch.testing.assert_close(speech[interior].double(), expected[interior], rtol=0, atol=2e-3)


def test_resample_removes_frequencies_above_the_new_nyquist():
    tone = sine(4000.0, 44100, 1.0).float()  # amplitude 0.5: RMS 0.354

    def rms(x):
        return x[400:-400].pow(2).mean().sqrt().item()

    assert abs(rms(resample(tone, 44100, 16000)) - 0.3536) < 0.002  # 4 kHz is below 16 kHz's Nyquist: kept
    assert rms(resample(tone, 44100, 6000)) < 0.005  # above 6 kHz's Nyquist (3 kHz): filtered, not aliased
    batch = torch.stack([tone, 2 * tone])  # leading dimensions are kept
    out = resample(batch, 44100, 16000)
    assert out.shape == (2, 16000)
    torch.testing.assert_close(out[1], 2 * out[0])


def test_wav_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="audio file not found"):
        load_audio(tmp_path / "missing.wav")
    (tmp_path / "text.wav").write_text("not a wav file at all")
    with pytest.raises(ValueError, match="not a PCM WAV file.*ffmpeg"):
        load_audio(tmp_path / "text.wav")
    with wave.open(str(tmp_path / "24bit.wav"), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(3)
        f.setframerate(16000)
        f.writeframes(bytes(300))
    with pytest.raises(ValueError, match="24-bit samples.*8, 16 or 32-bit"):
        load_audio(tmp_path / "24bit.wav")
    with pytest.raises(ValueError, match="must be positive"):
        resample(torch.zeros(10), 0, 16000)


# -- processor ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def whisper_dir():
    from kvgen.loading.default_model import whisper_tiny_en_dir

    try:
        return whisper_tiny_en_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def hf_tokenizer(folder):
    return transformers.WhisperTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))


@pytest.mark.parametrize("task, language, no_timestamps", [
    (None, None, True), ("transcribe", "en", True), ("translate", "german", True), ("transcribe", "<|fr|>", False),
    (None, "English", False),
])
def test_decoder_prompt_ids_match_transformers(whisper_dir, task, language, no_timestamps):
    processor = WhisperProcessor.from_pretrained(whisper_dir)
    ref_language = language.strip("<|>") if language else None
    expected = hf_tokenizer(whisper_dir).get_decoder_prompt_ids(task=task, language=ref_language,
                                                               no_timestamps=no_timestamps)
    assert processor.get_decoder_prompt_ids(task=task, language=language, no_timestamps=no_timestamps) == expected


def test_processor_decodes_and_extracts_like_transformers(whisper_dir, extractors):
    processor = WhisperProcessor.from_pretrained(whisper_dir)
    ids = torch.tensor([[50257, 50362, 383, 2068, 7586, 21831, 13, 50256], [50257, 50362, 15496, 995, 50256, 50256,
                                                                            50256, 50256]])
    reference = hf_tokenizer(whisper_dir)
    for skip in (True, False):
        assert processor.batch_decode(ids, skip_special_tokens=skip) == reference.batch_decode(
            ids, skip_special_tokens=skip)
    assert processor.batch_decode(ids, skip_special_tokens=True)[0] == " The quick brown fox."
    assert processor.tokenizer.eos_token == "<|endoftext|>" and processor.tokenizer.pad_token_id == 50256
    speech = 0.1 * torch.randn(16000, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(processor(speech, sampling_rate=16000, return_tensors="pt").input_features,
                               hf_features(extractors[1], speech), rtol=0, atol=1e-5)


def test_processor_errors(whisper_dir):
    processor = WhisperProcessor.from_pretrained(whisper_dir)
    with pytest.raises(ValueError, match="unsupported language 'klingon'.*'en'"):
        processor.get_decoder_prompt_ids(language="klingon")
    with pytest.raises(ValueError, match="unsupported task 'summarize'"):
        processor.get_decoder_prompt_ids(task="summarize")
    with pytest.raises(ValueError, match="audio="):
        processor()
