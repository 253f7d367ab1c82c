"""Offloaded vs on-device caches on a GPU: identical greedy output, peak GPU memory, speed.

For a long prompt, runs greedy ``generate()`` with the ``dynamic``, ``offloaded``,
``static`` and ``offloaded_static`` caches and reports, per cache: whether the tokens equal
those of its on-device counterpart, the peak GPU memory above the weights
(``torch.cuda.max_memory_allocated``), the cache's bytes, prefill time and decode tokens/s.
Prints a table and writes JSON to ``$OUT/offload_gpu.json`` (when ``$OUT`` is set) or
``benchmarks/results/offload_gpu.json``.

    python benchmarks/offload_gpu.py                          # random Llama, 16 layers, 16k-token prompt
    python benchmarks/offload_gpu.py --model path/to/checkpoint --dtype bfloat16 --prompt-length 8192
    python benchmarks/offload_gpu.py --device cpu --dtype float32 --hidden-size 256 --layers 4 \\
        --prompt-length 256 --new-tokens 4 --out /tmp                  # smoke run, no GPU

Static caches run their decode step eagerly here (``disable_compile=True``) so that both
pairs are compared on the same footing; offloaded layers always run eagerly.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import kvgen
from kvgen.config import PretrainedConfig

CACHES = [("dynamic", None), ("offloaded", "dynamic"), ("static", None), ("offloaded_static", "static")]


def random_model(layers: int, hidden: int, device, dtype) -> kvgen.LlamaForCausalLM:
    """A random Llama with grouped KV heads (head_dim 128, 4 query heads per KV head), default init."""
    heads = max(hidden // 128, 4)
    config = PretrainedConfig(model_type="llama", hidden_size=hidden, num_attention_heads=heads,
                              num_key_value_heads=max(heads // 4, 1), head_dim=128, num_hidden_layers=layers,
                              intermediate_size=hidden * 11 // 4, vocab_size=32000,
                              max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = kvgen.LlamaForCausalLM(config)
    model.init_buffers(device)
    return model.to(dtype).eval().requires_grad_(False)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """A streamer that timestamps the prompt and every new token (``put`` gets tokens already on the host)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, tokens):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run(model, ids, cache_implementation, new_tokens, device):
    """(sequences, prefill seconds, decode tokens/s, peak bytes above the baseline or None, cache bytes)."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    clock = Clock()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, cache_implementation=cache_implementation,
                         disable_compile=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
                         streamer=clock)
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    first, last = clock.times[1], clock.times[-1]  # times[0]: the prompt
    decode = ids.shape[0] * (len(clock.times) - 2) / (last - first) if last > first else float("nan")
    return out.sequences, first - start, decode, peak, out.past_key_values.nbytes()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random", help="'random' or a checkpoint folder / GGUF file")
    parser.add_argument("--layers", type=int, default=16, help="layers of the random model")
    parser.add_argument("--hidden-size", type=int, default=2048, help="hidden size of the random model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--prompt-length", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", default=None, help="folder for offload_gpu.json (default: $OUT or benchmarks/results)")
    args = parser.parse_args(argv)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.model == "random":
        model = random_model(args.layers, args.hidden_size, device, dtype)
    else:
        model = kvgen.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map=str(device))
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.prompt_length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    for name, _ in CACHES:  # warm-up at the full length: the first attention of a new length picks its kernels
        run(model, ids, name, 2, device)

    rows, sequences = [], {}
    for name, reference in CACHES:
        seq, prefill, decode, peak, kv_bytes = run(model, ids, name, args.new_tokens, device)
        sequences[name] = seq
        rows.append({
            "cache": name,
            "same_tokens_as": reference,
            "same_tokens": None if reference is None else bool(torch.equal(seq, sequences[reference])),
            "peak_gpu_bytes_above_weights": peak,
            "cache_bytes": kv_bytes,
            "prefill_s": round(prefill, 4),
            "decode_tokens_per_s": round(decode, 2),
        })

    print(f"{'cache':18} {'same tokens':>12} {'peak GPU MiB':>13} {'cache MiB':>10} {'prefill s':>10} "
          f"{'decode tok/s':>13}")
    for r in rows:
        same = "-" if r["same_tokens"] is None else ("yes" if r["same_tokens"] else "NO")
        peak_bytes = r["peak_gpu_bytes_above_weights"]
        peak = "n/a" if peak_bytes is None else f"{peak_bytes / 2**20:.1f}"
        print(f"{r['cache']:18} {same:>12} {peak:>13} {r['cache_bytes'] / 2**20:>10.1f} {r['prefill_s']:>10.3f} "
              f"{r['decode_tokens_per_s']:>13.2f}")

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__, "model": args.model, "layers": model.config.num_hidden_layers,
        "dtype": args.dtype, "prompt_length": args.prompt_length, "new_tokens": args.new_tokens,
        "batch": args.batch, "rows": rows,
    }
    folder = Path(args.out or os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "offload_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {folder / 'offload_gpu.json'}")
    return result


if __name__ == "__main__":
    main()
