"""Decode and prefill speed of SmolLM2-135M in each weight format kvgen runs: the roofline, and float32's prefill.

Settings: ``float32`` (the packaged GGUF dequantized, ``default_model_dir()``), ``bfloat16`` (that checkpoint saved
in bfloat16, once, into the benchmark's cache, and loaded with ``dtype="auto"``: BF16 rows), ``int8`` and ``int4-g32``
/ ``int4-g64`` quantized at load (lm_head in float32, as transformers quantizes), and ``gguf`` (the file in its stored
types, Q4_1 + Q8_0). For each thread count the settings take turns in fresh processes, ``--rounds`` times:

* prefill: 512 tokens, the best of 3 after an untimed one, each into a fresh cache;
* decode: 64 steps at batch 1 after that prompt and 8 untimed steps, random tokens, every step's logits;
* the roofline: the bytes a step reads (stored weights, plus the keys and values attended to) over the rate at
  which the worker reads a buffer of as many bytes (``vs_llamacpp.read_bandwidth``), read on either side of the
  steps (the higher of the two).

Prints and writes (``benchmarks/results/weight_speed.json``) the medians over rounds: decode tok/s, its share of the
roofline, prefill tok/s and its ratio to float32's in the same rounds.

    python benchmarks/weight_speed.py                       # 1 and 2 threads, 3 rounds
    python benchmarks/weight_speed.py --threads 2 --rounds 1 --out /tmp/w
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import CACHE, _cpu, _timed, attended_kv_bytes, read_bandwidth  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ("float32", "bfloat16", "int8", "int4-g32", "int4-g64", "gguf")
PROMPT, STEPS, WARMUP = 512, 64, 8


def bf16_checkpoint() -> Path:
    """The packaged model's float32 checkpoint saved in bfloat16 (once, into the benchmark's cache)."""
    import torch
    from safetensors.torch import load_file, save_file

    from kvgen.loading.default_model import default_model_dir

    folder = CACHE.parent / "smollm2-bf16"
    if not (folder / "model.safetensors").exists():
        source = default_model_dir()
        folder.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            if path.name != "model.safetensors":
                shutil.copy(path, folder / path.name)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=1))
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(source / "model.safetensors").items()}
        save_file(tensors, folder / "model.safetensors.tmp", metadata={"format": "pt"})
        os.replace(folder / "model.safetensors.tmp", folder / "model.safetensors")
    return folder


def load(setting: str):
    import torch

    from kvgen import AutoModelForCausalLM, TorchAoConfig
    from kvgen.loading.default_model import default_gguf_path, default_model_dir

    if setting == "gguf":
        return AutoModelForCausalLM.from_pretrained(default_gguf_path())
    if setting == "bfloat16":
        return AutoModelForCausalLM.from_pretrained(bf16_checkpoint(), dtype="auto")
    config = None
    if setting == "int8":
        config = TorchAoConfig("int8_weight_only")
    elif setting.startswith("int4-g"):
        config = TorchAoConfig("int4_weight_only", group_size=int(setting.removeprefix("int4-g")))
    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32, quantization_config=config)


def worker(setting: str, threads: int) -> dict:
    """In a fresh process: prefill and decode rates, the bytes of a decode step and the read bandwidth around it."""
    import torch

    torch.set_num_threads(threads)
    from kvgen import DynamicCache

    m = load(setting)
    ids = torch.randint(100, 30000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(100, 30000, (1, STEPS + WARMUP), generator=torch.Generator().manual_seed(1))
    stored = [*m.parameters(), *(b for b in m.buffers() if b.dtype == torch.uint8)]  # as vs_llamacpp.py counts
    weights = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in stored}.values())  # tied: once
    with torch.no_grad():
        m(ids, past_key_values=DynamicCache(), logits_to_keep=1)
        prefill = PROMPT / min(_timed(lambda: m(ids, past_key_values=DynamicCache(), logits_to_keep=1))
                               for _ in range(3))
        cache = DynamicCache()
        m(ids, past_key_values=cache, logits_to_keep=1)
        step_bytes = weights + attended_kv_bytes(m, cache, PROMPT + WARMUP + STEPS / 2)
        probe = torch.ones(int(step_bytes) // 4)
        bandwidths = [read_bandwidth(probe)]
        for i in range(WARMUP):
            m(tokens[:, i:i + 1], past_key_values=cache)
        start = time.perf_counter()
        for i in range(WARMUP, STEPS + WARMUP):
            m(tokens[:, i:i + 1], past_key_values=cache)
        decode = STEPS / (time.perf_counter() - start)
        bandwidths.append(read_bandwidth(probe))
    return {"weight_format": m.weight_format, "prefill_tok_s": prefill, "decode_tok_s": decode,
            "step_bytes": step_bytes, "read_bandwidth": max(bandwidths),
            "roofline": step_bytes * decode / max(bandwidths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--worker", nargs=2, metavar=("SETTING", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    settings = args.settings.split(",")
    if "bfloat16" in settings:
        bf16_checkpoint()  # written once, outside the timed workers
    rows = []
    for threads in map(int, args.threads.split(",")):
        runs = {setting: [] for setting in settings}
        for _ in range(args.rounds):  # settings alternating, fresh processes
            for setting in settings:
                out = subprocess.run([sys.executable, __file__, "--worker", setting, str(threads)],
                                     capture_output=True, text=True, check=True).stdout
                runs[setting].append(json.loads(out.splitlines()[-1]))
        for setting in settings:
            row = {"setting": setting, "threads": threads, "weight_format": runs[setting][0]["weight_format"],
                   **{key: statistics.median(r[key] for r in runs[setting])
                      for key in ("prefill_tok_s", "decode_tok_s", "step_bytes", "read_bandwidth", "roofline")},
                   "rounds": runs[setting]}
            if "float32" in runs:  # each round's ratio to float32's prefill in that round
                row["prefill_vs_float32"] = statistics.median(
                    r["prefill_tok_s"] / f["prefill_tok_s"] for r, f in zip(runs[setting], runs["float32"]))
            rows.append(row)
            print(f"t={threads} {setting:9s} {row['weight_format']:9s} decode {row['decode_tok_s']:6.1f} tok/s "
                  f"({row['roofline']:.0%} of {row['step_bytes'] / 1e6:.0f} MB at "
                  f"{row['read_bandwidth'] / 1e9:.1f} GB/s), prefill {row['prefill_tok_s']:5.0f} tok/s"
                  + (f" ({row['prefill_vs_float32']:.2f}x float32)" if "prefill_vs_float32" in row else ""),
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"cpu": _cpu(), "load_average": os.getloadavg(), "prompt": PROMPT, "steps": STEPS, "rows": rows}
    (out / "weight_speed.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
