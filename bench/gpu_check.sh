#!/usr/bin/env bash
# The GPU check: everything issue 9 asks of one GPU, in one command, bounded by 9 minutes
# (the sum of its part limits, printed first) on one H200: with a machine's start (1-2
# minutes) it leaves at least 4 of a session's 15 minutes of device time, enough to start
# again and re-run a part.
#
#   bash bench/gpu_check.sh [OUT_DIR] [PART ...]
#
# Carry: the GPU machine has no megatron-core and no internet.  Put megatron-core's wheel for
# its Python, and pytest-xdist's (the tests run side by side to fit the bound), into .whl/ in
# the repository root (an ignored folder; GPU_CHECK_WHEELS names another), made here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1 pytest-xdist execnet
# The install part puts every wheel of that folder into runs/gpu_check_pydeps (pip --no-index
# --no-deps --target, first on PYTHONPATH; the environment itself is not touched) when a module the check needs
# does not import or a wheel is not there yet, or stops in one line saying what to carry.  Its other hard dependencies
# (torch, numpy, packaging) come with torch and transformers; wandb, datasets, torchft, TE
# and apex are not needed here.  Tokenizers trained by the tests are kept in .whl/test-cache
# (GEOCONA_TEST_CACHE), so a carried or second run skips their training.  Where the tree
# arrived as a copy with a stale or no .git, GEOCONA_COMMIT=<hash> names its commit in
# summary.json (jobruntime.metrics.provenance).
#
# PARTs (default: all): install; tests (tests/test_gpu.py: demo to target, the three
# full-size presets with tokenizer.json files of their kind, GeoMesh and CONA real mode,
# zero-shot, SDPA vs local attention, bf16 throughput); and one bench part per preset, e.g.
# bench:gpt3_1.3b (bench/throughput.py against the Hugging Face peer, eager and
# torch.compile, at the same micro-batch and sequence; GPT-3 also sweeps the micro-batch
# size to fit the H200 efficiency curve).  Each part has its own time limit and a failing
# part does not stop the others (install excepted).  Writes install.json, gpu_tests.log/.xml
# (a JUnit file even when the limit stops pytest), throughput_<preset>.json,
# throughput.log, parts.jsonl and summary.json to OUT_DIR; prints the summary (one JSON
# object) last.
#
# GPU_CHECK_DEVICE=cpu is the CPU stand-in (tests/test_gpu_check.py): no CUDA needed, the
# bench parts run each preset's tiny twin for a few steps.  GPU_CHECK_<PART>_S override the
# limits (seconds), GPU_CHECK_PYDEPS the install folder.
set -u
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_check}
shift || true
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(install tests bench:gpt3_1.3b bench:llama3.2_1b bench:bert_large)
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
out=$(abspath "$out")
wheels=$(abspath "${GPU_CHECK_WHEELS:-.whl}")
pydeps=$(abspath "${GPU_CHECK_PYDEPS:-runs/gpu_check_pydeps}")  # outside OUT: not sent back
device=${GPU_CHECK_DEVICE:-cuda}
mkdir -p "$out"
: > "$out/parts.jsonl"
export PYTHONUNBUFFERED=1
export GEOCONA_TEST_CACHE=${GEOCONA_TEST_CACHE:-$wheels/test-cache}
export PYTHONPATH="$pydeps:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Limits in seconds: each part gets SIGTERM (the tests SIGINT, on which pytest writes its
# JUnit report) at its limit and SIGKILL a grace later; the bound counts both.  Measured on
# one H200 (2026-12-04, at 475 s of limits): install 14 s warm, over 30 s on a fresh machine
# (its first imports of torch and transformers); tests 149 s and stopped, one test not run
# (the demo and zero-shot on one worker took 127 s; each 1B preset test ~96 s while it still
# wrote an ~18 GB checkpoint, now off); GPT-3 1.3B 112 s, Llama-3.2-1B 81 s; BERT-Large
# stopped at 66 s before its compiled peer.
l_summary=10
limit_of() {  # the soft limit of a part
  case "$1" in
    install) echo "${GPU_CHECK_INSTALL_S:-45}" ;;
    tests) echo "${GPU_CHECK_TESTS_S:-165}" ;;
    bench:*bert*) echo "${GPU_CHECK_BERT_S:-90}" ;;
    bench:*gpt*) echo "${GPU_CHECK_GPT_S:-125}" ;;
    bench:*) echo "${GPU_CHECK_LLAMA_S:-90}" ;;
    *) echo 0 ;;
  esac
}
grace_of() { case "$1" in tests) echo 5 ;; *) echo 2 ;; esac; }
bound_of() {  # the parts' limits and graces, and the summary's
  local b=$((l_summary + 2)) part
  for part in "${parts[@]}"; do b=$((b + $(limit_of "$part") + $(grace_of "$part"))); done
  echo "$b"
}
bound=$(bound_of)
echo "gpu_check: ${parts[*]} on $device; bound $bound s (sum of the part limits;" \
  "$(GPU_CHECK_INSTALL_S='' GPU_CHECK_TESTS_S='' GPU_CHECK_GPT_S='' GPU_CHECK_LLAMA_S='' \
     GPU_CHECK_BERT_S='' bound_of) s at the default limits)"
start=$SECONDS

record() {  # part, exit status, seconds, limit -> one line of parts.jsonl
  printf '{"part": "%s", "exit": %d, "elapsed_s": %d, "limit_s": %d}\n' "$1" "$2" "$3" "$4" \
    >> "$out/parts.jsonl"
  echo "$1: exit $2 after $3 s (limit $4 s)"
}

for part in "${parts[@]}"; do
  t0=$SECONDS
  limit=$(limit_of "$part")
  grace=$(grace_of "$part")
  case "$part" in
    install)
      timeout -k "$grace" "$limit" python bench/gpu_deps.py --wheels "${GPU_CHECK_WHEELS:-.whl}" \
        --target "$pydeps" --device "$device" --report "$out/install.json"
      rc=$?
      record "$part" "$rc" $((SECONDS - t0)) "$limit"
      # nothing else can run without the dependencies (its one line said what to carry)
      [ "$rc" -ne 0 ] && exit "$rc" ;;
    tests)
      # the tests are subprocesses of small models (and three 1B presets): run them side by
      # side where pytest-xdist is installed, one worker per test group (8), so that none
      # waits for a worker and the part lasts as long as its longest group (the demo and
      # zero-shot); the benches below run alone
      par=(); python -c "import xdist" 2>/dev/null && par=(-n 8 --dist loadgroup)
      rm -f "$out/gpu_tests.xml"
      timeout -s INT -k "$grace" "$limit" python -m pytest -q -m gpu tests/test_gpu.py \
        "${par[@]}" -p no:cacheprovider --junitxml="$out/gpu_tests.xml" > "$out/gpu_tests.log" 2>&1
      rc=$?
      # a SIGKILL (or a stop before pytest's session began) leaves no report: write one
      python bench/gpu_summary.py "$out" --junit-fallback "$rc" --limit-s "$limit"
      record "$part" "$rc" $((SECONDS - t0)) "$limit" ;;
    bench:*)
      preset=${part#bench:}
      case "$preset" in
        bert*) batch=(parallel.micro_batch_size=16 parallel.global_batch_size=64)
               extra=(--profile) ;;
        gpt3*) batch=(parallel.micro_batch_size=4 parallel.global_batch_size=16)
               extra=(--sweep-mbs 2,4,8 --profile) ;;
        *) batch=(parallel.micro_batch_size=4 parallel.global_batch_size=16); extra=() ;;
      esac
      steps=(--steps 5 --warmup 2)
      if [ "$device" = cpu ]; then  # the stand-in: the preset's tiny twin, a few steps
        case "$preset" in bert*) preset=tiny_bert ;; gpt3*) preset=tiny_gpt ;; *) preset=tiny_llama ;; esac
        batch=(parallel.micro_batch_size=2 parallel.global_batch_size=4 model.num_layers=2
               model.seq_length=64 model.vocab_size=512)
        [ "${extra[0]:-}" = --sweep-mbs ] && extra[1]=1,4  # ends away from 2, as 2,4,8 from 4
        steps=(--steps 2 --warmup 2)
      fi
      # One JSON line after our run and after each peer: a part stopped at its limit keeps
      # what it measured (the summary names what is missing).
      timeout -k "$grace" "$limit" python bench/throughput.py --config "$preset" "${steps[@]}" \
        --peer --peer-compile "${extra[@]}" "${batch[@]}" logging.wandb=disabled \
        > "$out/throughput_${part#bench:}.json" 2>> "$out/throughput.log"
      record "$part" $? $((SECONDS - t0)) "$limit" ;;
    *) echo "unknown part $part (install, tests, bench:PRESET)" ;;
  esac
done
timeout -k 2 "$l_summary" python bench/gpu_summary.py "$out" --wall-s $((SECONDS - start)) \
  --bound-s "$bound"
