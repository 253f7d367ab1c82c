"""Tensor parallelism on this CPU: 2 ranks of 1 thread (gloo, torchrun) against 1 process of 2 threads.

For each model, the two sides alternate in fresh processes, ``--rounds`` times; each measures, after a warm-up:

* prefill: ``--prompt`` (256) random tokens, the best of 3;
* decode: ``--new`` (64) greedy tokens after that prompt, batch 1 (``generate``'s rate after its first token);
* the communication share (ranks only): the time rank 0 spends in the all-reduces (one after attention and one
  after the MLP of every layer: the transfer, and the wait for the other rank) over the step's time.

The models: the packaged Qwen2.5-Coder-0.5B-Instruct GGUF (``coder``, its stored formats; SmolLM2's 9 heads do not
split over 2 ranks) and a random-weight float32 Llama in Llama 3.2 1B's shape (``llama-1b``, written once into
``~/.cache/kvgen-bench/models``). Writes ``benchmarks/results/tp.json`` with the CPU, its vector extensions and the
load.

    python benchmarks/tp.py                        # coder, llama-1b; 2 rounds
    python benchmarks/tp.py --models coder --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_llamacpp import _cpu, _cpu_flags  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CACHE = Path(os.environ.get("KVGEN_BENCH_CACHE", Path.home() / ".cache" / "kvgen-bench")) / "models"
#: Llama 3.2 1B's published config
LLAMA_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                hidden_act="silu", bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def llama_1b() -> Path:
    """The random float32 Llama 3.2 1B-shaped folder (~5 GB), written on first use."""
    import torch
    from safetensors.torch import save_file

    folder = CACHE / "llama-1b-random-f32"
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    c, g = LLAMA_1B, torch.Generator().manual_seed(0)
    h, kv, inter = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    state = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02) for n, s in shapes.items()}
    save_file(state, str(folder / "model.safetensors.tmp"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(c))
    os.replace(folder / "model.safetensors.tmp", folder / "model.safetensors")
    return folder


def model_path(name: str) -> str:
    if name == "coder":
        from kvgen.loading.default_model import coder_gguf_path

        return str(coder_gguf_path())
    if name == "llama-1b":
        return str(llama_1b())
    raise ValueError(f"unknown model {name!r}: coder or llama-1b")


def worker(path: str, prompt: int, new: int) -> None:
    """One side's measurement (a rank of torchrun's where WORLD_SIZE is set); rank 0 prints one JSON line."""
    import torch

    from kvgen import AutoModelForCausalLM
    from kvgen.models.decode_blocks import eager_blocks

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(2 // ranks)
    dtype = None if path.endswith(".gguf") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, tp_plan="auto" if ranks > 1 else None)
    spent = [0.0]
    if ranks > 1:  # the all-reduces' time on this rank
        from kvgen.tensor_parallel import AllReduced

        def timed(self, x):
            y = self.inner(x)
            start = time.perf_counter()
            torch.distributed.all_reduce(y, group=self.group)
            spent[0] += time.perf_counter() - start
            return y

        AllReduced.forward = timed
    ids = torch.randint(1000, 20000, (1, prompt), generator=torch.Generator().manual_seed(0))
    with eager_blocks(), torch.no_grad():
        model(ids[:, :32])  # warm-up
        prefill = []
        for _ in range(3):
            spent[0], start = 0.0, time.perf_counter()
            model(ids)
            prefill.append((time.perf_counter() - start, spent[0]))
        stamps = []

        class Clock:
            def put(self, value):
                stamps.append((time.perf_counter(), spent[0]))

            def end(self):
                pass

        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=Clock())
    best = min(prefill)
    (t0, c0), (t1, c1) = stamps[1], stamps[-1]  # the first new token's stamp to the last
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"prefill_tok_s": prompt / best[0], "prefill_comm_share": best[1] / best[0],
                          "decode_tok_s": (len(stamps) - 2) / (t1 - t0), "decode_comm_share": (c1 - c0) / (t1 - t0),
                          "weight_format": model.weight_format}), flush=True)
    if ranks > 1:
        torch.distributed.destroy_process_group()


def run_side(path: str, ranks: int, prompt: int, new: int) -> dict:
    me = [str(Path(__file__).resolve()), "--worker", path, "--prompt", str(prompt), "--new", str(new)]
    if ranks == 1:
        command = [sys.executable, *me]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *me]
    env = {**os.environ, "OMP_NUM_THREADS": str(2 // ranks)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{ranks} rank(s) on {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="coder,llama-1b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "tp.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.prompt, args.new)
    load_before, rows = os.getloadavg()[0], []
    for name in args.models.split(","):
        path = model_path(name)
        sides = {"1 process x 2 threads": [], "2 ranks x 1 thread": []}
        for _ in range(args.rounds):  # alternating
            for label, ranks in (("1 process x 2 threads", 1), ("2 ranks x 1 thread", 2)):
                sides[label].append(run_side(path, ranks, args.prompt, args.new))
        row = {"model": name, "file": Path(path).name, "sides": sides}
        for key in ("prefill_tok_s", "decode_tok_s"):
            one, two = (statistics.median(r[key] for r in sides[s]) for s in sides)
            row[key.replace("_tok_s", "_ratio")] = two / one
        rows.append(row)
        comm = sides["2 ranks x 1 thread"][-1]
        print(f"{name} ({comm['weight_format']}): prefill {row['prefill_ratio']:.2f}x, "
              f"decode {row['decode_ratio']:.2f}x with 2 ranks; communication {comm['prefill_comm_share']:.0%} of prefill, "
              f"{comm['decode_comm_share']:.0%} of decode", flush=True)
    out = {"cpu": _cpu(), "cpu_flags": _cpu_flags(), "load_before": load_before, "load_after": os.getloadavg()[0],
           "date": time.strftime("%Y-%m-%d %H:%M"), "prompt": args.prompt, "new": args.new, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
