"""Speech input for Whisper: WAV reading, resampling, log-mel features, and the processor.

``WhisperFeatureExtractor`` computes the same log-mel spectrogram as transformers' (slaney mel
filters, ``torch.stft``, log10, 8-decade dynamic range, ``(x + 4) / 4``) on 30-second chunks.
``load_audio`` reads 8/16/32-bit PCM WAV files (mono, or stereo averaged to mono) with Python's
``wave`` module and resamples other rates to 16 kHz by windowed-sinc (Hann) interpolation.
``WhisperProcessor`` pairs the feature extractor with a kvgen tokenizer.
"""

from __future__ import annotations

import json
import math
import os
import wave
from pathlib import Path
from typing import Any, Sequence

import torch

from kvgen.tokenizer import AutoTokenizer, BatchEncoding, PreTrainedTokenizerFast

SAMPLING_RATE = 16000
_PCM_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


# -- reading and resampling ---------------------------------------------------------------------------

def read_wav(path: str | os.PathLike) -> tuple[torch.Tensor, int]:
    """Read a PCM WAV file as float32 samples in [-1, 1], shape (channels, samples), and its rate.

    Example:
        >>> samples, rate = read_wav("speech.wav")  # doctest: +SKIP
        >>> samples.shape, rate  # doctest: +SKIP
        (torch.Size([2, 44100]), 44100)
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    try:
        with wave.open(str(path), "rb") as f:
            channels, width, rate = f.getnchannels(), f.getsampwidth(), f.getframerate()
            frames = f.readframes(f.getnframes())
    except (wave.Error, EOFError) as e:
        raise ValueError(f"{path} is not a PCM WAV file that Python's wave module reads ({e}); convert it, e.g. "
                         f"`ffmpeg -i {path.name} -ac 1 -ar 16000 -sample_fmt s16 out.wav`.") from None
    if width not in _PCM_DTYPES:
        raise ValueError(f"{path} has {8 * width}-bit samples; kvgen reads 8, 16 or 32-bit PCM WAV. Convert it, e.g. "
                         f"`ffmpeg -i {path.name} -sample_fmt s16 out.wav`.")
    usable = len(frames) - len(frames) % (width * channels)  # a truncated file may end mid-frame
    if not usable:
        return torch.zeros(channels, 0), rate
    samples = torch.frombuffer(bytearray(frames[:usable]), dtype=_PCM_DTYPES[width]).float()
    if width == 1:  # 8-bit WAV is unsigned with 128 as silence
        samples = samples - 128.0
    samples = samples / float(2 ** (8 * width - 1))
    return samples.view(-1, channels).T.contiguous(), rate  # (channels, samples)


def resample(waveform: torch.Tensor, orig_rate: int, new_rate: int, lowpass_filter_width: int = 6,
             rolloff: float = 0.99) -> torch.Tensor:
    """Resample the last dimension from ``orig_rate`` to ``new_rate`` Hz (band-limited sinc interpolation).

    Each output sample is a Hann-windowed sinc of the input (``lowpass_filter_width`` zero
    crossings, cutoff ``rolloff`` times the lower Nyquist rate), computed as one strided
    convolution per rate ratio, the same kernel as torchaudio's default ``resample``.

    Example:
        >>> resample(torch.zeros(22050), 22050, 16000).shape
        torch.Size([16000])
    """
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"sampling rates must be positive, got {orig_rate} -> {new_rate}")
    if orig_rate == new_rate:
        return waveform
    gcd = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // gcd, new_rate // gcd
    base = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base)
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig  # (K,)
    t = (torch.arange(0, -new, -1, dtype=torch.float64)[:, None] / new + taps) * base  # (new, K)
    t = t.clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    kernels = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t) * window * (base / orig)  # (new, K)
    shape, length = waveform.shape, waveform.shape[-1]
    x = torch.nn.functional.pad(waveform.reshape(-1, 1, length).to(torch.float32), (width, width + orig))
    y = torch.nn.functional.conv1d(x, kernels.to(torch.float32)[:, None], stride=orig)  # (B, new, frames)
    y = y.transpose(1, 2).reshape(x.shape[0], -1)[:, :math.ceil(new * length / orig)]
    return y.reshape(*shape[:-1], -1).to(waveform.dtype if waveform.is_floating_point() else torch.float32)


def load_audio(path: str | os.PathLike, sampling_rate: int = SAMPLING_RATE) -> torch.Tensor:
    """Read a WAV file as mono float32 samples at ``sampling_rate`` Hz, shape (samples,).

    Stereo (or more channels) is averaged to mono; other rates are resampled with :func:`resample`.

    Example:
        >>> speech = load_audio("speech.wav")  # doctest: +SKIP
        >>> features = WhisperFeatureExtractor()(speech, sampling_rate=16000).input_features
    """
    samples, rate = read_wav(path)
    return resample(samples.mean(dim=0), rate, sampling_rate)


# -- features -------------------------------------------------------------------------------------------

def _hertz_to_mel(freq: float) -> float:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    return 3.0 * freq / 200.0 if freq < 1000.0 else 15.0 + math.log(freq / 1000.0) * 27.0 / math.log(6.4)


def _mel_to_hertz(mels: torch.Tensor) -> torch.Tensor:
    log_region = 1000.0 * torch.exp(math.log(6.4) / 27.0 * (mels - 15.0))
    return torch.where(mels >= 15.0, log_region, 200.0 * mels / 3.0)


def mel_filter_bank(num_frequency_bins: int, num_mel_filters: int, min_frequency: float, max_frequency: float,
                    sampling_rate: int) -> torch.Tensor:
    """Slaney-style triangular mel filters with area normalisation, float64 (bins, mels), as librosa's."""
    mel_freqs = torch.linspace(_hertz_to_mel(min_frequency), _hertz_to_mel(max_frequency), num_mel_filters + 2,
                               dtype=torch.float64)
    filter_freqs = _mel_to_hertz(mel_freqs)  # (mels + 2,) filter edges and centres in Hz
    fft_freqs = torch.linspace(0, sampling_rate // 2, num_frequency_bins, dtype=torch.float64)
    spacing = filter_freqs.diff()
    slopes = filter_freqs[None, :] - fft_freqs[:, None]  # (bins, mels + 2)
    down = -slopes[:, :-2] / spacing[:-1]
    up = slopes[:, 2:] / spacing[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0.0)  # (bins, mels)
    return filters * (2.0 / (filter_freqs[2:] - filter_freqs[:-2]))[None, :]


class BatchFeature(BatchEncoding):
    """The feature extractor's output: a dict whose keys (``input_features``) are also attributes."""


def _as_waveforms(raw_speech: Any) -> list[torch.Tensor]:
    """One 1-D float32 tensor per example from a tensor, array, list of floats or list of those."""
    if isinstance(raw_speech, (list, tuple)) and raw_speech and not isinstance(raw_speech[0], (int, float)):
        items = list(raw_speech)
    else:
        items = [raw_speech]
        tensor = torch.as_tensor(raw_speech) if not isinstance(raw_speech, torch.Tensor) else raw_speech
        if tensor.dim() == 2:  # (batch, samples)
            items = list(tensor)
    waveforms = []
    for item in items:
        if isinstance(item, torch.Tensor):
            tensor = item
        else:  # Python lists of numbers are samples; arrays keep their dtype (integer PCM is refused below)
            tensor = torch.as_tensor(item, dtype=torch.float32 if isinstance(item, (list, tuple)) else None)
        if not (tensor.is_floating_point() or (tensor.numel() == 0)):
            raise ValueError(f"audio samples must be floats in [-1, 1], got {tensor.dtype}; divide integer PCM by "
                             "its full scale (32768 for int16) or read files with kvgen.audio.load_audio.")
        if tensor.dim() != 1:
            raise ValueError(f"each audio example must be 1-D mono samples, got shape {tuple(tensor.shape)}; "
                             "average stereo channels (waveform.mean(0)) first.")
        waveforms.append(tensor.to(torch.float32))
    return waveforms


class WhisperFeatureExtractor:
    """Log-mel features for Whisper from 16 kHz mono audio, as transformers' ``WhisperFeatureExtractor``.

    Each example is padded with silence (or truncated) to ``chunk_length`` seconds, giving
    ``input_features`` of shape (batch, feature_size, chunk_length * sampling_rate // hop_length).

    Example:
        >>> extractor = WhisperFeatureExtractor()
        >>> extractor(torch.zeros(16000), sampling_rate=16000, return_tensors="pt").input_features.shape
        torch.Size([1, 80, 3000])
    """

    model_input_names = ["input_features"]

    def __init__(self, feature_size: int = 80, sampling_rate: int = SAMPLING_RATE, hop_length: int = 160,
                 chunk_length: int = 30, n_fft: int = 400, padding_value: float = 0.0):
        self.feature_size, self.sampling_rate, self.hop_length = feature_size, sampling_rate, hop_length
        self.chunk_length, self.n_fft, self.padding_value = chunk_length, n_fft, padding_value
        self.n_samples = chunk_length * sampling_rate
        self.nb_max_frames = self.n_samples // hop_length
        self.mel_filters = mel_filter_bank(1 + n_fft // 2, feature_size, 0.0, 8000.0, sampling_rate)  # (bins, mels)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "WhisperFeatureExtractor":
        """Settings from the folder's ``preprocessor_config.json``; defaults (80 mel bins) without one."""
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            return cls()
        saved = json.loads(path.read_text())
        names = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value")
        return cls(**{name: saved[name] for name in names if name in saved})

    def __call__(self, raw_speech: Any, sampling_rate: int | None = None, return_tensors: str | None = "pt",
                 device: str | torch.device = "cpu") -> BatchFeature:
        """Features of one waveform (1-D) or a batch (list of 1-D, or 2-D), as ``.input_features``."""
        if sampling_rate is not None and sampling_rate != self.sampling_rate:
            raise ValueError(f"the audio is sampled at {sampling_rate} Hz but Whisper needs {self.sampling_rate} Hz; "
                             f"resample it first: kvgen.audio.resample(waveform, {sampling_rate}, "
                             f"{self.sampling_rate}).")
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors={return_tensors!r} is not supported; kvgen returns torch tensors "
                             "(return_tensors='pt').")
        waveforms = _as_waveforms(raw_speech)
        batch = torch.full((len(waveforms), self.n_samples), self.padding_value, dtype=torch.float32)
        for row, waveform in zip(batch, waveforms):
            length = min(waveform.shape[0], self.n_samples)
            row[:length] = waveform[:length]
        return BatchFeature(input_features=self.log_mel(batch.to(device)))

    def log_mel(self, waveform: torch.Tensor) -> torch.Tensor:
        """(batch, samples) float32 -> (batch, feature_size, samples // hop_length) log-mel features."""
        window = torch.hann_window(self.n_fft, device=waveform.device)
        stft = torch.stft(waveform, self.n_fft, self.hop_length, window=window, return_complex=True)  # (B, bins, T+1)
        power = (stft[..., :-1].abs() ** 2).contiguous()  # (B, bins, T): the last frame is dropped
        mel = self.mel_filters.to(waveform.device, torch.float32).T @ power  # (B, mels, T)
        log_spec = torch.clamp(mel, min=1e-10).log10()
        peak = log_spec.amax(dim=(1, 2), keepdim=True)  # (B, 1, 1): each example's own 8-decade range
        return (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0


# -- processor -------------------------------------------------------------------------------------------

# Whisper's language codes and names (the tokenizer holds the code as a token, e.g. "<|en|>").
_LANGUAGE_NAMES = dict(pair.split(":") for pair in (
    "en:english zh:chinese de:german es:spanish ru:russian ko:korean fr:french ja:japanese pt:portuguese "
    "tr:turkish pl:polish ca:catalan nl:dutch ar:arabic sv:swedish it:italian id:indonesian hi:hindi fi:finnish "
    "vi:vietnamese he:hebrew uk:ukrainian el:greek ms:malay cs:czech ro:romanian da:danish hu:hungarian ta:tamil "
    "no:norwegian th:thai ur:urdu hr:croatian bg:bulgarian lt:lithuanian la:latin mi:maori ml:malayalam cy:welsh "
    "sk:slovak te:telugu fa:persian lv:latvian bn:bengali sr:serbian az:azerbaijani sl:slovenian kn:kannada "
    "et:estonian mk:macedonian br:breton eu:basque is:icelandic hy:armenian ne:nepali mn:mongolian bs:bosnian "
    "kk:kazakh sq:albanian sw:swahili gl:galician mr:marathi pa:punjabi si:sinhala km:khmer sn:shona yo:yoruba "
    "so:somali af:afrikaans oc:occitan ka:georgian be:belarusian tg:tajik sd:sindhi gu:gujarati am:amharic "
    "yi:yiddish lo:lao uz:uzbek fo:faroese ht:haitian_creole ps:pashto tk:turkmen nn:nynorsk mt:maltese "
    "sa:sanskrit lb:luxembourgish my:myanmar bo:tibetan tl:tagalog mg:malagasy as:assamese tt:tatar haw:hawaiian "
    "ln:lingala ha:hausa ba:bashkir jw:javanese su:sundanese yue:cantonese").split())
_LANGUAGE_CODES = {name.replace("_", " "): code for code, name in _LANGUAGE_NAMES.items()}


class WhisperProcessor:
    """Feature extractor plus tokenizer of a Whisper model, as transformers' ``WhisperProcessor``.

    Example:
        >>> processor = WhisperProcessor.from_pretrained(whisper_tiny_en_dir())  # doctest: +SKIP
        >>> features = processor(load_audio("speech.wav"), sampling_rate=16000,
        ...                      return_tensors="pt").input_features  # doctest: +SKIP
        >>> processor.get_decoder_prompt_ids(task="transcribe", language="en")  # doctest: +SKIP
        [(1, 50258), (2, 50358), (3, 50362)]
        >>> processor.batch_decode(generated_ids, skip_special_tokens=True)  # doctest: +SKIP
        [' The quick brown fox jumps over the lazy dog.']
    """

    def __init__(self, feature_extractor: WhisperFeatureExtractor, tokenizer: PreTrainedTokenizerFast):
        self.feature_extractor, self.tokenizer = feature_extractor, tokenizer
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):  # Whisper's are all <|endoftext|>
            if getattr(tokenizer, name) is None and tokenizer.convert_tokens_to_ids("<|endoftext|>") is not None:
                setattr(tokenizer, name, "<|endoftext|>")

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "WhisperProcessor":
        """From a Whisper folder (HF or CTranslate2): ``tokenizer.json``, optional ``preprocessor_config.json``."""
        return cls(WhisperFeatureExtractor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))

    def __call__(self, audio: Any = None, sampling_rate: int | None = None, return_tensors: str | None = "pt",
                 text: str | list[str] | None = None) -> BatchFeature:
        """Features of ``audio`` as ``input_features``; token ids of ``text`` as ``labels`` (or ``input_ids``)."""
        if audio is None and text is None:
            raise ValueError("pass audio= (a waveform at 16 kHz) and/or text= to the processor")
        out = BatchFeature()
        if audio is not None:
            out.update(self.feature_extractor(audio, sampling_rate=sampling_rate, return_tensors=return_tensors))
        if text is not None:
            ids = self.tokenizer(text, return_tensors=return_tensors).input_ids
            out["labels" if audio is not None else "input_ids"] = ids
        return out

    def _token_id(self, token: str, what: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None:
            raise ValueError(f"this tokenizer has no {token} token, so {what} is not available for this model")
        return token_id

    def get_decoder_prompt_ids(self, task: str | None = None, language: str | None = None,
                               no_timestamps: bool = True) -> list[tuple[int, int]]:
        """Forced ``(position, token id)`` pairs after ``<|startoftranscript|>``: language, task, no-timestamps.

        ``language`` is a code ("en"), a name ("english") or a token ("<|en|>"); ``task`` is
        "transcribe" or "translate".
        """
        forced = []
        if language is not None:
            code = language.lower().strip("<|>")
            code = _LANGUAGE_CODES.get(code, code)
            if code not in _LANGUAGE_NAMES:
                raise ValueError(f"unsupported language {language!r}; pass a Whisper language code such as 'en', "
                                 f"'de' or 'fr' (one of {', '.join(_LANGUAGE_NAMES)}), or its English name.")
            forced.append(self._token_id(f"<|{code}|>", f"language {language!r}"))
        if task is not None:
            if task not in ("transcribe", "translate"):
                raise ValueError(f"unsupported task {task!r}; use 'transcribe' or 'translate'")
            forced.append(self._token_id(f"<|{task}|>", f"task {task!r}"))
        if no_timestamps:
            forced.append(self._token_id("<|notimestamps|>", "no_timestamps"))
        return [(position + 1, token_id) for position, token_id in enumerate(forced)]

    def decode(self, token_ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
        """Text of one sequence of token ids."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]] | torch.Tensor,
                     skip_special_tokens: bool = False) -> list[str]:
        """Text of each sequence, e.g. of ``model.generate(input_features)``."""
        return self.tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)
