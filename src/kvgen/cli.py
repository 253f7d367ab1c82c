"""The ``kvgen`` command: ``generate`` (the main job), ``chat``, ``transcribe``, ``bench`` and ``serve``.

    kvgen generate                        # default model, default prompt, stats line
    kvgen generate "The sea" --cache static --max-new-tokens 50
    kvgen generate -m model.gguf -p "The sea" -n 50 -t 2 --temp 0.8 --top-p 0.95   # llama.cpp's spellings
    kvgen chat                            # multi-turn chat on one cache
    kvgen transcribe speech.wav           # Whisper (packaged tiny.en unless --model)
    kvgen bench                           # kvgen vs transformers side by side
    kvgen serve --port 8000               # OpenAI-compatible server (pip install 'kvgen[serve]')
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
from pathlib import Path

from kvgen.generation.streamers import TextStreamer, TokenTimer

DEFAULT_PROMPT = "Once upon a time, there was a little"


def load(model: str | None, dtype: str | None, quantize: str | None = None, group_size: int = 32,
         device: str | None = None, tp_plan: str | None = None):
    """Model and tokenizer from a folder, hub id or .gguf file; the packaged default GGUF when None.

    ``dtype`` None keeps a GGUF's weights in their stored types (float checkpoints load in
    float32); ``quantize`` ("int8" / "int4") quantizes linear layers at load; ``device``: where
    the model runs (``device_map``; None: the CPU); ``tp_plan="auto"`` splits it over torchrun's ranks.
    """
    from kvgen import AutoModelForCausalLM, TorchAoConfig
    from kvgen.tokenizer import AutoTokenizer

    if model is None:
        from kvgen.loading.default_model import default_gguf_path

        model = str(default_gguf_path())
    if not Path(model).exists() and (model.endswith(".gguf") or model.startswith((".", "/", "~"))):
        raise FileNotFoundError(f"model path {model} does not exist")
    quantization = None if quantize is None else TorchAoConfig(f"{quantize}_weight_only", group_size=group_size)
    return (AutoModelForCausalLM.from_pretrained(model, dtype=dtype, quantization_config=quantization,
                                                 device_map=device, tp_plan=tp_plan),
            AutoTokenizer.from_pretrained(model))


def _text_streamer(tokenizer):
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


def _stats_line(model, cache, prompt_tokens: int, new_tokens: int, clock: TokenTimer, speculation=None,
                seed: int | None = None) -> str:
    from kvgen.bench import peak_rss_mb

    prefill = clock.prefill_seconds()
    drafts = "" if speculation is None else (f" drafted={speculation.drafted} "
                                             f"acceptance_rate={speculation.acceptance_rate:.2f}")
    return (f"[kvgen] cache={type(cache).__name__} prompt_tokens={prompt_tokens} new_tokens={new_tokens} "
            f"prefill_s={prefill:.4f} prompt_tok_per_s={prompt_tokens / prefill:.1f} "
            f"decode_tok_per_s={clock.decode_tokens_per_second():.2f} weights={model.weight_format} "
            f"peak_rss_mb={peak_rss_mb():.0f} cache_bytes={cache.nbytes()}{drafts}"
            f"{'' if seed is None else f' seed={seed}'}")


def _sampling(args) -> tuple[dict, int | None]:
    """``generate()``'s sampling settings from the options, and the seed it samples with (None: greedy).

    As llama.cpp's and mlx-lm's ``--temp``: a temperature above 0 samples and 0 is greedy; ``--top-k``,
    ``--top-p``, ``--min-p`` and ``--do-sample`` sample too. The seed is ``--seed``, else a fresh one
    (printed, to repeat a run).
    """
    import torch

    sampling = args.temperature != 0 and (args.do_sample or args.temperature is not None
                                          or any(v is not None for v in (args.top_k, args.top_p, args.min_p)))
    given = {"repetition_penalty": args.repeat_penalty}  # (a setting passed as None would turn it off)
    if sampling:
        given.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    settings = {"do_sample": sampling, **{name: value for name, value in given.items() if value is not None}}
    if not sampling:
        return settings, None
    seed = args.seed if args.seed is not None else torch.seed()
    torch.manual_seed(seed)
    return settings, seed


def _json_schema_format(path: str) -> dict:
    """The ``response_format`` of the JSON schema in the file ``path``; ValueError saying what is wrong with it."""
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"--json-schema {path}: not a readable JSON file ({error})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object ({{...}}), not {type(schema).__name__}")
    return {"type": "json_schema", "json_schema": {"name": Path(path).stem, "schema": schema}}


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def launch_ranks(ranks: int, argv: list[str], threads: int | None) -> int:
    """Run ``kvgen *argv`` as ``ranks`` processes under torchrun (this machine, a free port), the CPU's threads
    shared among them; SIGTERM is passed on to them. Returns torchrun's exit status (not 0 if a rank failed)."""
    import signal
    import subprocess

    per_rank = max(1, (threads or os.cpu_count() or 1) // ranks)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "--module", "kvgen.cli", *argv]
    ranks_process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": str(per_rank)})
    before = signal.signal(signal.SIGTERM, lambda *_: ranks_process.send_signal(signal.SIGTERM))  # (a drain)
    try:
        return ranks_process.wait()
    except KeyboardInterrupt:
        ranks_process.send_signal(signal.SIGINT)
        return ranks_process.wait()
    finally:
        signal.signal(signal.SIGTERM, before)


def _splits(args) -> bool:
    """Whether ``--tp`` splits the model over more than one process."""
    return (args.tp or 1) > 1


def _tensor_parallel(args) -> tuple[str | None, bool]:
    """(``tp_plan`` for the load, whether this process prints) of ``--tp``, under torchrun."""
    if not _splits(args):
        return None, True
    world = int(os.environ["WORLD_SIZE"])
    if world != args.tp:
        raise ValueError(f"--tp {args.tp} runs under torchrun with {world} processes; let kvgen start them")
    return "auto", os.environ.get("RANK") == "0"


def cmd_generate(args) -> int:
    given = [p for p in (args.prompt, args.prompt_option, args.file) if p is not None]
    if len(given) > 1:
        raise ValueError("give the prompt once: as the argument, with -p/--prompt or with -f/--file")
    if _splits(args) and args.prompt_cache:
        raise ValueError("--prompt-cache keeps one process's cache; with --tp each rank holds a part of it")
    if _splits(args) and "WORLD_SIZE" not in os.environ:  # this process starts the ranks
        seed = [] if args.seed is not None else ["--seed", str(random.randrange(2**31))]  # every rank draws alike
        return launch_ranks(args.tp, [*args.argv, *seed], args.threads)
    prompt = Path(args.file).read_text(encoding="utf-8") if args.file is not None else \
        given[0] if given else DEFAULT_PROMPT
    tp_plan, prints = _tensor_parallel(args)
    _set_threads(None if tp_plan else args.threads)  # (each rank: OMP_NUM_THREADS, its share of the threads)
    model, tokenizer = load(args.model, args.dtype, args.quantize, args.group_size, args.device, tp_plan)
    if args.chat or args.system_prompt is not None:
        messages = [{"role": "user", "content": prompt}]
        if args.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": args.system_prompt})
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    prompt_tokens = inputs["input_ids"].shape[1]
    drafting = {}
    if args.lookup:
        drafting["prompt_lookup_num_tokens"] = args.lookup
    if args.draft_model:
        drafting["assistant_model"] = load(args.draft_model, args.dtype, args.quantize, args.group_size,
                                           args.device)[0]
    if args.early_exit:
        drafting["assistant_early_exit"] = args.early_exit
    if prints:
        print(prompt, end="", flush=True)  # then the continuation, token by token
    clock = TokenTimer(_text_streamer(tokenizer) if prints else None)  # (its time to first token includes loading
    # a prompt cache)
    prompt_cache = Path(args.prompt_cache) if args.prompt_cache else None
    reused = 0
    if prompt_cache is not None and prompt_cache.exists():
        from kvgen.cache.persist import load_cache

        cache = load_cache(prompt_cache, model=model)
        reused = min(cache.common_prefix_length(inputs["input_ids"]), prompt_tokens - 1)
    else:
        cache = _make_cache(model, args.cache, args.cache_config, prompt_tokens + args.max_new_tokens)
    sampling, seed = _sampling(args)
    stops = {} if args.stop is None else {"stop_strings": args.stop, "tokenizer": tokenizer}
    structured = {} if args.json_schema is None else {"response_format": _json_schema_format(args.json_schema),
                                                      "tokenizer": tokenizer}
    out = model.generate(**inputs.to(model.device), past_key_values=cache, max_new_tokens=args.max_new_tokens,
                         streamer=clock, return_dict_in_generate=True, **sampling, **drafting, **stops, **structured)
    new = out.sequences[0, prompt_tokens:]
    if prints:
        print(_stats_line(model, cache, prompt_tokens, new.shape[0], clock, out.speculation, seed))
    if prompt_cache is not None:
        saved = not prompt_cache.exists()
        if saved:  # first use: keep the prompt's keys and values (not the reply's) for later runs
            try:
                cache.crop(prompt_tokens)
            except ValueError as e:
                raise ValueError(f"--prompt-cache cannot keep this {type(cache).__name__}'s prompt ({e}); use a cache "
                                 "that can be cropped, e.g. --cache dynamic") from None
            cache.save(prompt_cache, model=model)
        print(f"[kvgen] prompt_cache={'saved' if saved else 'loaded'} reused_tokens={reused} "
              f"time_to_first_token_s={clock.prefill_seconds():.3f}")
    return 0


def chat_turn(model, tokenizer, cache, messages: list[dict], max_new_tokens: int, streamer=None) -> str:
    """One assistant turn on a cache kept across turns; returns the reply.

    The conversation is rendered again with the chat template and ``generate()`` feeds only
    what the cache has not seen; where the template re-encodes an earlier reply differently,
    ``generate()`` first crops the cache to the tokens it shares with the new rendering.
    """
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True).to(model.device)
    capacity = cache.get_max_length()
    continues = cache.common_prefix_length(inputs["input_ids"]) >= cache.get_seq_length()
    if capacity is not None and not continues and inputs["input_ids"].shape[1] > capacity:
        # the cache starts afresh from a conversation longer than it holds: keep its most recent
        # tokens, as the seeds do for the sink cache
        inputs = {k: v[:, -capacity:] for k, v in inputs.items()}
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False,
                         streamer=streamer)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def _messages_file(path: Path) -> Path:
    return path.with_name(path.name + ".messages.json")


def cmd_chat(args) -> int:
    _set_threads(args.threads)
    model, tokenizer = load(args.model, args.dtype, args.quantize, args.group_size, args.device)
    if args.load:
        from kvgen.cache.persist import load_cache

        path = Path(args.load)
        if not _messages_file(path).exists():
            raise FileNotFoundError(f"{_messages_file(path)} is missing; --load takes a file written by --save")
        cache = load_cache(path, model=model)
        messages = json.loads(_messages_file(path).read_text(encoding="utf-8"))
        print(f"[kvgen] loaded {len(messages)} messages, cache_tokens={cache.get_seq_length()}", file=sys.stderr)
    else:
        cache = _make_cache(model, args.cache, args.cache_config, args.max_cache_len)
        messages = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
    print("kvgen chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        clock = TokenTimer(_text_streamer(tokenizer))
        reply = chat_turn(model, tokenizer, cache, messages, args.max_new_tokens, clock)
        messages.append({"role": "assistant", "content": reply})
        if args.save:  # after every turn, so an interrupted chat can be resumed with --load
            cache.save(args.save, model=model)
            _messages_file(Path(args.save)).write_text(json.dumps(messages, ensure_ascii=False), encoding="utf-8")
        print(f"[kvgen] cache_tokens={cache.get_seq_length()} cache_bytes={cache.nbytes()} "
              f"decode_tok_per_s={clock.decode_tokens_per_second():.2f}", file=sys.stderr)
    return 0


def cmd_transcribe(args) -> int:
    from kvgen.transcribe import transcribe

    print(transcribe(args.audio, args.model, device=args.device, max_new_tokens=args.max_new_tokens))
    return 0


def cmd_bench(args) -> int:
    from kvgen.bench import run_bench

    return run_bench(args)


def cmd_serve(args) -> int:
    try:
        from kvgen.serving.server import create_app, serve
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"kvgen serve needs {error.name}: pip install 'kvgen[serve]'") from None
    from kvgen.serving import ContinuousBatchingConfig

    if _splits(args) and args.kv_store:
        raise ValueError("--kv-store shares one process's blocks; with --tp each rank holds a part of each")
    if _splits(args) and "WORLD_SIZE" not in os.environ:  # this process starts the ranks
        return launch_ranks(args.tp, args.argv, args.threads)
    tp_plan, front = _tensor_parallel(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")  # uvicorn's look
    _set_threads(None if tp_plan else args.threads)
    model, tokenizer = load(args.model, args.dtype, device=args.device, tp_plan=tp_plan)
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    dense = {"block_sparse": False, "decode_graphs": False} if args.dense_attention else {}  # (else the device's)
    engine = ContinuousBatchingConfig(max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens,
                                      max_memory=args.kv_cache_memory, max_queue=args.max_queue,
                                      kv_store=args.kv_store, kv_store_retry=args.kv_store_retry,
                                      kv_dtype=args.kv_dtype or serving_kv_dtype(model), **dense)
    if not front:  # a rank of a split model: rank 0 serves HTTP and plans, this one runs its steps until it stops
        import signal

        from kvgen.serving import ContinuousBatchingManager

        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (rank 0 drains its requests first, then releases it)
        manager = ContinuousBatchingManager(model, config=engine, tokenizer=tokenizer)
        manager.start()
        manager.stop()
        if manager.error is not None:
            raise RuntimeError(f"rank {os.environ['RANK']}'s steps failed: {manager.error}")
        return 0
    app = create_app(model, tokenizer, name, engine_config=engine, api_key=args.api_key)
    serve(app, host=args.host, port=args.port, drain_timeout=args.drain_timeout)
    return 0


def serving_kv_dtype(model):
    """``kvgen serve``'s KV precision (a torch dtype) unless ``--kv-dtype`` says: float16 for a float32 model on the
    CPU (its attention reads half the bytes, perplexity within 0.01% of float32's on the KJV), else the model's
    dtype."""
    import torch

    return torch.float16 if model.device.type == "cpu" and model.dtype == torch.float32 else model.dtype


def build_parser() -> argparse.ArgumentParser:
    from kvgen.cache import cache_implementations
    from kvgen.cache.precision import KV_DTYPES

    parser = _Parser(prog="kvgen", description="Key-value-cached text generation")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def model_options(p):  # what loads the model: generate, chat and serve
        p.add_argument("-m", "--model",
                       help="HF folder, hub id or .gguf file (default: packaged SmolLM2-135M-Instruct)")
        p.add_argument("-t", "--threads", type=_positive_int, metavar="N",
                       help="CPU threads (default: torch's, one per core)")
        p.add_argument("--device", type=_device, help="where the model runs: cpu, cuda, cuda:1, auto (default: cpu; "
                                                      "on a GPU a GGUF runs dequantized, in float32 unless --dtype)")
        p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="compute and weight dtype (default: a GGUF's weights stay in their stored types, "
                            "float checkpoints load in float32)")

    def common(p):
        model_options(p)
        p.add_argument("--cache", default="dynamic", choices=cache_implementations(), help="cache implementation")
        p.add_argument("--cache-config", type=parse_cache_config, default=None, metavar="KEY=VALUE,...",
                       help="settings of the cache, e.g. backend=kivi,nbits=2 for --cache quantized")
        p.add_argument("-n", "--max-new-tokens", type=_positive_int, default=30, metavar="N")
        p.add_argument("--quantize", choices=["int8", "int4"], help="quantize linear layers at load")
        p.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128], help="int4 group size")
        p.add_argument("--verbose", action="store_true", help="show a traceback on errors")
        p.add_argument("-sys", "--system-prompt", metavar="TEXT",
                       help="a system message before the user's, in the model's chat template "
                            "(generate: implies --chat)")

    g = sub.add_parser("generate", help="continue a prompt and print stats")
    g.add_argument("prompt", nargs="?", help=f"text to continue (default: {DEFAULT_PROMPT!r})")
    g.add_argument("-p", "--prompt", dest="prompt_option", metavar="TEXT",
                   help="the prompt as an option, as llama.cpp (-p) and mlx-lm (--prompt) take it")
    g.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE (UTF-8), as llama.cpp's -f")
    common(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)  # streaming is the default now
    g.add_argument("--do-sample", action="store_true", help="sample (temperature 1 unless --temp)")
    g.add_argument("--temp", "--temperature", dest="temperature", type=_non_negative_float, metavar="T",
                   help="sampling temperature: above 0 samples, 0 is greedy (default: greedy)")
    g.add_argument("--top-k", type=_positive_int, metavar="K", help="sample from the K likeliest tokens")
    g.add_argument("--top-p", type=_probability, metavar="P", help="sample from the likeliest tokens holding P")
    g.add_argument("--min-p", type=_probability, metavar="P",
                   help="sample from the tokens at least P times as likely as the likeliest")
    g.add_argument("--repeat-penalty", "--repetition-penalty", dest="repeat_penalty", type=_positive_float,
                   metavar="R", help="divide the scores of tokens already in the text by R (transformers' "
                                     "repetition_penalty; 1: none)")
    g.add_argument("-s", "--seed", type=int, metavar="N", help="seed of the sampling (default: a fresh one, printed)")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop once the text holds TEXT (kept in the output); repeat for several")
    g.add_argument("--tp", type=_positive_int, metavar="N",
                   help="split the model over N processes of this machine (tensor parallelism, torch.distributed)")
    g.add_argument("--json-schema", metavar="FILE",
                   help="hold the reply to JSON valid against the JSON schema in FILE (llguidance's grammar)")
    g.add_argument("--lookup", type=_positive_int, metavar="N",
                   help="speculative decoding: draft N tokens by prompt lookup (n-grams of the text so far)")
    g.add_argument("--draft-model", metavar="PATH",
                   help="speculative decoding: draft with this smaller model (same tokenizer), loaded like --model")
    g.add_argument("--early-exit", type=_positive_int, metavar="LAYERS",
                   help="speculative decoding: draft with the model's first LAYERS layers")
    g.add_argument("--prompt-cache", metavar="FILE",
                   help="reuse the keys/values of a prompt prefix across runs: saved to FILE on first use, loaded "
                        "later when the prompt starts with the same tokens (the file's cache type wins over --cache)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that reuses one cache across turns")
    common(c)
    c.set_defaults(max_new_tokens=256)
    c.add_argument("-c", "--max-cache-len", type=_positive_int, default=4096, metavar="N",
                   help="slots for preallocated caches (llama.cpp's -c, its context size)")
    c.add_argument("--save", metavar="FILE", help="write the conversation's cache to FILE (and its messages to "
                                                   "FILE.messages.json) after every turn")
    c.add_argument("--load", metavar="FILE", help="resume a conversation written with --save")
    c.set_defaults(func=cmd_chat)

    t = sub.add_parser("transcribe", help="print the transcript of a WAV file (Whisper)")
    t.add_argument("audio", help="PCM WAV file, any sampling rate, mono or stereo")
    t.add_argument("--model", help="Whisper folder: Hugging Face or CTranslate2 (default: packaged tiny.en)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--max-new-tokens", type=int, default=224, help="tokens per 30-second window")
    t.set_defaults(func=cmd_transcribe)

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

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    model_options(s)
    s.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model as given)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("KVGEN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVGEN_API_KEY)")
    s.add_argument("--max-num-seqs", type=_positive_int, default=32, help="sequences decoded together at most")
    s.add_argument("--max-batch-tokens", type=_positive_int, default=256,
                   help="tokens per forward pass (decodes and prompt chunks); fewer: steadier inter-token latency")
    s.add_argument("--max-queue", type=_positive_int, default=256,
                   help="waiting requests at most; past it requests get 429 with Retry-After")
    s.add_argument("--kv-cache-memory", default="1GiB",
                   help="KV cache budget: bytes, e.g. 512MB, or a fraction of free memory such as 0.5")
    s.add_argument("--kv-dtype", choices=list(KV_DTYPES),
                   help="how the KV cache stores keys and values; int8: a scale per 32 values (default: float16 "
                        "for a float32 model on the CPU: half the bytes attention reads; else the model's dtype)")
    s.add_argument("--dense-attention", action="store_true",
                   help="on a GPU, attend through masks over every slot in use and run decode steps eagerly (the "
                        "CPU's way) instead of block-sparse flex_attention and CUDA-graph decode steps")
    s.add_argument("--kv-store", metavar="URL",
                   help="share prefix blocks with other replicas through Redis: redis://host:port/db")
    s.add_argument("--kv-store-retry", type=float, default=30.0, metavar="SECONDS",
                   help="after Redis failed, seconds before trying it again (meanwhile prefixes are cached locally)")
    s.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds to let running requests finish before cancelling them")
    s.add_argument("--tp", type=_positive_int, metavar="N",
                   help="split the model over N processes of this machine; rank 0 serves HTTP (tensor parallelism)")
    s.add_argument("--verbose", action="store_true", help="show a traceback on errors")
    s.set_defaults(func=cmd_serve)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _device(text: str) -> str:
    import torch

    try:
        device = torch.device("cuda" if text == "auto" and torch.cuda.is_available() else
                              "cpu" if text == "auto" else text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:1, auto)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: no CUDA GPU is available here (torch.cuda.is_available() is False)")
    return str(device)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, not {text}")
    return value


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):  # a prefix of an option is an error, never that option
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})  # (--prompt once meant --prompt-cache)

    def error(self, message):  # one line, as for every other error; a subcommand names itself
        name = self.prog.split()[-1]
        raise SystemExit(_fail(message if name == "kvgen" else f"{name}: {message}"))


def _fail(message: str) -> int:
    print(f"kvgen: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run a ``kvgen`` command; an error prints one line ``kvgen: error: ...`` and exits non-zero
    (``--verbose``: the traceback too)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (for the ranks that --tp starts)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as error:
        if getattr(args, "verbose", False):
            raise
        raise SystemExit(_fail(" ".join(str(error).split()) or type(error).__name__)) from None


if __name__ == "__main__":
    sys.exit(main())
