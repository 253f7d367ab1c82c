"""Memory of copy-free prefix forks against ``copy.deepcopy``, on the real SmolLM2-135M.

A ``--prefix``-token KJV passage is prefilled once; ``--forks`` continuations of
``--new-tokens`` greedy tokens each then run on (a) ``cache.fork(n)`` and (b) n deep copies.
Memory is the distinct storage behind every tensor of the n caches (a shared prefix counts
once), against one cache that continued alone. Each fork's tokens must equal its deepcopy
twin's. Writes ``benchmarks/results/fork_memory.json``.

    python benchmarks/fork_memory.py            # 2048-token prefix, 8 forks, 32 new tokens each
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized_quality import kjv_ids  # noqa: E402

import kvgen  # noqa: E402
from kvgen.cache.fork import unique_nbytes  # noqa: E402
from kvgen.loading.default_model import default_model_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def continue_greedy(model, cache, first: int, steps: int) -> list[int]:
    """Feed ``first`` then ``steps - 1`` greedy tokens through ``cache``; return the tokens fed."""
    tokens = [first]
    for _ in range(steps - 1):
        logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache).logits
        tokens.append(int(logits[0, -1].argmax()))
    model(torch.tensor([[tokens[-1]]]), past_key_values=cache)
    return tokens


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--forks", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "fork_memory.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = default_model_dir()
    model = kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = kvgen.AutoTokenizer.from_pretrained(folder)
    prefix = kjv_ids(tokenizer, args.prefix)[None]  # (1, P)

    with torch.no_grad():
        cache = kvgen.DynamicCache()
        model(prefix, past_key_values=cache)
        single = copy.deepcopy(cache)
        continue_greedy(model, single, 100, args.new_tokens)
        copies = [copy.deepcopy(cache) for _ in range(args.forks)]
        forks = cache.fork(args.forks)
        starts = [100 + 37 * i for i in range(args.forks)]  # a different first token per continuation
        for fork, twin, start in zip(forks, copies, starts):
            assert continue_greedy(model, fork, start, args.new_tokens) == \
                continue_greedy(model, twin, start, args.new_tokens)
    one = unique_nbytes(single)
    result = {"model": "SmolLM2-135M-Instruct float32", "prefix_tokens": args.prefix, "forks": args.forks,
              "new_tokens_each": args.new_tokens, "single_cache_mb": round(one / 2**20, 1),
              "forks_mb": round(unique_nbytes(*forks) / 2**20, 1), "deepcopies_mb": round(unique_nbytes(*copies) / 2**20, 1),
              "forks_vs_single": round(unique_nbytes(*forks) / one, 3),
              "deepcopies_vs_single": round(unique_nbytes(*copies) / one, 3), "outputs_equal": True}
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
