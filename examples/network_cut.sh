#!/usr/bin/env bash
# Real network cuts on one machine (needs root and iproute2): a separate coordinator and two training nodes, with one
# party in a network namespace of its own joined by veth links; a link is set down at step 8 for CUT_S seconds (every
# packet lost both ways, no connection closed, as when a cable or a switch port goes), then up again.
#   examples/network_cut.sh node         node 1 cut off from everything: fenced after the heartbeat timeout, the run
#                                        goes on; reconnected, node 1 learns it was fenced and exits with one line
#   examples/network_cut.sh coordinator  the coordinator cut off from every node: it declares none of them dead, the
#                                        nodes train on, and the run carries on when the link is back
#   examples/network_cut.sh data         node 1 keeps its control link (to the coordinator) and loses its data link
#                                        (gloo, to node 0): a partial partition
# Env: CUT_S (default 15), STEPS (80), OUT (a fresh temporary folder). Prints the coordinator's recovery lines and
# each process's exit code; the logs stay in OUT.
set -euo pipefail
mode=${1:-}
case "$mode" in node|coordinator|data) ;; *) echo "usage: $0 node|coordinator|data" >&2; exit 2 ;; esac
if [[ $(id -u) != 0 ]] || ! command -v ip > /dev/null; then
    echo "error: a network cut needs root and iproute2 (ip) to make a network namespace" >&2; exit 2
fi
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CUT_S=${CUT_S:-15}
STEPS=${STEPS:-80}
OUT=${OUT:-$(mktemp -d -t recycle-cut-XXXX)}
NS=rcycut$$
RECYCLE_JOB_TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(24))')
export RECYCLE_JOB_TOKEN
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done
    ip link del rcyc$$ 2> /dev/null || true
    ip link del rcyd$$ 2> /dev/null || true
    ip netns del "$NS" 2> /dev/null || true
}
trap cleanup EXIT

# Two links into the namespace: control (10.213.0.0/24) and data (10.214.0.0/24).
ip netns add "$NS"
ip netns exec "$NS" ip link set lo up
for link in c:213 d:214; do
    name=${link%%:*} net=${link##*:}
    ip link add rcy$name$$ type veth peer name rcyn$name$$
    ip link set rcyn$name$$ netns "$NS"
    ip addr add 10.$net.0.1/24 dev rcy$name$$
    ip link set rcy$name$$ up
    ip netns exec "$NS" ip addr add 10.$net.0.2/24 dev rcyn$name$$
    ip netns exec "$NS" ip link set rcyn$name$$ up
done

inside=(ip netns exec "$NS")
port=$((20000 + RANDOM % 20000))
case "$mode" in
    node)        addr=10.213.0.1; coordinator=(); node0=(env GLOO_SOCKET_IFNAME=rcyc$$)
                 node1=("${inside[@]}" env GLOO_SOCKET_IFNAME=rcync$$); cut=rcyc$$ ;;
    coordinator) addr=10.213.0.2; coordinator=("${inside[@]}"); node0=(env GLOO_SOCKET_IFNAME=lo)
                 node1=(env GLOO_SOCKET_IFNAME=lo); cut=rcyc$$ ;;
    data)        addr=10.213.0.1; coordinator=(); node0=(env GLOO_SOCKET_IFNAME=rcyd$$)
                 node1=("${inside[@]}" env GLOO_SOCKET_IFNAME=rcynd$$); cut=rcyd$$ ;;
esac
flags=(--config configs/tiny-gpt.toml --steps "$STEPS" --nnodes 2 --master-addr "$addr" --master-port "$port"
       --save "$OUT/final.pt" --heartbeat-timeout 2 --timeout 10)
node=(-m recycle train "${flags[@]}" --coordinator separate --emulate-costs --slot-ms 20)
"${coordinator[@]}" "$PY" -m recycle coordinator "${flags[@]}" > "$OUT/coordinator.log" 2>&1 &
pids+=($!)
"${node0[@]}" "$PY" "${node[@]}" --node-rank 0 > "$OUT/node0.log" 2>&1 &
pids+=($!)
"${node1[@]}" "$PY" "${node[@]}" --node-rank 1 > "$OUT/node1.log" 2>&1 &
pids+=($!)
echo "logs in $OUT"
until grep -q "^step 8/" "$OUT/coordinator.log"; do
    sleep 0.2
    kill -0 "${pids[0]}" 2> /dev/null || { echo "the coordinator ended before step 8:"; tail "$OUT"/*.log; exit 1; }
done
ip link set "$cut" down
echo "$(date +%T) cut ($mode) for $CUT_S s"
sleep "$CUT_S"
ip link set "$cut" up
echo "$(date +%T) link back"
names=(coordinator "node 0" "node 1")
for i in 0 1 2; do
    # A process that outlives the run (a node cut off until the end waits --coordinator-grace) is stopped after 120 s.
    timeout 120 tail --pid="${pids[$i]}" -f /dev/null || kill "${pids[$i]}" 2> /dev/null || true
    code=0; wait "${pids[$i]}" || code=$?
    echo "$(date +%T) ${names[$i]} exited with $code"
done
grep -v "^step [0-9]*/" "$OUT/coordinator.log" | grep -E "step [0-9]+:|stopped responding|answer again|error" || true
