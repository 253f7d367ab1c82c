"""Tensor parallelism with gloo and 2 processes (torchrun) on this CPU: logits within 1e-4 of the single process
and the same greedy tokens (``generate()`` with every cache type that fits, and the batching engine), for Llama,
Qwen2 (biases; one key/value head, replicated on both ranks), Gemma 3 (sliding layers, per-head norms) and a GGUF
in its stored blocks; each rank's cache holds its own heads. ``kvgen generate --tp`` and ``kvgen serve --tp``
start the ranks themselves. Bad setups fail on every rank with a clear error, and a rank that dies makes the run
fail instead of hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from test_loading import CFG, _random_llama_state, _write_llama_gguf

from kvgen import AutoModelForCausalLM
from kvgen.models.decode_blocks import eager_blocks
from tp_worker import BATCH, CACHE_CONFIGS, caches_of
from kvgen.tensor_parallel import TensorParallelError, split_heads

HERE = Path(__file__).parent
PROMPT = torch.tensor([[1, 5, 9, 13, 7, 3, 22, 40, 2, 17, 30, 11]])
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Random checkpoints written by transformers (Llama, Qwen2, Gemma 3 folders) and a Llama GGUF in Q4_0 (run in
    its stored blocks, split on block boundaries; tiles of 16 rows where this CPU takes them)."""
    root = tmp_path_factory.mktemp("tp")
    torch.manual_seed(0)
    models = {
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **SMALL, num_attention_heads=4, num_key_value_heads=2)),
        "qwen2": transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **SMALL, num_attention_heads=4, num_key_value_heads=1)),
        "gemma3": transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"])),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
    paths = {name: str(root / name) for name in models}
    cfg = dict(CFG, inter=128)  # each rank's half of the MLP: whole blocks of 32
    _write_llama_gguf(root / "llama-q4_0.gguf", _random_llama_state(False, cfg), gguf.GGMLQuantizationType.Q4_0,
                      cfg=cfg)
    return {**paths, "gguf": str(root / "llama-q4_0.gguf")}


def torchrun(out: Path, *folders: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(HERE / "tp_worker.py"), str(out), *folders], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_two_ranks_give_the_single_process_logits_and_tokens_in_generate_and_the_engine(folders, tmp_path):
    run = torchrun(tmp_path, *folders.values())
    assert run.returncode == 0, run.stderr[-3000:]
    for name, folder in folders.items():
        split = torch.load(tmp_path / f"{Path(folder).name}.pt")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=None if name == "gguf" else torch.float32)
        heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        assert split["heads"] == (heads // 2, max(kv_heads // 2, 1)), name  # each rank's cache: its own heads
        torch.testing.assert_close(split["logits"], model(PROMPT).logits, atol=1e-4, rtol=0)
        for cache in caches_of(Path(folder).name):  # every cache type, each rank's holding its own heads
            with eager_blocks():  # as the ranks run them
                expected = model.generate(PROMPT, max_new_tokens=12, do_sample=False, cache_implementation=cache,
                                          cache_config=CACHE_CONFIGS.get(cache))
            assert split[cache].tolist() == expected.tolist(), (name, cache)
        batch = model.generate_batch(BATCH, max_new_tokens=10, do_sample=False, eos_token_id=[])
        assert split["batch"] == {rid: out.generated_tokens for rid, out in batch.items()}, name


def test_ranks_on_different_models_fail_with_a_clear_error(folders, tmp_path):
    """Rank 0 loads Llama, rank 1 Qwen2 (the worker puts its rank in the folder's name)."""
    llama, qwen2 = Path(folders["llama"]), Path(folders["qwen2"])
    (tmp_path / "m.rank0").symlink_to(llama)
    (tmp_path / "m.rank1").symlink_to(qwen2)
    run = torchrun(tmp_path, str(tmp_path / "m.rank{rank}"))
    assert run.returncode != 0
    assert "loaded another model than rank 0" in run.stderr


def test_a_rank_that_dies_mid_decode_fails_the_run_instead_of_hanging(folders, tmp_path):
    start = time.monotonic()
    run = torchrun(tmp_path, folders["llama"], env={"KVGEN_TEST_DIE_AT": "4", "KVGEN_TP_TIMEOUT": "30"})
    assert run.returncode != 0 and time.monotonic() - start < 120
    assert not (tmp_path / "llama.pt").exists()


@pytest.mark.parametrize("heads,kv_heads,ranks,message", [
    (9, 3, 2, "9 attention heads do not split over 2 ranks"),
    (12, 3, 4, "3 key/value heads do not split over 4 ranks"),
])
def test_heads_that_do_not_split_are_refused(heads, kv_heads, ranks, message):
    with pytest.raises(TensorParallelError, match=message):
        split_heads(heads, kv_heads, ranks, 0)


def test_key_value_heads_are_replicated_on_the_ranks_whose_queries_read_them():
    assert [split_heads(8, 2, 4, r) for r in range(4)] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)), (range(4, 6), range(1, 2)), (range(6, 8), range(1, 2))]
    assert split_heads(16, 8, 2, 1) == (range(8, 16), range(4, 8))


def test_tp_plan_outside_torchrun_says_how_to_start_the_ranks(folders, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(TensorParallelError, match="runs under torchrun"):
        AutoModelForCausalLM.from_pretrained(folders["llama"], dtype=torch.float32, tp_plan="auto")


def test_stored_blocks_split_only_on_their_boundaries():
    import numpy as np

    from kvgen.kernels import kernels_available
    from kvgen.models.packed import PackedWeight
    from kvgen.models.quantized_linear import QuantizedLinear
    from kvgen.tensor_parallel import _columns

    assert kernels_available()  # (loads the products' ops)
    raw = gguf.quants.quantize(np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32),
                               gguf.GGMLQuantizationType.Q8_0)
    layer = QuantizedLinear(PackedWeight([(8, torch.from_numpy(raw))], in_features=64))
    half = _columns(layer, range(32, 64), bias=False)
    x = torch.randn(3, 64)
    torch.testing.assert_close(half(x[:, 32:]), x[:, 32:] @ layer.weight.dequantize()[:, 32:].T, atol=1e-4, rtol=1e-4)
    with pytest.raises(TensorParallelError, match="cannot be split at feature 48"):
        _columns(layer, range(0, 48), bias=False)


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """A small random Llama with SmolLM2's tokenizer (its vocabulary's size): what the command line needs."""
    import shutil

    from kvgen.loading.default_model import default_model_dir

    folder = tmp_path_factory.mktemp("tp-tokenizer")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**SMALL, "vocab_size": 49152}, num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
        eos_token_id=2)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, folder / name)
    return folder


def test_kvgen_generate_tp_starts_the_ranks_and_prints_the_single_process_text(with_tokenizer, capfd, monkeypatch):
    """``kvgen generate --tp 2``: rank 0 prints what one process prints, and its stats show its cache holding
    half the heads."""
    from kvgen.cli import main

    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")  # the single process as the ranks run: eager blocks
    outputs = []
    for tp in ([], ["--tp", "2"]):
        assert main(["generate", *tp, "-m", str(with_tokenizer), "-n", "8", "-p", "The sea"]) == 0
        text, stats = capfd.readouterr().out.rstrip("\n").rsplit("\n", 1)
        outputs.append((text, int(stats.rsplit("cache_bytes=", 1)[1])))
    (single, single_bytes), (split, split_bytes) = outputs
    assert split == single and single.startswith("The sea")
    assert split_bytes == single_bytes // 2
    # sampled without --seed: kvgen gives every rank one seed (else they would draw different tokens), printed
    assert main(["generate", "--tp", "2", "-m", str(with_tokenizer), "-n", "8", "-p", "The sea", "--temp", "0.9"]) == 0
    text, stats = capfd.readouterr().out.rstrip("\n").rsplit("\n", 1)
    seed = stats.rsplit(" seed=", 1)[1].split()[0]
    assert main(["generate", "-m", str(with_tokenizer), "-n", "8", "-p", "The sea", "--temp", "0.9",
                 "--seed", seed]) == 0
    assert capfd.readouterr().out.rstrip("\n").rsplit("\n", 1)[0] == text


def test_the_mlp_splits_as_evenly_as_the_stored_blocks_allow():
    from kvgen.tensor_parallel import split_features

    assert split_features(4864, 2, 256) == [range(0, 2560), range(2560, 4864)]  # Qwen2.5-0.5B's Q6_K ffn_down
    assert split_features(96, 2) == [range(0, 48), range(48, 96)]
    with pytest.raises(TensorParallelError, match="use at most 2 ranks"):
        split_features(512, 3, 256)


def test_kvgen_serve_tp_answers_as_one_process_and_stops_every_rank(with_tokenizer, monkeypatch):
    """``kvgen serve --tp 2``: rank 0 serves HTTP and plans each step, rank 1 runs them; concurrent greedy
    completions are the single process's; SIGTERM stops every rank."""
    from concurrent.futures import ThreadPoolExecutor

    from test_server import Server

    from kvgen import AutoTokenizer
    from kvgen.cli import serving_kv_dtype

    monkeypatch.setenv("KVGEN_DISABLE_COMPILE", "1")
    model = AutoModelForCausalLM.from_pretrained(with_tokenizer, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(with_tokenizer)
    prompts = ["The sea", "Once upon a time", "1, 2, 3,"]
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, disable_compile=True,
                             cache_implementation="static", cache_config={"dtype": serving_kv_dtype(model)})
        expected.append(tokenizer.decode(out[0, ids.shape[1]:]))
    server = Server(with_tokenizer, "--tp", "2")
    try:
        client = server.client()
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda p: client.completions.create(
                model="tiny", prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}), prompts))
        assert [r.choices[0].text for r in replies] == expected
    finally:
        server.process.terminate()
        server.process.wait(timeout=120)
        server.log.close()
    left = subprocess.run(["pgrep", "-f", "--", f"--port {server.port}"], capture_output=True, text=True)
    assert left.returncode == 1, f"ranks still running: {left.stdout.split()} {left.stderr}"  # (1: none matched)
