# Shared helpers of the benchmark scripts (sourced, not run).
# Callers set $tmp (a scratch directory) and $secs, and keep $pids for
# cleanup.

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# One single-stream iperf3 sample on loopback in GB/s; 1 s omitted as
# warm-up. Extra arguments go to the client (e.g. -l 1M).
iperf_run() {
  local port
  port="$(free_port)"
  iperf3 -s -1 -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
  pids+=($!)
  sleep 0.3
  iperf3 -c 127.0.0.1 -p "$port" -P 1 -O 1 -t "$secs" "$@" -J >"$tmp/iperf.json"
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.4f" % (d["end"]["sum_received"]["bits_per_second"]/8e9))' "$tmp/iperf.json"
}

median() {
  printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'
}

# Prints a JSON field of the last line of a file.
json_field() {
  python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])[sys.argv[2]])' "$1" "$2"
}
