"""The ``kvgen`` command: ``generate`` (the main job), ``chat`` and ``bench``.

    kvgen generate                        # default model, default prompt, stats line
    kvgen generate "The sea" --cache static --max-new-tokens 50 --stream
    kvgen chat                            # multi-turn chat on one cache
    kvgen bench                           # kvgen vs transformers side by side
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPT = "Once upon a time, there was a little"


def load(model: str | None, dtype: str):
    """Model and tokenizer from a folder, hub id or .gguf file; the packaged default when None."""
    from kvgen import AutoModelForCausalLM
    from kvgen.tokenizer import AutoTokenizer

    if model is None:
        from kvgen.loading.default_model import default_model_dir

        model = str(default_model_dir())
    return (AutoModelForCausalLM.from_pretrained(model, dtype=dtype),
            AutoTokenizer.from_pretrained(model))


class _Clock:
    """A streamer that timestamps tokens (and prints them when ``echo`` is set)."""

    def __init__(self, tokenizer=None):
        self.text = None if tokenizer is None else _text_streamer(tokenizer)
        self.start = time.perf_counter()
        self.stamps: list[float] = []

    def put(self, value):
        if self.text is not None:
            self.text.put(value)
        self.stamps.append(time.perf_counter())

    def end(self):
        if self.text is not None:
            self.text.end()

    def prefill_seconds(self) -> float:
        return self.stamps[1] - self.start if len(self.stamps) > 1 else float("nan")

    def decode_tokens_per_second(self) -> float:
        new = len(self.stamps) - 1  # the first put is the prompt
        return (new - 1) / (self.stamps[-1] - self.stamps[1]) if new > 1 else float("nan")


def _text_streamer(tokenizer):
    from kvgen.generation.streamers import TextStreamer

    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def parse_cache_config(text: str) -> dict:
    """``"backend=kivi,nbits=2"`` -> ``{"backend": "kivi", "nbits": 2}`` (numbers and true/false converted)."""
    config = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"cache setting {item!r} is not KEY=VALUE (e.g. nbits=4)")
        value = value.strip()
        for convert in (int, float):
            try:
                value = convert(value)
                break
            except ValueError:
                pass
        else:
            value = {"true": True, "false": False}.get(value.lower(), value)
        config[key.strip()] = value
    return config


def _make_cache(model, name: str, cache_config, max_cache_len: int):
    from kvgen.cache import create_cache

    return create_cache(name, config=model.config, batch_size=1, max_cache_len=max_cache_len, device=model.device,
                        dtype=model.dtype, cache_config=cache_config)


def _stats_line(cache, prompt_tokens: int, new_tokens: int, clock: _Clock) -> str:
    return (f"[kvgen] cache={type(cache).__name__} prompt_tokens={prompt_tokens} new_tokens={new_tokens} "
            f"prefill_s={clock.prefill_seconds():.3f} decode_tok_per_s={clock.decode_tokens_per_second():.2f} "
            f"cache_bytes={cache.nbytes()}")


def cmd_generate(args) -> int:
    model, tokenizer = load(args.model, args.dtype)
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if args.chat:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    prompt_tokens = inputs["input_ids"].shape[1]
    cache = _make_cache(model, args.cache, args.cache_config, prompt_tokens + args.max_new_tokens)
    clock = _Clock(tokenizer if args.stream else None)
    out = model.generate(**inputs.to(model.device), past_key_values=cache, max_new_tokens=args.max_new_tokens,
                         do_sample=args.do_sample, temperature=args.temperature, streamer=clock)
    new = out[0, prompt_tokens:]
    if not args.stream:
        print(tokenizer.decode(new, skip_special_tokens=True))
    print(_stats_line(cache, prompt_tokens, new.shape[0], clock))
    return 0


def chat_turn(model, tokenizer, cache, messages: list[dict], max_new_tokens: int, streamer=None) -> str:
    """One assistant turn on a cache kept across turns; returns the reply.

    The conversation is rendered again with the chat template and ``generate()`` feeds only
    what the cache has not seen; where the template re-encodes an earlier reply differently,
    ``generate()`` first crops the cache to the tokens it shares with the new rendering.
    """
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True).to(model.device)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False,
                         streamer=streamer)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def cmd_chat(args) -> int:
    model, tokenizer = load(args.model, args.dtype)
    cache = _make_cache(model, args.cache, args.cache_config, args.max_cache_len)
    messages: list[dict] = []
    print("kvgen chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        clock = _Clock(tokenizer)
        reply = chat_turn(model, tokenizer, cache, messages, args.max_new_tokens, clock)
        messages.append({"role": "assistant", "content": reply})
        print(f"[kvgen] cache_tokens={cache.get_seq_length()} cache_bytes={cache.nbytes()} "
              f"decode_tok_per_s={clock.decode_tokens_per_second():.2f}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from kvgen.bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    from kvgen.cache import cache_implementations

    parser = argparse.ArgumentParser(prog="kvgen", description="Key-value-cached text generation")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--model", help="HF folder, hub id or .gguf file (default: packaged SmolLM2-135M-Instruct)")
        p.add_argument("--cache", default="dynamic", choices=cache_implementations(), help="cache implementation")
        p.add_argument("--cache-config", type=parse_cache_config, default=None, metavar="KEY=VALUE,...",
                       help="settings of the cache, e.g. backend=kivi,nbits=2 for --cache quantized")
        p.add_argument("--max-new-tokens", type=int, default=30)
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    g = sub.add_parser("generate", help="continue a prompt and print stats")
    g.add_argument("prompt", nargs="?", help=f"text to continue (default: {DEFAULT_PROMPT!r})")
    common(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=1.0)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that reuses one cache across turns")
    common(c)
    c.set_defaults(max_new_tokens=256)
    c.add_argument("--max-cache-len", type=int, default=4096, help="slots for preallocated caches")
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="kvgen and transformers side by side")
    b.add_argument("--model", help="HF folder (default: packaged SmolLM2-135M-Instruct, float32)")
    b.add_argument("--caches", default="dynamic,static",
                   help=f"comma-separated cache implementations ({', '.join(cache_implementations())})")
    b.add_argument("--cache-config", type=parse_cache_config, default=None, metavar="KEY=VALUE,...",
                   help="settings of the quantized or sink cache, e.g. backend=kivi,nbits=4")
    b.add_argument("--hf-cache-config", type=parse_cache_config, default=None, metavar="KEY=VALUE,...",
                   help="transformers' settings for the same cache (default: --cache-config), e.g. backend=quanto")
    b.add_argument("--prompts", default="512,4096")
    b.add_argument("--batches", default="1,4")
    b.add_argument("--new-tokens", type=int, default=32)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--implementations", default="kvgen,transformers")
    b.add_argument("--output", default="benchmarks/results/bench.json")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
