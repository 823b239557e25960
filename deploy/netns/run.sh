#!/usr/bin/env bash
# Multi-host test of a real floe cluster: every process gets its own network namespace (its
# own "host" with its own address), joined by a Linux bridge, and is started with the same
# flags and env file the systemd units use.
#
#   deploy/netns/run.sh /path/to/floe        (or FLOE_BIN=/path/to/floe deploy/netns/run.sh)
#
# Exit 0: every check passed. Exit 1: a check failed (the FAIL line says which; the hosts'
# logs are printed). Exit 77: this machine cannot run the test (not root, no `ip`, no network
# namespaces); a `SKIP: <why>` line says why. Exit 2: bad usage.
# FLOE_NETNS_KEEP=1 keeps the temporary directory (env files, logs, data) for inspection.
set -euo pipefail

readonly SUBNET=10.77.0
readonly RPC_PORT=7700
readonly NODE_RPC_PORT=7800
readonly HTTP_PORT=7780
readonly SCHEDULER_HOSTS=(s1 s2 s3)
readonly NODE_HOSTS=(n1 n2 n3)
readonly CLIENT_HOST=c1
# Each check polls at most this long; the whole run takes about a minute.
readonly WAIT_SECONDS=40

skip() {
    echo "SKIP: $*"
    exit 77
}

BIN=${1:-${FLOE_BIN:-}}
if [[ -z $BIN ]]; then
    echo "usage: $0 /path/to/floe   (or set FLOE_BIN)" >&2
    exit 2
fi
((EUID == 0)) || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "the ip command (iproute2) is not installed"
command -v openssl >/dev/null || skip "the openssl command is not installed (it makes the cluster's certificates)"
if [[ ! -x $BIN ]]; then
    echo "FAIL: $BIN is not an executable floe binary" >&2
    exit 1
fi
BIN=$(readlink -f "$BIN")

# Names unique to this run, so concurrent runs never clash; interface names live inside the
# run's own namespaces, so they can stay short.
readonly PREFIX="floe-t$$"
readonly SWITCH="$PREFIX-sw"
START_SECONDS=$SECONDS
TMP=""
SCHEDULER_PIDS=()
NODE_PIDS=()
SUBMIT_PID=""
NAMESPACES=()
FAILED=0
# Whether this run created /etc/netns, which it then removes if it is empty again.
CREATED_ETC_NETNS=0

ns() { echo "$PREFIX-$1"; }

address_of() {
    case $1 in
    s1) echo "$SUBNET.11" ;;
    s2) echo "$SUBNET.12" ;;
    s3) echo "$SUBNET.13" ;;
    n1) echo "$SUBNET.21" ;;
    n2) echo "$SUBNET.22" ;;
    n3) echo "$SUBNET.23" ;;
    c1) echo "$SUBNET.31" ;;
    *) return 1 ;;
    esac
}

log() { printf '[%3ds] %s\n' $((SECONDS - START_SECONDS)) "$*"; }
pass() { log "PASS: $*"; }
fail() {
    log "FAIL: $*"
    FAILED=1
    exit 1
}

print_logs() {
    local file
    for file in "$TMP"/logs/*.log; do
        [[ -e $file ]] || continue
        echo "----- last lines of ${file##*/} -----"
        tail -n 25 "$file"
    done
}

# Stops processes: SIGTERM (a node then leaves the cluster and unlinks its shared memory),
# SIGKILL for any still running 8 s later.
stop_pids() {
    local pid waited=0 running
    (($#)) || return 0
    kill -TERM "$@" 2>/dev/null
    while ((waited < 80)); do
        running=0
        for pid in "$@"; do
            kill -0 "$pid" 2>/dev/null && running=1
        done
        ((running)) || break
        sleep 0.1
        waited=$((waited + 1))
    done
    for pid in "$@"; do
        if kill -0 "$pid" 2>/dev/null; then
            log "process $pid ignored SIGTERM for 8 s; killing it"
            kill -KILL "$pid" 2>/dev/null
        fi
        wait "$pid" 2>/dev/null
    done
    return 0
}

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    set +e
    if ((status != 0 || FAILED)) && [[ -n $TMP ]]; then
        print_logs
    fi
    if [[ -n $SUBMIT_PID ]]; then
        stop_pids "$SUBMIT_PID"
    fi
    # Nodes first, so they can still tell the schedulers they leave.
    stop_pids "${NODE_PIDS[@]}"
    stop_pids "${SCHEDULER_PIDS[@]}"
    local pid
    for pid in "${NODE_PIDS[@]}"; do
        if [[ -e /dev/shm/floe-node-$pid ]]; then
            log "node process $pid left its shared-memory segment behind; removing it"
            rm -f "/dev/shm/floe-node-$pid"
        fi
    done
    local name
    for name in "${NAMESPACES[@]}"; do
        ip netns del "$name" 2>/dev/null
        rm -rf "/etc/netns/$name"
    done
    if ((CREATED_ETC_NETNS)); then
        rmdir /etc/netns 2>/dev/null
    fi
    if [[ -n $TMP ]]; then
        if [[ ${FLOE_NETNS_KEEP:-0} == 1 ]]; then
            log "kept $TMP"
        else
            rm -rf "$TMP"
        fi
    fi
    if ((status == 0 && !FAILED)); then
        log "PASS: netns multi-host test ($((SECONDS - START_SECONDS)) s)"
    else
        log "FAIL: netns multi-host test ($((SECONDS - START_SECONDS)) s)"
        status=1
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# --- hosts and network ---------------------------------------------------------------------

# The bridge lives in a namespace of its own: the host's firewall (e.g. br_netfilter with a
# FORWARD policy of DROP) never sees the test's traffic, and nothing is left in the root
# namespace if cleanup is interrupted.
if ! ip netns add "$SWITCH" 2>/dev/null; then
    skip "cannot create network namespaces here (ip netns add failed)"
fi
NAMESPACES+=("$SWITCH")
if [[ ! -d /etc/netns ]]; then
    CREATED_ETC_NETNS=1
fi
ip -n "$SWITCH" link add br0 type bridge
ip -n "$SWITCH" link set br0 up

# Host names resolve through /etc/netns/<namespace>/hosts, which `ip netns exec` mounts over
# /etc/hosts, so the replica lists use names, as the compose file and Kubernetes do.
hosts_file() {
    local host
    echo "127.0.0.1 localhost"
    for host in "${SCHEDULER_HOSTS[@]}" "${NODE_HOSTS[@]}" "$CLIENT_HOST"; do
        echo "$(address_of "$host") floe-$host"
    done
}

add_host() {
    local host=$1 name
    name=$(ns "$host")
    ip netns add "$name"
    NAMESPACES+=("$name")
    mkdir -p "/etc/netns/$name"
    hosts_file >"/etc/netns/$name/hosts"
    ip -n "$SWITCH" link add "$host" type veth peer name eth0 netns "$name"
    ip -n "$SWITCH" link set "$host" master br0 up
    ip -n "$name" link set lo up
    ip -n "$name" addr add "$(address_of "$host")/24" dev eth0
    ip -n "$name" link set eth0 up
}

for host in "${SCHEDULER_HOSTS[@]}" "${NODE_HOSTS[@]}" "$CLIENT_HOST"; do
    add_host "$host"
done
pass "7 hosts on a bridge: schedulers floe-s1..3 ($SUBNET.11-13), nodes floe-n1..3 ($SUBNET.21-23), client floe-c1 ($SUBNET.31)"

# --- configuration, as deploy/systemd/floe.env.example lays it out ---------------------------

TMP=$(mktemp -d /tmp/floe-netns.XXXXXX)
mkdir -p "$TMP/logs" "$TMP/input" "$TMP/jobs"
chmod 0755 "$TMP"
CLUSTER_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
REPLICA_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
# The client tokens every replica and node reads (a copy of /var/lib/floe/tokens on each host).
TOKENS_FILE=$TMP/tokens
CLIENT_TOKEN=$(env -i PATH="$PATH" "$BIN" token create --name ci --scopes submit \
    --set "auth.tokens_file=$TOKENS_FILE" 2>/dev/null) ||
    fail "floe token create could not write $TOKENS_FILE"
SCHEDULER_PEERS=""
SCHEDULER_ADDRS=""
for index in "${!SCHEDULER_HOSTS[@]}"; do
    address=floe-${SCHEDULER_HOSTS[index]}:$RPC_PORT
    SCHEDULER_PEERS+="${SCHEDULER_PEERS:+,}$((index + 1))=$address"
    SCHEDULER_ADDRS+="${SCHEDULER_ADDRS:+,}$address"
done

# TLS: servers off loopback refuse plaintext. A CA made for this run, and per host a member
# certificate naming its address and host name (clients get the CA alone), as an operator
# would issue them (docs/SECURITY.md, "TLS deployment").
TLS_DIR=$TMP/tls
mkdir -p "$TLS_DIR"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
    -subj "/CN=floe netns test CA" -keyout "$TLS_DIR/ca-key.pem" -out "$TLS_DIR/ca.pem" \
    2>/dev/null || fail "openssl could not make the CA"
issue_certificate() {
    local host=$1
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=floe-$host" \
        -keyout "$TLS_DIR/$host-key.pem" -out "$TLS_DIR/$host.csr" 2>/dev/null &&
        openssl x509 -req -in "$TLS_DIR/$host.csr" -CA "$TLS_DIR/ca.pem" \
            -CAkey "$TLS_DIR/ca-key.pem" -days 1 -out "$TLS_DIR/$host.pem" \
            -extfile <(printf 'subjectAltName=IP:%s,DNS:floe-%s\nextendedKeyUsage=serverAuth,clientAuth\n' \
                "$(address_of "$host")" "$host") 2>/dev/null ||
        fail "openssl could not issue the certificate of host $host"
    chmod 600 "$TLS_DIR/$host-key.pem"
}
for host in "${SCHEDULER_HOSTS[@]}" "${NODE_HOSTS[@]}"; do
    issue_certificate "$host"
done
chmod -R a+rX "$TLS_DIR"

# One env file per host, like /etc/floe/floe.env: the cluster's shared lines plus the host's
# address and data directory, and what its role holds: replicas the cluster and replica
# secrets, nodes the cluster secret, the client only its token. Heartbeats are faster than
# the defaults so a cut node is declared dead in 2 s rather than 5 s.
write_env_file() {
    local host=$1 file="$TMP/$1.env" role_lines
    case $host in
    s*) role_lines="FLOE_CLUSTER_SECRET=$CLUSTER_SECRET
FLOE_TLS_CERT=$TLS_DIR/$host.pem
FLOE_TLS_KEY=$TLS_DIR/$host-key.pem
FLOE_SCHEDULER_REPLICA_SECRET=$REPLICA_SECRET
FLOE_AUTH_TOKENS_FILE=$TOKENS_FILE
FLOE_SCHEDULER_HTTP_BIND=$(address_of "$host")" ;;
    n*) role_lines="FLOE_CLUSTER_SECRET=$CLUSTER_SECRET
FLOE_TLS_CERT=$TLS_DIR/$host.pem
FLOE_TLS_KEY=$TLS_DIR/$host-key.pem
FLOE_AUTH_TOKENS_FILE=$TOKENS_FILE" ;;
    *) role_lines="FLOE_CLIENT_TOKEN=$CLIENT_TOKEN" ;;
    esac
    (
        umask 077
        cat >"$file" <<EOF
$role_lines
FLOE_TLS_CA=$TLS_DIR/ca.pem
SCHEDULER_PEERS=$SCHEDULER_PEERS
SCHEDULER_ADDRS=$SCHEDULER_ADDRS
FLOE_NET_BIND_HOST=$(address_of "$host")
FLOE_PATHS_DATA_DIR=$TMP/$host
FLOE_MEMORY_TOTAL=1GiB
FLOE_NODE_WORKERS=2
FLOE_SCHEDULER_HEARTBEAT_INTERVAL_MS=500
FLOE_SCHEDULER_MISSED_HEARTBEATS=4
EOF
    )
    echo "$file"
}

# The command line that runs a command in a host's namespace with exactly the variables of
# its env file, read the way systemd's EnvironmentFile= reads simple KEY=VALUE lines (no shell
# expansion); sets HOST_COMMAND.
host_command() {
    local host=$1
    shift
    # NO_COLOR=1 as in the units: floe colours its text logs even when they go to a file.
    local vars=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
        RUST_LOG=info NO_COLOR=1)
    local line
    while IFS= read -r line; do
        [[ -z $line || $line == \#* ]] && continue
        vars+=("$line")
    done <"$TMP/$host.env"
    HOST_COMMAND=(ip netns exec "$(ns "$host")" env -i "${vars[@]}" "$@")
}

in_host() {
    host_command "$@"
    "${HOST_COMMAND[@]}"
}

# Starts a service on a host in the background and sets STARTED_PID. ip and env exec what
# they run, so that pid is floe's own.
start_in_host() {
    local host=$1 logfile=$2
    shift 2
    host_command "$host" "$@"
    "${HOST_COMMAND[@]}" >"$logfile" 2>&1 &
    STARTED_PID=$!
}

for host in "${SCHEDULER_HOSTS[@]}" "${NODE_HOSTS[@]}" "$CLIENT_HOST"; do
    write_env_file "$host" >/dev/null
done

floe() { in_host "$CLIENT_HOST" "$BIN" "$@" --scheduler "$SCHEDULER_ADDRS"; }

# --- the cluster -----------------------------------------------------------------------------

# ExecStartPre= and ExecStart= of floe-scheduler@.service and floe-node.service.
for index in "${!SCHEDULER_HOSTS[@]}"; do
    host=${SCHEDULER_HOSTS[index]}
    id=$((index + 1))
    in_host "$host" "$BIN" scheduler --check-config --id "$id" --peers "$SCHEDULER_PEERS" \
        >"$TMP/logs/$host-check.log" 2>&1 ||
        fail "floe scheduler --check-config refused host $host: $(tail -n 3 "$TMP/logs/$host-check.log")"
    start_in_host "$host" "$TMP/logs/$host.log" "$BIN" scheduler --id "$id" --peers "$SCHEDULER_PEERS"
    SCHEDULER_PIDS+=("$STARTED_PID")
done
pass "floe scheduler --check-config accepted all 3 scheduler hosts"

for host in "${NODE_HOSTS[@]}"; do
    in_host "$host" "$BIN" node --check-config --scheduler "$SCHEDULER_ADDRS" \
        >"$TMP/logs/$host-check.log" 2>&1 ||
        fail "floe node --check-config refused host $host: $(tail -n 3 "$TMP/logs/$host-check.log")"
    start_in_host "$host" "$TMP/logs/$host.log" "$BIN" node --scheduler "$SCHEDULER_ADDRS"
    NODE_PIDS+=("$STARTED_PID")
done
pass "floe node --check-config accepted all 3 node hosts"

# Polls `command` (a function name) once per 0.5 s until it succeeds or WAIT_SECONDS pass.
wait_for() {
    local what=$1 command=$2 deadline=$((SECONDS + WAIT_SECONDS))
    until "$command"; do
        ((SECONDS < deadline)) || fail "$what: not within $WAIT_SECONDS s"
        sleep 0.5
    done
}

cluster_ready() {
    local status
    status=$(floe status 2>&1) || return 1
    [[ $(grep -c ' leader ' <<<"$status") -eq 1 ]] &&
        [[ $(grep -cE ' (leader|follower) ' <<<"$status") -eq 3 ]] &&
        grep -q '^nodes: 3 alive, 0 dead' <<<"$status"
}
wait_for "3 replicas with one leader and 3 alive nodes" cluster_ready
floe status | sed 's/^/    /'
pass "cluster up: 3 replicas, one leader, 3 alive nodes"

# Every node registered with its own host's address, not a loopback or wildcard one.
nodes_out=$(floe nodes)
for host in "${NODE_HOSTS[@]}"; do
    grep -qE "^[0-9]+ +$(address_of "$host"):$NODE_RPC_PORT +alive" <<<"$nodes_out" ||
        fail "node host $host is not registered alive at $(address_of "$host"):$NODE_RPC_PORT:
$nodes_out"
done
pass "every node registered at its host's address"

# The REST API and dashboard port (admins only), on every replica's scheduler.http_bind.
# http_get FROM_HOST ADDRESS PATH prints the response (with the client's token, over HTTPS
# verified against the cluster's CA); fails if nothing listens or the certificate is wrong.
http_get() {
    local from=$1 address=$2 path=$3
    printf "GET %s HTTP/1.0\r\nHost: %s\r\nAuthorization: Bearer %s\r\n\r\n" \
        "$path" "$address" "$CLIENT_TOKEN" |
        in_host "$from" timeout 5 openssl s_client -quiet -verify_return_error \
            -CAfile "$TLS_DIR/ca.pem" -verify_ip "$address" -connect "$address:$HTTP_PORT" \
            2>/dev/null
}
for host in "${SCHEDULER_HOSTS[@]}"; do
    response=$(http_get "$CLIENT_HOST" "$(address_of "$host")" /api/version) ||
        fail "nothing listens on $(address_of "$host"):$HTTP_PORT (scheduler host $host's HTTP API)"
    [[ $response == *'"version"'* ]] ||
        fail "GET https://$(address_of "$host"):$HTTP_PORT/api/version answered without a version: $response"
done
pass "every replica serves /api/version on port $HTTP_PORT"

# --- job 1: read CSV files from a shared directory, filter, shuffle, aggregate ---------------

# 6 files of 20,000 rows; `key` in 0..49, `value` an integer that varies with row and file.
for file in 0 1 2 3 4 5; do
    awk -v file="$file" 'BEGIN {
        print "key,value"
        for (i = 0; i < 20000; i++) print (i * 7 + file) % 50 "," (i * 13 + file * 101) % 1000
    }' >"$TMP/input/part-$file.csv"
done
chmod -R a+rX "$TMP/input"

# The expected result, computed from the input files alone.
awk -F, 'FNR > 1 && $2 % 3 != 0 { n[$1]++; total[$1] += $2 * 2 }
    END { for (k in n) print k "," n[k] "," total[k] }' "$TMP"/input/part-*.csv |
    sort -t, -k1,1n >"$TMP/expected-1.csv"

cat >"$TMP/jobs/aggregate.toml" <<EOF
[source]
read_csv = ["$TMP/input/*.csv"]

[[steps]]
filter = "value % 3 != 0"

[[steps]]
with_column = { name = "doubled", expr = "value * 2" }

[[steps]]
groupby = ["key"]
agg = ["count(*) as n", "sum(doubled) as total"]

[[steps]]
sort = ["key"]

[sink]
write_csv = "$TMP/out-1"
EOF

# Rows of a write_csv output directory, headers dropped, as key,n,total sorted by key.
read_output() {
    local dir=$1
    [[ -d $dir ]] || return 1
    awk -F, 'FNR > 1' "$dir"/*.csv | sort -t, -k1,1n
}

if ! floe submit "$TMP/jobs/aggregate.toml" --wait >"$TMP/logs/submit-1.log" 2>&1; then
    fail "job 1 (read, filter, groupby, sort, write_csv) failed: $(tail -n 5 "$TMP/logs/submit-1.log")"
fi
read_output "$TMP/out-1" >"$TMP/actual-1.csv" || fail "job 1 wrote no output directory"
if ! diff -q "$TMP/expected-1.csv" "$TMP/actual-1.csv" >/dev/null; then
    diff "$TMP/expected-1.csv" "$TMP/actual-1.csv" | head -n 10
    fail "job 1: the groups differ from the independent computation"
fi
pass "job 1: $(wc -l <"$TMP/actual-1.csv") groups over 120000 CSV rows match awk's result"

# --- job 2: a slow job; one node host's link is cut while it runs ----------------------------

# 18 tasks of 4 batches of 8192 rows, each batch held 1 s by delay@1: about 12 s on the
# 6 worker slots of 3 nodes, so tasks are running on every node when the link goes down.
readonly SLOW_ROWS=589824
cat >"$TMP/jobs/slow.toml" <<EOF
[source]
range = $SLOW_ROWS

[[steps]]
with_column = { name = "tripled", expr = "id * 3" }

[[steps]]
map_batches = { udf = "delay", version = 1, args = { ms = 1000 } }

[sink]
write_csv = "$TMP/out-2"
EOF

host_command "$CLIENT_HOST" "$BIN" submit "$TMP/jobs/slow.toml" --wait --scheduler "$SCHEDULER_ADDRS"
"${HOST_COMMAND[@]}" >"$TMP/logs/submit-2.log" 2>&1 &
SUBMIT_PID=$!

slow_job_id() { sed -n 's/^job \([0-9][0-9]*\) submitted$/\1/p' "$TMP/logs/submit-2.log" 2>/dev/null; }
job_submitted() { [[ -n $(slow_job_id) ]]; }
wait_for "job 2 submitted" job_submitted
JOB=$(slow_job_id)

# The node running the job's driver logs "driver started"; cut another one, so the test
# exercises task retries on the surviving nodes (the driver's own node is the other tests').
driver_host() {
    local host
    for host in "${NODE_HOSTS[@]}"; do
        if grep -E "driver started.* job=$JOB( |$)" "$TMP/logs/$host.log" >/dev/null; then
            echo "$host"
            return 0
        fi
    done
    return 1
}
tasks_done() {
    floe job "$JOB" 2>/dev/null | grep -oE '[0-9]+/[0-9?]+ tasks,' |
        awk -F/ '{ done += $1 } END { print done + 0 }'
}
some_tasks_done() { [[ $(tasks_done) -ge 2 ]]; }
wait_for "job $JOB finished its first tasks" some_tasks_done
DRIVER_HOST=$(driver_host) || fail "no node host logged the start of job $JOB's driver"
VICTIM=""
for host in "${NODE_HOSTS[@]}"; do
    if [[ $host != "$DRIVER_HOST" ]]; then
        VICTIM=$host
        break
    fi
done
VICTIM_ADDRESS="$(address_of "$VICTIM"):$NODE_RPC_PORT"
VICTIM_ID=$(floe nodes | awk -v addr="$VICTIM_ADDRESS" '$2 == addr && $3 == "alive" { print $1 }')
[[ -n $VICTIM_ID ]] || fail "cannot find the alive node at $VICTIM_ADDRESS"

ip -n "$SWITCH" link set "$VICTIM" down
log "cut host $VICTIM (node $VICTIM_ID, $VICTIM_ADDRESS) from the bridge after $(tasks_done) tasks of job $JOB; its driver runs on $DRIVER_HOST"

victim_dead() {
    floe nodes 2>/dev/null | awk -v id="$VICTIM_ID" '$1 == id && $3 == "dead" { found = 1 } END { exit !found }'
}
wait_for "node $VICTIM_ID declared dead" victim_dead
pass "floe nodes reports node $VICTIM_ID dead: $(floe nodes | awk -v id="$VICTIM_ID" '$1 == id' | sed 's/  */ /g')"

SUBMIT_STATUS=0
SUBMIT_DEADLINE=$((SECONDS + WAIT_SECONDS))
while kill -0 "$SUBMIT_PID" 2>/dev/null; do
    ((SECONDS < SUBMIT_DEADLINE)) || fail "job $JOB did not finish within $WAIT_SECONDS s of the cut"
    sleep 0.5
done
wait "$SUBMIT_PID" || SUBMIT_STATUS=$?
SUBMIT_PID=""
((SUBMIT_STATUS == 0)) || fail "job $JOB failed after the cut: $(tail -n 5 "$TMP/logs/submit-2.log")"

# Every id exactly once, each with tripled = 3 * id.
read -r rows distinct bad id_sum <<<"$(awk -F, 'FNR > 1 {
        rows++; if (!seen[$1]++) distinct++; if ($2 != 3 * $1) bad++; sum += $1
    } END { printf "%d %d %d %.0f\n", rows, distinct, bad, sum }' "$TMP"/out-2/*.csv)"
expected_sum=$((SLOW_ROWS * (SLOW_ROWS - 1) / 2))
[[ $rows -eq $SLOW_ROWS && $distinct -eq $SLOW_ROWS && $bad -eq 0 && $id_sum == "$expected_sum" ]] ||
    fail "job $JOB output: $rows rows, $distinct distinct ids, $bad wrong tripled values, sum $id_sum; expected $SLOW_ROWS rows, sum $expected_sum"
# The stats table: OPERATOR TASKS RETRY REBUILT ROWS BYTES HITS MISSES WALL_MS, counted from
# the right because an operator's name may contain spaces.
recovered=$(awk '$1 == "OPERATOR" { table = 1; next }
    table && NF >= 9 && $(NF - 7) ~ /^[0-9]+$/ { sum += $(NF - 6) + $(NF - 5); next }
    { table = 0 } END { print sum + 0 }' "$TMP/logs/submit-2.log")
((recovered > 0)) || fail "job $JOB succeeded but its stats show no retried or rebuilt task: $(cat "$TMP/logs/submit-2.log")"
pass "job $JOB completed despite the cut: $SLOW_ROWS rows, ids 0..$((SLOW_ROWS - 1)) once each, $recovered retried/rebuilt tasks"

# --- the cut node comes back -----------------------------------------------------------------

ip -n "$SWITCH" link set "$VICTIM" up
log "restored host $VICTIM's link"
rejoined_id() {
    floe nodes 2>/dev/null |
        awk -v addr="$VICTIM_ADDRESS" -v old="$VICTIM_ID" '$2 == addr && $3 == "alive" && $1 != old { print $1 }'
}
victim_rejoined() { [[ -n $(rejoined_id) ]]; }
wait_for "host $VICTIM to rejoin as a new node" victim_rejoined
NEW_ID=$(rejoined_id)
victim_dead || fail "the old node id $VICTIM_ID is no longer listed dead after the rejoin"
floe nodes | sed 's/^/    /'
pass "host $VICTIM rejoined as node $NEW_ID at $VICTIM_ADDRESS; node $VICTIM_ID stays dead"

cluster_back() {
    local status
    status=$(floe status 2>/dev/null) || return 1
    grep -q '^nodes: 3 alive, 1 dead' <<<"$status"
}
wait_for "3 alive nodes after the rejoin" cluster_back
pass "cluster: 3 alive nodes, 1 dead"
