#!/usr/bin/env bash
# One H200 session's jobs, for a device machine whose calls last at most 10 minutes and whose working
# tree is laid anew on every call: each job runs detached from a copy OUTSIDE that tree (/root/bs),
# and every call of this script copies the jobs' logs and results into $OUT.
#
#   bash configs/h200/session.sh prepare    # copy, wheels, CUDA llama-server build, both 48-layer models (detached)
#   bash configs/h200/session.sh prepare builtin  # copy, wheels, the built-in engine's two models only (no
#                                           # llama-server, no GGUF: for copy/overlap, which run no llama.cpp)
#   bash configs/h200/session.sh cuda       # the CUDA tests (foreground, ~3.5 min)
#   bash configs/h200/session.sh headline   # benchsuite run of configs/h200/headline.yaml (detached)
#   bash configs/h200/session.sh overlap    # benchsuite run of configs/h200/overlap.yaml (detached; issue 29)
#   bash configs/h200/session.sh copy       # benchsuite run of configs/h200/copy.yaml (detached; issue 29, ~12 min)
#   bash configs/h200/session.sh ttft       # benchsuite run of configs/h200/ttft.yaml (detached; issue 29, ~5 min)
#   bash configs/h200/session.sh paged16    # benchsuite run of configs/h200/paged16.yaml (detached; issue 29, ~14 min)
#   bash configs/h200/session.sh fused      # benchsuite run of configs/h200/fused.yaml (detached; issue 29, ~6 min)
#   bash configs/h200/session.sh kernelcopy # benchsuite run of configs/h200/kernelcopy.yaml (detached; issue 29, ~6 min)
#   bash configs/h200/session.sh batchcopy  # benchsuite run of configs/h200/batchcopy.yaml (detached; issue 29, ~8 min)
#   bash configs/h200/session.sh staging    # benchsuite run of configs/h200/staging.yaml (detached; issue 29, ~10 min)
#   bash configs/h200/session.sh staging16  # benchsuite run of configs/h200/staging16.yaml (detached; issue 29, ~10 min)
#   bash configs/h200/session.sh dmaproxy   # benchsuite run of configs/h200/dmaproxy.yaml (detached; issue 29, ~12 min)
#   bash configs/h200/session.sh switch     # benchsuite run of configs/h200/switch.yaml (detached; issue 29, ~10 min)
#   bash configs/h200/session.sh capcopy    # benchsuite run of configs/h200/capcopy.yaml (detached; issue 29, ~10 min)
#   bash configs/h200/session.sh packed     # benchsuite run of configs/h200/packed.yaml (detached; issue 29, ~12 min)
#   bash configs/h200/session.sh gcfreeze   # benchsuite run of configs/h200/gcfreeze.yaml (detached; the GC heap freeze, ~6 min)
#   bash configs/h200/session.sh record     # benchsuite run of configs/h200/record.yaml (detached; what recording costs, ~11 min)
#   bash configs/h200/session.sh window     # benchsuite run of configs/h200/window.yaml (detached; the aging LFU's window, ~8 min)
#   bash configs/h200/session.sh policyconfirm  # benchsuite run of configs/h200/policyconfirm.yaml (detached; ~14 min)
#   bash configs/h200/session.sh prefetch       # benchsuite run of configs/h200/prefetch.yaml (detached; ~9 min)
#   bash configs/h200/session.sh duel           # benchsuite run of configs/h200/duel.yaml (detached; ~10 min)
#   bash configs/h200/session.sh duelconfirm    # benchsuite run of configs/h200/duelconfirm.yaml (detached; ~17 min on an H100)
#   bash configs/h200/session.sh MATRIX     # any configs/h200/MATRIX.yaml the same way (the lines above name some of them)
#   bash configs/h200/session.sh flags      # benchmarks/llamacpp_flags_h200.py at N=30 (detached; issue 24, ~8 min)
#   bash configs/h200/session.sh policies   # benchmarks/eviction_policies.py over this session's routing traces
#                                           # (the servers with record_routing: record, policy, window, policyconfirm),
#                                           # one process a trace (2,048-token traces take over 11 min: bring them
#                                           # back with `routing` and replay them off the device instead)
#   bash configs/h200/session.sh queue JOB...  # JOBs (cuda first, then any MATRIX, flags, policies) in
#                                           # order, once prepare's jobs end; a failed CUDA test stops the runs
#   bash configs/h200/session.sh poll SECS  # wait up to SECS for the running jobs, printing progress; once they have
#                                           # ended, with a minute left, the routing traces in routing.tar (over 16 MB
#                                           # in parts, routing.tar.part-NN) if the call has room for them
#   bash configs/h200/session.sh routing    # the routing traces alone (ids only), in a call of their own
# CUDA_TESTS (default tests/cuda): the tests `cuda` runs, e.g. one file when a session has time for only one
# matrix and the change is confined to what that file checks (say which in the results README).
# RUN_SUFFIX (default none): appended to the run ids (h200-paged16-b), to run a committed matrix again beside
# its committed results.
# RUN_PREFIX (default: the card nvidia-smi names: h100, h200, else its model in lower case, a100, l40s, ...; h200 where
# nvidia-smi does not answer): the run ids' first part, so a run says which card measured it (2026-12-05 an H100
# was lent for an H200 and its run took the name h200-headline-e). .gitignore keeps h100-* and h200-* runs. A run
# carried to another card resumes only under its own name: set RUN_PREFIX to its prefix.
# BASE_COMMIT (default none): each queued run is measured again right after, by that commit's code (`git archive`
# of the copy's .git into SESSION_BASE, /root/bs-base by default) as run id ...-base: an A/B on whichever card was
# lent, both sides on it (2026-12-05 an H100 came for the H200, and the baseline ran by hand). Compare them here:
# `benchsuite compare results/RUN-base results/RUN`, `benchmarks/prefill_speeds.py results/RUN --against ...-base`.
# RUN_ONLY (default none): the servers each queued run measures ("paged-fp8 paged-fp8-synthetic": `benchsuite run
# --only` for each), when a session has device time for part of a matrix; the same run id without it measures the rest.
# RUN_ONLY_<job> (e.g. RUN_ONLY_headline): the same for that job alone, over RUN_ONLY ("" = the whole matrix), so one
# queue can run a whole A/B matrix and part of another.
#
# Inputs the caller carries: .whl/ (the Python packages the box lacks, configs/h200/README.md) and
# .carry/llama-src.tar.gz (`benchsuite install llama-server --pack-source`); to resume a run whose machine was
# taken back, its last tar under .carry/results/ (`prepare` restores it).
set -uo pipefail
OUT="${OUT:-/tmp/out}"
COPY="${SESSION_COPY:-/root/bs}"  # the copy the jobs run from (tests/test_session_script.py points both elsewhere)
JOBS="${SESSION_JOBS:-/root/jobs}"
BASE="${SESSION_BASE:-/root/bs-base}"  # BASE_COMMIT's code, unpacked (tests/test_session_script.py points it elsewhere)
CUDA_TESTS="${CUDA_TESTS:-tests/cuda}"
# the jobs poll waits for and collect packs no trace beside (SESSION_BUSY: tests/test_session_script.py's own)
BUSY="${SESSION_BUSY:-benchsuite (install|run|gguf)|synth_memory|llamacpp_flags_h200|eviction_policies}"
# what one file and one call may bring back (16 MiB a file, 64 MiB a call; tests/test_session_script.py sets smaller)
PART_BYTES="${SESSION_PART_BYTES:-16000000}"
CALL_BYTES="${SESSION_CALL_BYTES:-60000000}"
mkdir -p "$OUT" "$JOBS"
if [ -z "${RUN_PREFIX:-}" ]; then
  card="$(timeout 20 nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
  case "$card" in
    *H100*) RUN_PREFIX=h100 ;;
    *H200*|"") RUN_PREFIX=h200 ;;  # the matrices' card (configs/h200), and where no nvidia-smi answers
    *) RUN_PREFIX="$(echo "${card#NVIDIA }" | sed -E 's/[^A-Za-z0-9].*//' | tr '[:upper:]' '[:lower:]')"
       RUN_PREFIX="${RUN_PREFIX:-gpu}" ;;
  esac
fi
export PYTHONUNBUFFERED=1 BENCH_H200_MODEL=/tmp/h200/q48 BENCH_H200_FP8_MODEL=/tmp/h200/q48-fp8 \
  BENCH_H200_GGUF=/dev/shm/h200/q48-q8_0.gguf

# issue 24's flag sets at N=30, by llama-server's own timings (docs/llamacpp-tuning.md), with the binary the
# build printed (read when the job starts; without one the job says so instead of failing on a missing path)
FLAGS_CMD="server=\$(grep -ho '/[^ ]*/bin/llama-server' $JOBS/build.log 2>/dev/null | tail -n 1); \
  if [ -x \"\$server\" ]; then python3 benchmarks/llamacpp_flags_h200.py --server \"\$server\" \
  --model $BENCH_H200_GGUF --ctx 10240 --out $JOBS/flags; else echo 'flags: no llama-server built (build_full.log)'; false; fi"
  # -c as headline.yaml's kv_capacity_tokens

# issue 29's cache policies on the traces the runs recorded (record_routing servers; K: 16 GB's 53 and 54; lfu-decay at a 2-step
# half-life, lfu-aging at 256 steps without and with a 4-, 16- and 64-step window)
POLICIES_CMD="if ! ls results/*/routing/*.trace > /dev/null 2>&1; then echo 'policies: no routing trace'; false; \
  else rm -f $JOBS/policies-*.txt; pids=; for t in results/*/routing/*.trace; do \
  python3 benchmarks/eviction_policies.py \"\$t\" --k 53,54 --half-lives 2 --aging-periods 256,256:4,256:16,256:64 --concurrency 1,4 \
  > $JOBS/policies-\$(basename \"\$t\" .trace).txt 2>&1 & pids=\"\$pids \$!\"; done; rc=0; \
  for p in \$pids; do wait \$p || rc=1; done; cat $JOBS/policies-*.txt; (exit \$rc); fi"

# a job that runs a matrix: any configs/h200/MATRIX.yaml beside this script (a plain name, so no path leaves it)
# (no `-`: a queue reads RUN_ONLY_<name>, and a variable's name cannot hold one)
HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" > /dev/null && pwd)"
is_matrix() { [[ "$1" =~ ^[a-z0-9][a-z0-9_]*$ ]] && [ -f "$HERE/$1.yaml" ]; }

site() {  # the carried wheels, once per machine
  if [ ! -d /tmp/site ] && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  export PYTHONPATH="$COPY:/tmp/site"
}

detach() {  # detach NAME CMD...: run CMD in its own session from the copy, log in $JOBS/NAME.log
  local name=$1; shift
  # exec: the job's shell replaces the subshell with its own stdout (the log), so no descriptor of the
  # caller's stays open in it and the call returns at once even when its output is a pipe
  (cd "$COPY" && exec setsid nohup bash -c "$*; echo \"exit \$?\" >> $JOBS/$name.log" >> "$JOBS/$name.log" 2>&1 < /dev/null) &
  echo $! > "$JOBS/$name.pid"  # exec keeps the pid: what a queue waits for (not a name any process may match)
  echo "started $name"
}

collect() {  # the jobs' logs and the runs' results into $OUT (at most 8 files come back)
  for f in "$JOBS"/*.log; do [ -f "$f" ] && tail -c 2000000 "$f" > "$OUT/$(basename "$f")"; done
  compgen -G "$JOBS/policies-*.txt" > /dev/null && tar -C "$JOBS" -czf "$OUT/policies.tar.gz" $(cd "$JOBS" && ls policies-*.txt)
  [ -d "$JOBS/flags" ] && tar -C "$JOBS" -czf "$OUT/h200-flags.tar.gz" flags 2>/dev/null
  for dir in "$COPY"/results/* "$BASE"/results/*; do  # this session's runs only: prepare emptied
    # the copy's results/ and a base run unpacks its code anew; without routing traces (record_routing: tens of MB a
    # server, over what a call brings back; `policies` reads them there): the cells carry their hit rates
    [ -d "$dir" ] && tar -C "$(dirname "$dir")" --exclude=routing -czf "$OUT/$(basename "$dir").tar.gz" "$(basename "$dir")" 2>/dev/null
  done
}

pack_traces() {  # pack_traces [force]: this session's routing traces into $OUT/routing.tar, when they fit
  # So the policy replay runs off the device (on the device, policyconfirm's four traces had not been replayed after
  # 11 min, and were lost with the machine). Copies without the routing weights (`benchsuite trace ids-only`: a third
  # of the bytes; the simulator and the Belady replay read ids only); a trace the copy fails on goes as it is
  # (routing-ids.txt says why). Over a file's 16 MB the tar comes back in parts (routing.tar.part-00, -01, ...;
  # `cat routing.tar.part-* > routing.tar`) when the call's free files and bytes (60 MB of 64 MiB) hold them all,
  # else it stays on the machine and `session.sh routing`, a call of its own, brings it.
  # Never beside a running job (the copies take a core), never in the place of a log or a run among the call's
  # 8 files, once per set of traces unless forced (`session.sh routing`).
  local force=${1:-0} ids="$JOBS/routing-ids" tar="$JOBS/routing.tar" stamp="$JOBS/routing.stamp" trace rel
  local total=0 fallbacks=0 what
  if ! compgen -G "$COPY/results/*/routing/*.trace" > /dev/null; then
    [ "$force" = 1 ] && echo "routing traces: none in $COPY/results"
    return 0
  fi
  if pgrep -f "$BUSY" > /dev/null; then
    [ "$force" = 1 ] && echo "routing traces: a job is running; again once it has ended"
    return 0
  fi
  if [ "$force" != 1 ] && [ -f "$JOBS/routing.done" ] \
      && [ -z "$(find "$COPY"/results/*/routing -name '*.trace' -newer "$JOBS/routing.done")" ]; then
    return 0  # this set was brought back, or found too big, already
  fi
  if [ "$(find "$OUT" -type f ! -name routing.tar | wc -l)" -ge 8 ]; then  # the call's limit counts subfolders too
    echo "routing traces: the call's 8 files are taken, left on the machine (\`session.sh routing\` brings them alone)"
    return 0
  fi
  touch "$stamp"  # a trace written from now on is newer than the set packed here
  rm -rf "$ids" "$tar"
  : > "$JOBS/routing-ids.txt"
  for trace in "$COPY"/results/*/routing/*.trace; do
    total=$((total + 1))
    rel=${trace#"$COPY/results/"}
    mkdir -p "$ids/$(dirname "$rel")"
    if ! (cd "$COPY" && PYTHONPATH="$COPY:/tmp/site" python3 -m benchsuite trace ids-only "$trace" -o "$ids/$rel" \
        >> "$JOBS/routing-ids.txt" 2>&1); then
      fallbacks=$((fallbacks + 1))
      cp "$trace" "$ids/$rel"
    fi
  done
  if ! (cd "$ids" && tar -cf "$tar" */routing/*.trace); then  # each trace is deflated already
    echo "routing traces: tar failed, left on the machine"
    return 0
  fi
  mv "$stamp" "$JOBS/routing.done"  # this set is decided: brought back below, or too big for a call
  what="all without their weights"
  [ "$fallbacks" -gt 0 ] && what="$fallbacks of them with their weights: routing-ids.txt says why"
  local size parts free used part mb room what_size arrived=0
  size=$(stat -c %s "$tar")
  parts=$(( (size + PART_BYTES - 1) / PART_BYTES ))
  free=$(( 8 - $(find "$OUT" -type f | wc -l) ))
  used=$(find "$OUT" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  mb=$(( (size + 999999) / 1000000 ))
  what_size="$mb MB in $parts parts"
  [ "$parts" -gt 1 ] || what_size="$mb MB in one file"
  if [ "$parts" -gt "$free" ] || [ $((used + size)) -gt "$CALL_BYTES" ]; then
    room=$(( used < CALL_BYTES ? (CALL_BYTES - used) / 1000000 : 0 ))
    local why="this call has $free free files and $room MB"
    [ "$force" = 1 ] || [ "$parts" -gt 8 ] || [ "$size" -gt "$CALL_BYTES" ] \
      || why="$why: \`session.sh routing\` brings them in a call of its own"
    echo "routing traces: $total, $what_size ($what), left on the machine ($why)"
    return 0
  fi
  if [ "$parts" -eq 1 ]; then
    # complete in $JOBS first: a call cut short mid-copy leaves routing.tar.tmp, never a short routing.tar
    if cp "$tar" "$OUT/routing.tar.tmp" && mv "$OUT/routing.tar.tmp" "$OUT/routing.tar"; then
      echo "routing traces: $total in routing.tar ($what)"
    else
      echo "routing traces: the copy into this call's files failed; \`session.sh routing\` brings them"
    fi
    return 0
  fi
  rm -f "$JOBS"/routing.tar.part-*
  split -b "$PART_BYTES" -d -a 2 "$tar" "$JOBS/routing.tar.part-" || { echo "routing traces: split failed"; return 0; }
  for part in "$JOBS"/routing.tar.part-*; do  # each part whole or not at all, as routing.tar above
    cp "$part" "$OUT/$(basename "$part").tmp" && mv "$OUT/$(basename "$part").tmp" "$OUT/$(basename "$part")" \
      && arrived=$((arrived + 1))
  done
  if [ "$arrived" -lt "$parts" ]; then
    echo "routing traces: $arrived of $parts parts copied into this call's files; \`session.sh routing\` brings them all"
    return 0
  fi
  echo "routing traces: $total in $parts parts, routing.tar.part-00..$(printf %02d $((parts - 1))) ($what):" \
    "cat routing.tar.part-* > routing.tar"
}

case "${1:-}" in
  prepare)
    # the committed runs stay out of the copy: a run id found there would resume as already done, and
    # its tar would take one of the 8 files a call brings back
    rm -rf "$COPY" && mkdir -p "$COPY" && cp -a . "$COPY/" && rm -rf "$COPY/results" && site
    # a run whose machine was taken back mid-run resumes on the next one: its last tar from $OUT, put in
    # .carry/results/ and carried, comes back into the copy's results/ (the same `queue` command resumes it)
    for tar in .carry/results/*.tar.gz; do
      [ -f "$tar" ] || continue
      mkdir -p "$COPY/results" && tar -C "$COPY/results" -xzf "$tar" && echo "restored $(basename "$tar" .tar.gz)"
    done
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
      --format=csv | tee "$OUT/gpu.csv"
    # the build and the GGUF take 16 cores for minutes, beside the CUDA tests: only when a job needs llama.cpp
    gguf="time python3 -m benchsuite gguf synth --preset qwen3-30b-a3b-shape --layers 48 --out /dev/shm/h200/q48-q8_0.gguf"
    if [ "${2:-}" = builtin ]; then
      gguf=true
    else
      detach build "python3 -m benchsuite install llama-server --cuda --source .carry/llama-src.tar.gz --jobs 16 \
        > $JOBS/build_full.log 2>&1; tail -5 $JOBS/build_full.log"
    fi
    detach models "set -e; mkdir -p /tmp/h200 /dev/shm/h200
      time python3 -m paged_experts.weights.synth_memory --preset qwen3-30b-a3b-shape --layers 48 --out /tmp/h200/q48
      time python3 -m paged_experts.weights.synth_memory --preset qwen3-30b-a3b-fp8-shape --layers 48 --out /tmp/h200/q48-fp8
      $gguf"
    ;;
  cuda)
    site
    (echo "$BASHPID" > "$JOBS/cuda.pid"; cd "$COPY" && python3 -m pytest $CUDA_TESTS -m cuda -q -p no:cacheprovider -o addopts= 2>&1 | tee "$JOBS/cuda.log" \
      | tail -40; echo "${PIPESTATUS[0]}" > "$JOBS/cuda.rc")  # what a queue's guard reads
    ;;
  flags)
    site
    detach flags "$FLAGS_CMD"
    ;;
  policies)
    site
    detach policies "$POLICIES_CMD"
    ;;
  queue)  # no idle GPU between calls: the jobs run one after another the moment the build and the models are done
    # `cuda` belongs IN the queue (first): a queue started before a separate `session.sh cuda` call could find
    # no test running yet and start its runs beside the tests (2026-12-02: h200-copy's first 12 cells did)
    site
    shift
    [ $# -gt 0 ] || { echo "usage: $0 queue [cuda] MATRIX|flags|policies ... (MATRIX: configs/h200/MATRIX.yaml)" >&2; exit 2; }
    # `queue cuda` alone would name its job `cuda`, write its own pid to cuda.pid and wait for itself forever
    [ "$*" != cuda ] || { echo "queue: cuda alone is \`$0 cuda\` (a queue runs something after the tests)" >&2; exit 2; }
    # a failed CUDA test (this session's cuda.log) stops the queue: no figure is measured on code the GPU found wrong
    # (pytest's exit status, so a crash or a kill stops it too, not only a failed assertion)
    guard="if [ -f $JOBS/cuda.rc ] && [ \"\$(cat $JOBS/cuda.rc)\" != 0 ]; then echo 'queue: the CUDA tests failed (cuda.log): nothing run'; exit 1; fi"
    for job in "${@:2}"; do
      [ "$job" != cuda ] || { echo "queue: cuda goes first (the runs after it are what it guards)" >&2; exit 2; }
    done
    steps=""
    first=true  # the CUDA tests need neither llama-server nor the 48-layer models: they run beside the build
    for job in "$@"; do
      case "$job" in
        cuda) first="python3 -m pytest $CUDA_TESTS -m cuda -q -p no:cacheprovider -o addopts= > $JOBS/cuda.log 2>&1; echo \$? > $JOBS/cuda.rc; echo \"cuda exit \$(cat $JOBS/cuda.rc)\"; tail -n 3 $JOBS/cuda.log" ;;
        flags) steps="$steps; $guard; $FLAGS_CMD; echo \"flags exit \$?\"" ;;
        policies) steps="$steps; $POLICIES_CMD; echo \"policies exit \$?\"" ;;
        *)
          is_matrix "$job" || { echo "usage: $0 queue [cuda] MATRIX|flags|policies ... (MATRIX: configs/h200/MATRIX.yaml; no $job.yaml)" >&2; exit 2; }
          # RUN_ONLY="a b": the run measures only those servers (--only), the rest left for a later run;
          # RUN_ONLY_<job>, where set (even empty), replaces it for this job
          names_var="RUN_ONLY_$job"
          if [ -n "${!names_var+set}" ]; then names="${!names_var}"; else names="${RUN_ONLY:-}"; fi
          only=""
          for server in $names; do only="$only --only $server"; done
          run="python3 -m benchsuite run configs/h200/$job.yaml --run-id $RUN_PREFIX-$job${RUN_SUFFIX:-}"
          steps="$steps; $guard; $run$only --no-report; echo \"$job exit \$?\""
          # then the same run by the base commit's code (its own matrix file, its own results/ without the commit's
          # committed runs, as prepare's copy), unpacked once per commit (.base_commit says which; a second run
          # keeps the first's results): `git archive` fails loudly on a commit the copy's .git does not have, and
          # the base run is skipped, said in the log
          unpack="[ \"\$(cat $BASE/.base_commit 2> /dev/null)\" = \"${BASE_COMMIT:-}\" ] || (set -o pipefail; \
            rm -rf $BASE && mkdir -p $BASE && git archive ${BASE_COMMIT:-} | tar -x -C $BASE \
            && rm -rf $BASE/results && echo ${BASE_COMMIT:-} > $BASE/.base_commit)"
          [ -z "${BASE_COMMIT:-}" ] || steps="$steps; $guard; ($unpack) && (cd $BASE && PYTHONPATH=$BASE:/tmp/site \
            $run-base$only --no-report); echo \"$job base exit \$?\"" ;;
      esac
    done
    # the CUDA tests first, at once (on the GPU, beside the build's and the models' CPU work: slower, not wrong);
    # the runs wait for this machine's build, models and a separate CUDA test run by their pids (a pattern over
    # every process's command line also matched unrelated ones, a shell running `benchsuite install` among
    # them); the steps run in a subshell, so the guard's exit ends them and the log still gets "exit N"
    # (a zombie, a job ended but not yet reaped, counts as ended)
    busy="for f in $JOBS/build.pid $JOBS/models.pid $JOBS/cuda.pid; do [ -f \$f ] || continue; \
      st=\$(ps -o stat= -p \$(cat \$f) 2> /dev/null); [ -n \"\$st\" ] && [ \"\${st#Z}\" = \"\$st\" ] && exit 0; done; exit 1"
    # the tests wait for a separate `session.sh cuda` run only (the same log and status files), not for the build
    cuda_busy="f=$JOBS/cuda.pid; [ -f \$f ] || exit 1; st=\$(ps -o stat= -p \$(cat \$f) 2> /dev/null); \
      [ -n \"\$st\" ] && [ \"\${st#Z}\" = \"\$st\" ]"
    detach "$(IFS=-; echo "$*")" "while (${cuda_busy}); do sleep 5; done; $first; while (${busy}); do sleep 5; done; (true $steps)"
    ;;
  poll)
    site
    end=$(( $(date +%s) + ${2:-60} ))
    while [ "$(date +%s)" -lt "$end" ]; do
      running=$(pgrep -f "$BUSY" | wc -l)
      echo "$(date +%T) running=$running"
      for f in "$JOBS"/*.log; do  # the runs' and queues' last lines (not the build's, models' or tests')
        case "$(basename "$f")" in build*|models*|cuda.log) continue ;; esac
        [ -f "$f" ] && echo "  $(basename "$f" .log): $(tail -n 1 "$f" | cut -c1-160)"
      done
      [ "$running" -eq 0 ] && break
      collect; sleep 20
    done
    # the traces once the jobs are done, when the call has a minute left for them (a call killed mid-copy loses
    # them), after this call's logs and runs are in $OUT (they come first among its 8 files)
    if [ $((end - $(date +%s))) -ge 60 ]; then collect; pack_traces; fi
    # a run's last cell is not its end: the server stops, the optimum is replayed, cells.parquet is written
    running=$(pgrep -f "$BUSY" | wc -l)  # now, not 20 s ago
    [ "$running" -gt 0 ] && echo "STILL RUNNING: poll again now (a machine idle for 30 s is given back)"
    ;;
  routing)  # the traces alone, in a call of their own (when a call's 8 files were taken), the set packed before too
    pack_traces 1
    exit 0
    ;;
  *)  # a matrix: configs/h200/MATRIX.yaml, run detached
    if ! is_matrix "${1:-}"; then
      echo "usage: $0 prepare [builtin]|cuda|MATRIX|flags|policies|queue [cuda] JOB...|poll SECS|routing" \
        "(MATRIX: configs/h200/MATRIX.yaml)" >&2
      exit 2
    fi
    site
    detach "$1" "python3 -m benchsuite run configs/h200/$1.yaml --run-id $RUN_PREFIX-$1${RUN_SUFFIX:-} --no-report"
    ;;
esac
collect
for f in "$JOBS"/*.log; do [ -f "$f" ] && { echo "== $(basename "$f")"; tail -n 4 "$f"; }; done
true  # a detached job's log may not exist yet: what is printed here never fails the call (`prepare && ...`)
