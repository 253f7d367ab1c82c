"""Perplexity of SmolLM2-135M with weights quantized at load (int8, int4 in groups of 32/64/128).

The float32 model is the packaged GGUF dequantized (``default_model_dir()``); each setting
quantizes its linear layers at load (``quantization_config=TorchAoConfig(...)``; lm_head stays float
unless the name says ``+lm_head``), and the GGUF
itself runs in its stored types (Q4_1 + Q8_0) as a check that stored-precision inference
loses nothing against its own dequantized weights. Mind the source: these float weights are
themselves a Q4_1 dequantization, whose 32-value blocks int4 groups of 32 can recover exactly
(the range search finds that grid), while groups of 64 straddle two blocks' grids. Perplexity over the first ``--tokens``
KJV tokens, fed through a dynamic cache 512 tokens at a time. Writes
``benchmarks/results/weight_quality.json``.

    python benchmarks/weight_quality.py                 # 4096 tokens
    python benchmarks/weight_quality.py --tokens 1024 --out /tmp/w
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized_quality import kjv_ids, perplexity  # noqa: E402

from kvgen import AutoModelForCausalLM, AutoTokenizer, DynamicCache, TorchAoConfig  # noqa: E402
from kvgen.loading.default_model import default_gguf_path, default_model_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = {
    "float32": None,
    "int8": TorchAoConfig("int8_weight_only"),
    "int4-g32": TorchAoConfig("int4_weight_only", group_size=32),
    "int4-g64": TorchAoConfig("int4_weight_only", group_size=64),
    "int8+lm_head": TorchAoConfig("int8_weight_only", modules_to_not_convert=[]),
    "int4-g32+lm_head": TorchAoConfig("int4_weight_only", group_size=32, modules_to_not_convert=[]),
}  # (groups of 128 do not divide SmolLM2's 576 hidden features: kvgen refuses them for this model)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = default_model_dir()
    ids = kjv_ids(AutoTokenizer.from_pretrained(folder), args.tokens)
    rows = {}
    for name, config in [*SETTINGS.items(), ("gguf-stored", "gguf")]:
        if config == "gguf":
            model = AutoModelForCausalLM.from_pretrained(default_gguf_path())
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=config)
        start = time.perf_counter()
        ppl, _ = perplexity(model, ids, DynamicCache(), prefill=512, chunk=512)
        unique = {t.data_ptr(): t for t in model.state_dict().values()}  # tied weights once
        weight_bytes = sum(t.numel() * t.element_size() for t in unique.values())
        rows[name] = {"perplexity": ppl, "weights": model.weight_format, "weight_bytes": weight_bytes,
                      "seconds": time.perf_counter() - start}
    base = rows["float32"]["perplexity"]
    for name, row in rows.items():
        row["vs_float32"] = row["perplexity"] / base - 1
        print(f"{name:10s} {row['weights']:10s} perplexity {row['perplexity']:.4f} ({row['vs_float32']:+.2%}) "
              f"weights {row['weight_bytes'] / 2**20:.0f} MiB")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_quality.json").write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
