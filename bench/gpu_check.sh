#!/usr/bin/env bash
# The GPU check: everything issue 9 asks of one GPU, in one command, < 10 minutes on one H200.
#
#   bash bench/gpu_check.sh [OUT_DIR] [PART ...]
#
# PARTs (default: all): tests (tests/test_gpu.py: demo to target, the three full-size presets
# with tokenizer.json files of their kind, GeoMesh and CONA real mode, zero-shot, SDPA vs
# local attention, bf16 throughput), and one bench part per preset, e.g. bench:gpt3_1.3b
# (bench/throughput.py against the Hugging Face peer, eager and torch.compile; GPT-3 also
# sweeps the micro-batch size to fit the H200 efficiency curve).  Each part has its own time
# limit and a failing part does not stop the others.  Writes gpu_tests.log/.xml,
# throughput_<preset>.json, throughput.log and summary.json to OUT_DIR; prints the summary
# (one JSON object) last.
set -u
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_check}
shift || true
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench:gpt3_1.3b bench:llama3.2_1b bench:bert_large)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$SECONDS
for part in "${parts[@]}"; do
  case "$part" in
    tests)
      # the tests are subprocesses of small models (and three 1B presets): run them side by
      # side where pytest-xdist is installed; the benches below run alone
      par=(); python -c "import xdist" 2>/dev/null && par=(-n 6 --dist loadgroup)
      timeout "${GPU_CHECK_TESTS_S:-190}" python -m pytest -q -m gpu tests/test_gpu.py "${par[@]}" \
        -p no:cacheprovider --junitxml="$out/gpu_tests.xml" > "$out/gpu_tests.log" 2>&1
      echo "tests: exit $? after $((SECONDS - start)) s" ;;
    bench:*)
      preset=${part#bench:}
      case "$preset" in
        bert*) batch=(parallel.micro_batch_size=16 parallel.global_batch_size=64)
               extra=(--profile); limit=${GPU_CHECK_BERT_S:-100} ;;
        gpt3*) batch=(parallel.micro_batch_size=4 parallel.global_batch_size=16)
               extra=(--sweep-mbs 2,4,8 --profile); limit=${GPU_CHECK_GPT_S:-150} ;;
        *) batch=(parallel.micro_batch_size=4 parallel.global_batch_size=16); extra=()
           limit=${GPU_CHECK_LLAMA_S:-110} ;;
      esac
      # One JSON line after our run and the eager peer, a fuller one after the compiled peer:
      # a part stopped at its limit keeps what it measured.
      timeout "$limit" python bench/throughput.py --config "$preset" \
        --steps 6 --warmup 3 --peer --peer-compile "${extra[@]}" "${batch[@]}" \
        logging.wandb=disabled > "$out/throughput_$preset.json" 2>> "$out/throughput.log"
      echo "bench $preset: exit $? after $((SECONDS - start)) s" ;;
    *) echo "unknown part $part" ;;
  esac
done
python bench/gpu_summary.py "$out" --wall-s $((SECONDS - start))
