#!/bin/bash
# One prepared device call for a session that is lent a GPU (the device tool: 15 minutes a task, one call ~8 min).
#
#   run(command="bash bench/gpu_session.sh", carry=[".whl"], timeout_s=590)
#
# .whl: the py3.12 wheels the GPU image lacks (trio, outcome, sniffio, starlette, uvicorn, liger-kernel, datasets,
# dill, multiprocess, math-verify, latex2sympy2_extended, antlr4-python3-runtime; py-spy for the profile), fetched
# here with `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl
# NAME==VERSION` (see the device tool's README); the folder is git-ignored.
#
# In order, each under its own timeout so a hang loses only its stage (timeouts sum to 570 s):
#   tune_logits      the from-logits kernels' config sweep (issue 42 item 9);
#   demo_profiled    a short demo, compile off, under py-spy and with a torch.profiler trace of steps 20-21 of
#                    each phase ([logging] profile_steps: where the GPU step's time goes; the demo < 30 s); every
#                    demo logs dynamo's recompiles (TORCH_LOGS=recompiles);
#   demo_graphs      the same demo with nothing compiled: the engine by CUDA graphs ([engines] cuda_graphs, item 8),
#                    training through packed_sdpa ([trainer] attention: no FlexAttention compile); the per-step
#                    time_generate_s / time_train_s and SFT's first step tell the two apart;
#   engine_decode    bench_generate.py's engine decode eager vs graphs vs compiled (greedy, full size), and
#                    bench_decode_attention.py (the decode attention without repeat_kv's copies);
#   new_gpu_tests    this round's gpu tests on their own (graph capture, KV budget, packed_sdpa vs flex, the compile
#                    counts of FlexAttention and the engine's decode, compiled step);
#   demo_compiled    a short demo with compile on (item 5: the compiled trainer on CUDA);
#   gpu_check        every gpu test and the weight sync.
# Each stage copies what came before to $OUT/run; the end writes $OUT/all.tgz and prints the stage times.
set -u
OUT=${OUT:-/tmp/gpu_session_out}
R=/tmp/gpu_session; rm -rf "$R"; mkdir -p "$R" "$OUT"
T0=$(date +%s)
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$R/pip.log" 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
unset TRITON_INTERPRET
git rev-parse HEAD > "$R/commit.txt" 2>/dev/null || echo "no git" > "$R/commit.txt"
nvidia-smi -L > "$R/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  > "$R/versions.txt" 2>&1
# Each stage first copies what the earlier ones wrote to $OUT/run: a call cut at its limit still brings them back.
stage() { echo "== $1 $(($(date +%s) - T0)) s" | tee -a "$R/stages.txt"; mkdir -p "$OUT/run"; cp -r "$R"/. "$OUT/run/" \
  2> /dev/null; }

stage tune_logits
timeout 60 python3 bench/tune_logits.py --json "$R/tune_logits.json" > "$R/tune_logits.log" 2>&1
echo "rc=$?" >> "$R/tune_logits.log"

stage demo_profiled
DEMO=(-m trainer demo --set sft.num_steps=100 --set rl.num_steps=30)
# [logging] profile_steps: a torch.profiler trace of SFT's and RL's steps 20-21 (host ops, kernels and waits on one
# timeline: what py-spy's Python stacks cannot show), beside py-spy's whole-run stacks
PROFILED=(--set "logging.profile_steps=[20, 21]" --set output_dir=/tmp/gs_demo)
# dynamo's recompiles into the demos' logs (kernels.device.dynamic_compile: the engine's decode once, FlexAttention
# once per grad mode and mask); a "Recompiling" line names the guard that failed
RECOMPILES=(env TORCH_LOGS=recompiles)
if command -v py-spy > /dev/null; then
  timeout 95 "${RECOMPILES[@]}" py-spy record -r 200 --idle --threads --nonblocking --format raw \
    -o "$R/demo_pyspy.txt" -- python3 "${DEMO[@]}" "${PROFILED[@]}" > "$R/demo.log" 2>&1
else
  timeout 95 "${RECOMPILES[@]}" python3 "${DEMO[@]}" "${PROFILED[@]}" > "$R/demo.log" 2>&1
fi
echo "rc=$?" >> "$R/demo.log"
for phase in sft rl; do
  mkdir -p "$R/profile_$phase" && cp /tmp/gs_demo/$phase/profile/* "$R/profile_$phase/" 2>/dev/null
done

stage demo_graphs
timeout 60 "${RECOMPILES[@]}" python3 "${DEMO[@]}" --set engines.cuda_graphs=true --set trainer.attention=packed_sdpa \
  --set output_dir=/tmp/gs_demog > "$R/demo_graphs.log" 2>&1
echo "rc=$?" >> "$R/demo_graphs.log"

stage engine_decode
timeout 50 python3 -m pytest -q -p no:cacheprovider bench/bench_generate.py --benchmark-only -k "engine and greedy" \
  --benchmark-json="$R/bench_generate.json" > "$R/bench_generate.log" 2>&1
echo "rc=$?" >> "$R/bench_generate.log"
timeout 20 python3 -m pytest -q -p no:cacheprovider bench/bench_decode_attention.py --benchmark-only \
  --benchmark-json="$R/bench_decode_attention.json" > "$R/bench_decode_attention.log" 2>&1
echo "rc=$?" >> "$R/bench_decode_attention.log"

stage new_gpu_tests  # this round's gpu tests first, on their own (gpu_check below runs every gpu test again)
# -v: a line per test as it ends (the JUnit XML is written only at the end, which a timeout never reaches); -rP: the
# passed tests' output too (the compiled trainer's steps: graphs and seconds, bench/compile_counts.py); the
# compiled trainer's test (inductor's compile: the slowest) last
timeout 80 python3 -m pytest -v -rP -p no:cacheprovider -m gpu tests/test_engine_attention.py tests/test_cuda_graphs.py \
  tests/test_kv_budget.py tests/test_attention_choice.py tests/test_flex_compile.py tests/test_decode_batch.py \
  tests/test_trainer_core.py \
  --junitxml="$R/new_gpu_tests.xml" > "$R/new_gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/new_gpu_tests.log"

stage demo_compiled
timeout 75 "${RECOMPILES[@]}" python3 "${DEMO[@]}" --set trainer.compile=true --set output_dir=/tmp/gs_democ > "$R/demo_compiled.log" 2>&1
echo "rc=$?" >> "$R/demo_compiled.log"
for d in gs_demo gs_demog gs_democ; do
  mkdir -p "$R/$d"
  cp /tmp/$d/summary.json /tmp/$d/sft/metrics.jsonl "$R/$d/" 2>/dev/null
  cp /tmp/$d/rl/metrics.jsonl "$R/$d/rl_metrics.jsonl" 2>/dev/null
done

stage gpu_check
timeout 130 python3 bench/gpu_check.py --out "$R/gpu_check" --timeout 115 --skip demo,distributed,benchmarks,tune \
  > "$R/gpu_check.log" 2>&1
echo "rc=$?" >> "$R/gpu_check.log"

stage done
tar czf "$OUT/all.tgz" -C "$R" .
cp "$R/stages.txt" "$R/tune_logits.log" "$R/demo.log" "$R/demo_graphs.log" "$R/bench_generate.log" \
  "$R/bench_decode_attention.log" \
  "$R/new_gpu_tests.log" "$R/demo_compiled.log" "$R/gpu_check.log" "$OUT/" 2>/dev/null
tail -n 3 "$R/demo.log" "$R/demo_graphs.log" "$R/new_gpu_tests.log" "$R/demo_compiled.log" "$R/gpu_check.log"
cat "$R/stages.txt"
