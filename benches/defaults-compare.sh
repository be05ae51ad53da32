#!/usr/bin/env bash
# Ferry as shipped against NIXL 1.5.1 as shipped: `ferry bench xfer` with no settings
# (the system's libucp, no UCX_* tuning, no backend parameters) against NIXL's defaults
# (`nixl_agent(name)`, the UCX backend it creates by default, its bundled UCX 1.23),
# the same workloads timed the same way, in ONE interleaved run. Issue 20, item 1.
#
#   benches/defaults-compare.sh                      # 3 rounds, settings a and b
#   ROUNDS=5 benches/defaults-compare.sh
#   SETTINGS=a benches/defaults-compare.sh           # only one setting (a or b)
#   ITERS_A=10000,300,10 ITERS_B=1000,150,10 ...     # timed iterations, 4 KiB,1 MiB,64 MiB
#   KEEP=/tmp/cmp-logs ...                           # keep every log and results.tsv
#   FERRY_BIN=target/release/ferry benches/defaults-compare.sh   # skip the build
#   BLOCKS=4096 ...                                  # only some of the blocks (bytes)
#   FERRY_PARAMS="ucx.progress_thread_spin_us=200" ... # Ferry not as shipped: --param
#                                                    # each word, both roles (in the header)
#
# Settings (each exactly the same for both sides; every process starts from `env -i`
# with PATH and HOME only, plus the variables named here):
#   (a) one host: two processes, no UCX_* variable at all (UCX picks transports and
#       devices itself on both sides: shared memory / CMA / tcp as each version sees fit).
#   (b) two "hosts": network namespaces joined by a veth pair (the end in each is named
#       fv0, 10.237.0.1 target / 10.237.0.2 initiator), UCX_TLS=tcp and
#       UCX_NET_DEVICES=fv0 on both sides. Needs root (skipped with a message otherwise).
#
# Rows: blocks of 4 KiB, 1 MiB and 64 MiB, one descriptor per request, WRITE and READ.
# Both sides: one initiator pinned to CPU 0 and one target pinned to CPU 1 (taskset),
# the request made once, then $WARMUP untimed and N timed iterations of post + poll until
# the initiator sees it complete (one request in flight); GB/s = 1e9 bytes per second
# over the timed iterations' wall time (Ferry's `gbps` column). Same N on both sides
# (ITERS_A, ITERS_B: per setting, for 4 KiB,1 MiB,64 MiB; WARMUP, 3 at most at 64 MiB).
# Buffers: the block (at least 4 KiB) per side, from glibc's calloc on both sides
# (Ferry: `vec![0u8; len]`; NIXL: ctypes calloc), every page written before
# registration. So the alignment is Ferry's, which is not page alignment: 4 KiB buffers
# come from the heap (16-byte aligned), 1 MiB and 64 MiB ones from mmap at page + 16
# bytes; NIXL's print `buffer_addr_mod_4096` to show theirs.
#
# Ferry side: `ferry store serve` (its TCPStore, the rendezvous) and
#   ferry bench xfer --role target    --tcpstore ADDR --run-id ID --start-block B --max-block B
#   ferry bench xfer --role initiator --tcpstore ADDR --run-id ID --start-block B --max-block B
#                    --op write,read --iters N --warmup W --json FILE
#   (no --backend: the default set; FERRY_BACKEND=ucx runs `--backend ucx` instead)
# (explicit roles on one host too, so the target can be pinned to its own CPU; `--role
# auto` would spawn the same target, pinned with the initiator). NIXL side:
# benches/defaults_nixl.py (target / initiator, metadata blobs through files).
#
# Rounds are interleaved: in each round, each block runs Ferry then NIXL (odd rounds) or
# NIXL then Ferry (even rounds); each pair of processes runs under the shared lock
# /tmp/ferry-bench.lock (other benchmarks wait while it runs, and it waits for them).
#
# How to read it: the header lists both sides' configuration (libraries, env, params).
# The table gives, per setting × op × block, the median GB/s over the rounds with the
# range (min–max), and Ferry ÷ NIXL of the medians (> 1: Ferry faster). Raw per-round
# figures are printed before the table, and kept in $KEEP (if set) as results.tsv.
set -euo pipefail
exec 3>&2   # the script's own stderr, for messages from inside redirected blocks

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
started_at=$(date +%s)

ROUNDS="${ROUNDS:-3}"
SETTINGS="${SETTINGS:-a,b}"
WARMUP="${WARMUP:-10}"
# Timed iterations per block (4 KiB, 1 MiB, 64 MiB), per setting, the same for both
# sides; chosen so that the slower side's cell takes a few seconds on this 2-core machine
# (NIXL's 4 KiB over tcp takes ~1-4 ms a request, Ferry's ~0.3 ms).
ITERS_A="${ITERS_A:-10000,300,10}"
ITERS_B="${ITERS_B:-1000,150,10}"
LOCK="${FERRY_BENCH_LOCK:-/tmp/ferry-bench.lock}"
ALL_BLOCKS=(4096 1048576 67108864)
IFS=, read -r -a BLOCKS <<<"${BLOCKS:-4096,1048576,67108864}"
for b in "${BLOCKS[@]}"; do
  case " ${ALL_BLOCKS[*]} " in *" $b "*) ;; *) echo "BLOCKS: $b is not one of ${ALL_BLOCKS[*]}" >&2; exit 2 ;; esac
done
ferry_params=()
for p in ${FERRY_PARAMS:-}; do ferry_params+=(--param "$p"); done
iters_for() {
  local list i
  if [ "$1" = a ]; then list="$ITERS_A"; else list="$ITERS_B"; fi
  IFS=, read -r -a list <<<"$list"
  for i in 0 1 2; do
    if [ "${ALL_BLOCKS[$i]}" = "$2" ]; then echo "${list[$i]}"; return; fi
  done
}
warmup_for() {
  # 64 MiB: fewer untimed iterations (the same on both sides).
  if [ "$1" -ge 67108864 ]; then echo $((WARMUP < 3 ? WARMUP : 3)); else echo "$WARMUP"; fi
}

# --- the two sides' software --------------------------------------------------------
# NIXL's venv (nixl-cu12 1.5.1 --no-deps + numpy). nixl-venv.sh also exports
# FERRY_UCX_LIBRARY (the wheel's libucp) for its own comparisons: not here, Ferry must
# load the system's libucp.so.0.
# shellcheck source=../backends/ucx/bench/nixl-venv.sh
. "$root/backends/ucx/bench/nixl-venv.sh" 2>/dev/null
unset FERRY_UCX_LIBRARY
python="$venv/bin/python"

if [ -z "${FERRY_BIN:-}" ]; then
  echo "building ferry (cargo build --release -p ferry-tools --bin ferry) ..." >&2
  (cd "$root" && cargo build -q --release -p ferry-tools --bin ferry) >&2
  FERRY_BIN="${CARGO_TARGET_DIR:-$root/target}/release/ferry"
fi
FERRY_BIN="$(readlink -f "$FERRY_BIN")"
[ -x "$FERRY_BIN" ] || { echo "no ferry binary at $FERRY_BIN" >&2; exit 1; }

# --- scratch, processes, namespaces, and their cleanup ------------------------------
tmp="$(mktemp -d /tmp/ferry-defaults-compare.XXXXXX)"
results="$tmp/results.tsv"
: >"$results"
pids=()     # our children not yet reaped (a reaped pid may belong to someone else soon)
netns=()
forget() {
  local keep=() p
  for p in "${pids[@]}"; do
    [ "$p" = "$1" ] || keep+=("$p")
  done
  pids=("${keep[@]}")
}
cleanup() {
  local p ns q
  for p in "${pids[@]}"; do
    kill "$p" 2>/dev/null || true
  done
  for ns in "${netns[@]}"; do
    # Whatever still runs in a namespace this script made is ours.
    for q in $(ip netns pids "$ns" 2>/dev/null); do kill "$q" 2>/dev/null || true; done
  done
  sleep 0.2
  for p in "${pids[@]}"; do
    kill -9 "$p" 2>/dev/null || true
  done
  for ns in "${netns[@]}"; do
    ip netns del "$ns" 2>/dev/null || true
  done
  if [ -n "${KEEP:-}" ]; then
    mkdir -p "$KEEP" && cp -r "$tmp"/. "$KEEP"/ 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Every process starts from this environment (nothing inherited: no UCX_*, no
# FERRY_*, no RUST_LOG), plus the setting's UCX variables.
base_env=(env -i "PATH=$PATH" "HOME=${HOME:-/root}")
setting_env=()      # the setting's UCX_* (set per setting)
ns_target=()        # prefix that runs a command on the target's host
ns_initiator=()     # ... on the initiator's host
store_addr=""

ns_a="ferry-cmp-$$-a"
ns_b="ferry-cmp-$$-b"
addr_a=10.237.0.1
addr_b=10.237.0.2
dev=fv0

make_netns() {
  ip netns add "$ns_a" || return 1
  netns+=("$ns_a")
  ip netns add "$ns_b" || return 1
  netns+=("$ns_b")
  ip -n "$ns_a" link add "$dev" type veth peer name "$dev" netns "$ns_b"
  ip -n "$ns_a" addr add "$addr_a/24" dev "$dev"
  ip -n "$ns_b" addr add "$addr_b/24" dev "$dev"
  local ns
  for ns in "$ns_a" "$ns_b"; do
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "$dev" up
  done
  local i
  for i in $(seq 100); do
    if ip -n "$ns_a" link show "$dev" | grep -q LOWER_UP \
      && ip -n "$ns_b" link show "$dev" | grep -q LOWER_UP; then
      return 0
    fi
    sleep 0.05
  done
  echo "veth $dev has no carrier" >&2
  return 1
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Wait (bounded, $2 s) for pid $1 to end; kill it if it does not. Its status goes to
# $waited_rc (not through $(...): a subshell cannot wait for this shell's children).
waited_rc=0
wait_bounded() {
  local p=$1 limit=$2 i
  for i in $(seq $((limit * 20))); do
    kill -0 "$p" 2>/dev/null || break
    sleep 0.05
  done
  if kill -0 "$p" 2>/dev/null; then
    echo "  (pid $p still running after ${limit}s: killing it)" >&3
    kill "$p" 2>/dev/null || true
  fi
  waited_rc=0
  wait "$p" 2>/dev/null || waited_rc=$?
  forget "$p"
}

start_store() {
  local listen
  if [ "$1" = a ]; then
    listen="127.0.0.1:$(free_port)"
  else
    listen="$addr_a:29500"
  fi
  "${ns_target[@]}" taskset -c 1 "${base_env[@]}" "$FERRY_BIN" store serve --listen "$listen" \
    >"$tmp/store-$1.log" 2>&1 9>&- &
  store_pid=$!
  pids+=("$store_pid")
  local i
  for i in $(seq 100); do
    if "${ns_initiator[@]}" "${base_env[@]}" "$FERRY_BIN" store list --endpoint "$listen" \
      --timeout 1 >/dev/null 2>&1; then
      store_addr="$listen"
      return 0
    fi
    sleep 0.1
  done
  echo "ferry store serve did not come up on $listen:" >&2
  cat "$tmp/store-$1.log" >&2
  return 1
}

stop_store() {
  kill "$store_pid" 2>/dev/null || true
  wait "$store_pid" 2>/dev/null || true
  forget "$store_pid"
}

# Run "$@" as a child of ours and wait for it: through `wait`, which the INT/TERM traps
# interrupt (a plain foreground command would hold them back until it ended). Its
# status goes to $fg_rc.
fg_rc=0
run_fg() {
  "$@" 9>&- &
  local p=$!
  pids+=("$p")
  fg_rc=0
  wait "$p" || fg_rc=$?
  forget "$p"
}

# The libucp a process mapped (from /proc/PID/maps), waited for up to 10 s.
libucp_of() {
  local p=$1 i lib
  for i in $(seq 200); do
    lib="$(grep -m1 -o '/[^ ]*libucp[^ ]*' "/proc/$p/maps" 2>/dev/null || true)"
    if [ -n "$lib" ]; then echo "$lib"; return 0; fi
    kill -0 "$p" 2>/dev/null || break
    sleep 0.05
  done
  echo "?"
}

run_id_seq=0
# One Ferry pair: target (CPU 1) and initiator (CPU 0), WRITE then READ of block $3.
run_ferry() {
  local setting=$1 round=$2 block=$3 iters warmup id log json tpid ipid rc trc lib
  iters=$(iters_for "$setting" "$block")
  warmup=$(warmup_for "$block")
  run_id_seq=$((run_id_seq + 1))
  id="cmp-$$-$run_id_seq"
  log="$tmp/ferry-$setting-$round-$block"
  json="$log.json"
  local sizes=(--start-block "$block" --max-block "$block")
  exec 9>"$LOCK"
  flock 9
  "${ns_target[@]}" taskset -c 1 "${base_env[@]}" "${setting_env[@]}" "$FERRY_BIN" \
    bench xfer ${FERRY_BACKEND:+--backend "$FERRY_BACKEND"} --role target --tcpstore "$store_addr" --run-id "$id" "${sizes[@]}" "${ferry_params[@]}" \
    >"$log.target" 2>&1 9>&- &
  tpid=$!
  pids+=("$tpid")
  # The target has created its backend once it maps libucp: note which one.
  lib="$(libucp_of "$tpid")"
  if [ "$round" = 1 ]; then
    # Its buffer's address, from the metadata it publishes (untimed: before the initiator).
    "${ns_initiator[@]}" "${base_env[@]}" "$FERRY_BIN" md fetch "$id-target-0" \
      --tcpstore "$store_addr" -o "$log.md" --timeout 10 >/dev/null 2>&1 9>&- || true
    local addr
    addr="$("$FERRY_BIN" inspect "$log.md" 2>/dev/null | grep -m1 -o 'addr 0x[0-9a-f]*' || true)"
    if [ -n "$addr" ]; then
      echo "$setting $block $((${addr#addr } % 4096))" >>"$tmp/ferry-align"
    fi
  fi
  run_fg "${ns_initiator[@]}" timeout 300 taskset -c 0 "${base_env[@]}" "${setting_env[@]}" "$FERRY_BIN" \
    bench xfer ${FERRY_BACKEND:+--backend "$FERRY_BACKEND"} --role initiator --tcpstore "$store_addr" --run-id "$id" "${sizes[@]}" "${ferry_params[@]}" \
    --op write,read --iters "$iters" --warmup "$warmup" --json "$json" \
    >"$log.initiator" 2>&1
  rc=$fg_rc
  wait_bounded "$tpid" 30
  trc=$waited_rc
  flock -u 9
  exec 9>&-
  echo "$setting ferry-target-libucp $lib" >>"$tmp/libs"
  if [ "$rc" != 0 ] || [ ! -s "$json" ]; then
    echo "  Ferry $setting block $block round $round failed (initiator $rc, target $trc):" >&2
    tail -5 "$log.initiator" "$log.target" >&2
    return 0
  fi
  [ "$trc" = 0 ] || echo "  (Ferry target exited with $trc after the run)" >&2
  python3 - "$json" "$setting" "$round" >>"$results" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
for row in doc["rows"]:
    print(f"{sys.argv[2]}\tFerry\t{row['op']}\t{row['block_bytes']}\t{sys.argv[3]}\t{row['gbps']}")
EOF
  [ -s "$tmp/ferry-config-$setting" ] || python3 - "$json" >"$tmp/ferry-config-$setting" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
cfg = doc.get("config", {})
items = cfg.items() if isinstance(cfg, dict) else cfg
print("; ".join(f"{k}: {v}" for k, v in items))
EOF
}

# One NIXL pair: the same shape.
run_nixl() {
  local setting=$1 round=$2 block=$3 iters warmup dir log tpid rc trc
  iters=$(iters_for "$setting" "$block")
  warmup=$(warmup_for "$block")
  dir="$tmp/nixl-$setting-$round-$block"
  mkdir -p "$dir"
  log="$dir/log"
  exec 9>"$LOCK"
  flock 9
  "${ns_target[@]}" taskset -c 1 "${base_env[@]}" "${setting_env[@]}" "$python" \
    "$here/defaults_nixl.py" target --dir "$dir" --block "$block" \
    >"$log.target" 2>&1 9>&- &
  tpid=$!
  pids+=("$tpid")
  # NIXL's processes crash at exit (below): the `{ } 2>/dev/null` keeps bash's own
  # "Segmentation fault" reports of them out of the output (the statuses are counted).
  {
    run_fg "${ns_initiator[@]}" timeout 300 taskset -c 0 "${base_env[@]}" "${setting_env[@]}" "$python" \
      "$here/defaults_nixl.py" initiator --dir "$dir" --block "$block" --ops WRITE,READ \
      --iters "$iters" --warmup "$warmup" >"$log.initiator" 2>&1
    wait_bounded "$tpid" 30
  } 2>/dev/null
  rc=$fg_rc
  trc=$waited_rc
  flock -u 9
  exec 9>&-
  local got
  got="$(grep -c '^NIXL .* gbps ' "$log.initiator" || true)"
  if [ "$got" != 2 ]; then
    echo "  NIXL $setting block $block round $round failed (initiator $rc, target $trc):" >&2
    grep -v ' INFO ' "$log.initiator" "$log.target" | tail -6 >&2
    return 0
  fi
  # NIXL 1.5.1's processes die with SIGSEGV (139) while tearing the UCX backend down at
  # exit, after the figures are printed: counted, not fatal.
  if [ "$rc" != 0 ] || [ "$trc" != 0 ]; then
    echo "$setting initiator=$rc target=$trc" >>"$tmp/nixl-exit-codes"
  fi
  awk -v s="$setting" -v r="$round" '/^NIXL .* gbps /{print s "\tNIXL\t" $2 "\t" $4 "\t" r "\t" $NF}' \
    "$log.initiator" >>"$results"
  if [ "$round" = 1 ]; then
    for f in initiator target; do
      grep -m1 '^config: ' "$log.$f" >>"$tmp/nixl-config-$setting" || true
    done
  fi
}

# --- the header ----------------------------------------------------------------------
sys_libucp="$(ldconfig -p | awk '/libucp\.so\.0 / && !f {print $NF; f = 1}')"   # reads to the end: an early exit would SIGPIPE ldconfig under pipefail
ferry_backends="$("${base_env[@]}" RUST_LOG=ferry_ucx=info NO_COLOR=1 "$FERRY_BIN" backends 2>&1 || true)"
ferry_ucx_line="$(printf '%s\n' "$ferry_backends" | sed 's/\x1b\[[0-9;]*m//g' \
  | grep -o 'UCX [0-9.]* .* loaded from .*' | head -1)"
[ -n "$ferry_ucx_line" ] || ferry_ucx_line='?' 
nixl_version="$("$python" -c 'import importlib.metadata as m; print(m.version("nixl-cu12"))')"
nixl_libucp="$(ls "$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"/nixl_cu12.libs/libucp-*.so* | head -1)"
nixl_ucx_version="$("$python" -c 'import ctypes,sys; l=ctypes.CDLL(sys.argv[1]); l.ucp_get_version_string.restype=ctypes.c_char_p; print(l.ucp_get_version_string().decode())' "$nixl_libucp" 2>/dev/null || echo '?')"

echo "# Ferry (shipped defaults) vs NIXL $nixl_version (defaults), issue 20 item 1"
echo
echo "- when: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); host: $(hostname), $(nproc) CPUs, $(uname -r), load average $(cut -d' ' -f1-3 /proc/loadavg), THP $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo '?')"
echo "- Ferry: $FERRY_BIN ($("$FERRY_BIN" --version)), repository at $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$root" diff --quiet HEAD -- 2>/dev/null || echo ' (+ local changes)'); libucp: the system's libucp.so.0 -> $sys_libucp ($ferry_ucx_line; FERRY_UCX_LIBRARY unset, no ucx_library)"
echo "- Ferry params: ${FERRY_PARAMS:-none} (\`ferry bench xfer${FERRY_BACKEND:+ --backend $FERRY_BACKEND}\`: ${FERRY_BACKEND:-the default backend set LOOPBACK, SHM, UCX, POSIX, each peer taking the first that reaches it}, backend defaults; the target role turns its own progress_thread=true on by default); rendezvous: \`ferry store serve\` (TCPStore), pinned to CPU 1"
echo "- NIXL: nixl-cu12 $nixl_version from $venv (--no-deps + numpy), \`nixl_agent(name)\` with the default nixl_agent_config (backends [\"UCX\"] with default init params, progress thread on); libucp: $nixl_libucp (UCX $nixl_ucx_version); rendezvous: metadata blobs through files"
echo "- both: initiator on CPU 0, target on CPU 1 (taskset); one descriptor per request; request made once per op, $WARMUP warm-up (3 at 64 MiB) + timed iterations (4 KiB, 1 MiB, 64 MiB): (a) $ITERS_A, (b) $ITERS_B; buffers calloc'd, block-sized (≥ 4 KiB); environment \`env -i PATH HOME\` + the setting's:"
echo "  - (a) one host: no UCX_* variables"
echo "  - (b) two netns joined by veth $dev ($addr_a target, $addr_b initiator): UCX_TLS=tcp UCX_NET_DEVICES=$dev"
echo "- rounds: $ROUNDS, interleaved (Ferry first in odd rounds, NIXL first in even), each pair under flock $LOCK"
echo

# --- the rounds ------------------------------------------------------------------------
IFS=, read -r -a settings <<<"$SETTINGS"
ran_settings=()
for setting in "${settings[@]}"; do
  case "$setting" in
    a)
      setting_env=()
      ns_target=()
      ns_initiator=()
      ;;
    b)
      if [ "$(id -u)" != 0 ]; then
        echo "setting (b) skipped: network namespaces need root (this is uid $(id -u))" >&2
        continue
      fi
      if ! make_netns; then
        echo "setting (b) skipped: could not make the network namespaces" >&2
        continue
      fi
      setting_env=(UCX_TLS=tcp "UCX_NET_DEVICES=$dev")
      ns_target=(ip netns exec "$ns_a")
      ns_initiator=(ip netns exec "$ns_b")
      ;;
    *)
      echo "unknown setting '$setting' (a or b)" >&2
      exit 2
      ;;
  esac
  start_store "$setting"
  ran_settings+=("$setting")
  for round in $(seq "$ROUNDS"); do
    for block in "${BLOCKS[@]}"; do
      if [ $((round % 2)) = 1 ]; then
        run_ferry "$setting" "$round" "$block"
        run_nixl "$setting" "$round" "$block"
      else
        run_nixl "$setting" "$round" "$block"
        run_ferry "$setting" "$round" "$block"
      fi
      echo "($setting) round $round/$ROUNDS: $block B done ($(($(date +%s) - started_at)) s)" >&2
    done
  done
  stop_store
done

# --- what the runs saw, then the table -------------------------------------------------
for setting in "${ran_settings[@]}"; do
  echo "## setting ($setting): configuration as the runs reported it"
  echo
  echo "- Ferry initiator (the first run's --json config): $(cat "$tmp/ferry-config-$setting" 2>/dev/null || echo '?')"
  echo "- Ferry target buffers, address mod 4096 (block: value): $(awk -v s="$setting" '$1 == s {printf "%s: %s; ", $2, $3}' "$tmp/ferry-align" 2>/dev/null)"
  echo "- Ferry targets mapped: $(awk -v s="$setting" '$1 == s {print $3}' "$tmp/libs" 2>/dev/null | sort | uniq -c | awk '{printf "%s (%d runs) ", $2, $1}')"
  python3 - "$tmp/nixl-config-$setting" <<'EOF'
import collections, re, sys
try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError:
    lines = []
common = collections.defaultdict(set)
align = collections.defaultdict(dict)
for line in lines:
    m = re.match(r"config: NIXL (\w+) agent=\S+ (.*) buffer_len=(\d+) buffer_addr_mod_4096=(\d+) (.*)", line)
    if m:
        role, before, length, mod, after = m.groups()
        common[role].add(f"{before} {after}")
        align[role][int(length)] = mod
for role in sorted(common):
    for c in sorted(common[role]):
        print(f"- NIXL {role}: {c}")
    print(f"- NIXL {role} buffers, address mod 4096 (length: value): "
          + "; ".join(f"{n}: {v}" for n, v in sorted(align[role].items())))
EOF
  if [ -s "$tmp/nixl-exit-codes" ] && grep -q "^$setting " "$tmp/nixl-exit-codes"; then
    echo "- NIXL exit statuses other than 0 (after the figures were printed): $(grep "^$setting " "$tmp/nixl-exit-codes" | cut -d' ' -f2- | sort | uniq -c | awk '{$1=$1" ×"; print}' | paste -sd ';' -)"
  fi
  echo
done

echo "## per-round GB/s"
echo
echo '```'
sort -k1,1 -k3,3r -k4,4n -k2,2 -k5,5n "$results" | awk -F'\t' '{printf "%s %-5s %-5s %9s round %s  %.3f\n", $1, $2, $3, $4, $5, $6}'
echo '```'
echo
python3 - "$results" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    setting, side, op, block, rnd, gbps = line.rstrip("\n").split("\t")
    runs[(setting, op, int(block), side)].append(float(gbps))
keys = sorted({(s, o, b) for s, o, b, _ in runs}, key=lambda k: (k[0], k[1] != "WRITE", k[2]))
name = {"a": "(a) one host", "b": "(b) netns + veth, tcp"}
def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
print("| setting | op | block | Ferry GB/s median (range) | NIXL GB/s median (range) | Ferry ÷ NIXL |")
print("|---|---|---|---|---|---|")
for s, o, b in keys:
    cells, meds = [], []
    for side in ("Ferry", "NIXL"):
        v = sorted(runs.get((s, o, b, side), []))
        if not v:
            cells.append("—"); meds.append(None); continue
        m = statistics.median(v)
        meds.append(m)
        cells.append(f"{m:.3f} ({v[0]:.3f}–{v[-1]:.3f}, n={len(v)})")
    ratio = f"{meds[0] / meds[1]:.2f}×" if None not in meds and meds[1] else "—"
    print(f"| {name.get(s, s)} | {o} | {size(b)} | {cells[0]} | {cells[1]} | {ratio} |")
EOF
echo
echo "took $(($(date +%s) - started_at)) s; load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
