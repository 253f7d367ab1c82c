"""One rank of the tensor-parallel tests (tests/test_tensor_parallel.py), started by torchrun: for each model folder
(or GGUF file) in argv (``{rank}`` in it replaced by the rank), load it split over the ranks, then write rank 0's
logits of a prompt, its greedy tokens (with each cache type that fits the model: :func:`caches_of`) and ``generate_batch``'s (the engine: rank 0
plans, every rank returns its outputs) to ``OUT/<file name>.pt``. ``KVGEN_TEST_DIE_AT``: rank 1 exits at that step
of the first decode."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kvgen import AutoModelForCausalLM

PROMPT = torch.tensor([[1, 5, 9, 13, 7, 3, 22, 40, 2, 17, 30, 11]])
#: settings of the cache types that need some (a window shorter than prompt + reply: tokens are evicted)
CACHE_CONFIGS = {"sink": {"window_length": 8, "num_sink_tokens": 2},
                 "static_sink": {"window_length": 8, "num_sink_tokens": 2}}


def caches_of(name: str) -> list[str]:
    """The cache types run on a model: every one that fits Llama's full attention or Gemma 3's sliding layers."""
    if name == "llama":
        return ["dynamic", "static", "offloaded", "offloaded_static", "quantized", "sink", "static_sink"]
    if name == "gemma3":
        return ["dynamic", "static", "hybrid", "sliding_window"]
    return ["dynamic", "static"]


BATCH = [[1, 5, 9, 13, 7], [3, 22, 40, 2, 17, 30, 11, 8, 9, 10, 12, 14, 15, 16, 18, 19, 20], [4, 4, 4]]


def main(out: Path, folders: list[str]) -> None:
    torch.set_num_threads(1)
    for folder in folders:
        folder = folder.replace("{rank}", os.environ["RANK"])  # ranks on different models, for the errors' test
        dtype = None if folder.endswith(".gguf") else torch.float32  # a GGUF's weights in their stored blocks
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, tp_plan="auto")
        die_at = int(os.environ.get("KVGEN_TEST_DIE_AT", "0"))
        if die_at and dist.get_rank() == 1:
            steps = []
            model.model.layers[0].register_forward_hook(lambda *_: steps.append(1) or (
                len(steps) == die_at and os._exit(3)))
        result = {"logits": model(PROMPT).logits,
                  **{cache: model.generate(PROMPT, max_new_tokens=12, do_sample=False, cache_implementation=cache,
                                           cache_config=CACHE_CONFIGS.get(cache))
                     for cache in caches_of(Path(folder).name)},
                  "heads": (model.config.num_attention_heads, model.config.num_key_value_heads),
                  "batch": {rid: out.generated_tokens for rid, out in model.generate_batch(
                      BATCH, max_new_tokens=10, do_sample=False, eos_token_id=[]).items()}}
        if dist.get_rank() == 0:
            torch.save(result, out / f"{Path(folder).name}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
