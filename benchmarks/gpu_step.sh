# Sourced by the gpu_*.sh scripts once they set $logs and $tag.
# step NAME LIMIT CMD...: CMD under `timeout` (which, without --foreground, puts itself and the
# step in one process group and signals the whole group on expiry, TERM then KILL 15 s later),
# its output in $logs/NAME.log; prints the exit status, the seconds and the log's tail
# (TAIL lines, default 25).
step() {
  local name=$1 limit=$2 t0; shift 2; t0=$(date +%s)
  timeout -k 15 "$limit" "$@" > $logs/$name.log 2>&1
  local rc=$?
  [ $rc -ne 124 ] && [ $rc -ne 137 ] || echo "$name: killed at its ${limit}s limit" >&2
  echo "$name $tag rc=$rc $(( $(date +%s) - t0 ))s"; tail -n ${TAIL:-25} $logs/$name.log
  return $rc
}
