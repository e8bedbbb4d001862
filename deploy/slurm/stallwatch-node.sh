#!/usr/bin/env bash
# One stallwatch per node inside a Slurm allocation: it starts this node's share of the work,
# watches it, alerts, restarts it on a crash or hang, and exits when the work is finished.
# Launched once per node by srun (see extract.sbatch next to this file):
#
#   srun --ntasks-per-node=1 deploy/slurm/stallwatch-node.sh python extract.py --shard {shard} --of {shards}
#
# {shard} and {shards} in the command become $SLURM_NODEID and $SLURM_JOB_NUM_NODES.
# Settings (environment):
#   STALLWATCH          the stallwatch executable            (default: stallwatch on PATH)
#   STALLWATCH_WORKDIR  logs and state of this node          (default: $PWD/stallwatch/$SLURM_JOB_ID/<host>)
#   STALLWATCH_OUTPUTS  the outputs directory of this node   (optional)
#   STALLWATCH_METRICS  metrics_listen; empty: no endpoint   (default: 127.0.0.1:9835)
#   STALLWATCH_TEXTFILE metrics_textfile: node_exporter's textfile directory or a *.prom path
#                       (optional; name the file per job if several jobs share a node)
#   STALLWATCH_MAX_RESTARTS                                  (default: 3)
#   STALLWATCH_ALERT_WEBHOOK  a webhook URL for alerts       (optional)
#   --print-config      print this node's configuration and exit (a dry run)
set -euo pipefail

print_only=0
if [ "${1:-}" = "--print-config" ]; then print_only=1; shift; fi
if [ "$#" -eq 0 ]; then
  echo "usage: $0 [--print-config] COMMAND [ARG]..." >&2
  exit 3
fi

: "${SLURM_JOB_ID:?run me under Slurm (srun), or set SLURM_JOB_ID, SLURM_NODEID, SLURM_JOB_NUM_NODES}"
node_id="${SLURM_NODEID:-0}"
nodes="${SLURM_JOB_NUM_NODES:-1}"
host="$(hostname -s)"
stallwatch="${STALLWATCH:-stallwatch}"
workdir="${STALLWATCH_WORKDIR:-$PWD/stallwatch/$SLURM_JOB_ID/$host}"
metrics="${STALLWATCH_METRICS-127.0.0.1:9835}"
max_restarts="${STALLWATCH_MAX_RESTARTS:-3}"
mkdir -p "$workdir"

# TOML basic strings: escape backslashes, double quotes, and newlines, tabs, carriage returns.
toml() {
  local s="${1//\\/\\\\}"
  s="${s//\"/\\\"}"
  s="${s//$'\n'/\\n}"
  s="${s//$'\t'/\\t}"
  s="${s//$'\r'/\\r}"
  printf '"%s"' "$s"
}

# The job's environment. stallwatch gives a supervised job only PATH, the locale and TMPDIR of
# its own (stallwatch.daemon.supervise: the daemon's secrets stay with it), so this task's
# environment is passed on explicitly as the job's `env`: Slurm's SLURM_* and
# CUDA_VISIBLE_DEVICES, the user's modules, conda, tokens. Not STALLWATCH_* (the alert webhook
# is stallwatch's). A value with control characters TOML cannot carry is left out, with a note.
job_env() {
  local name value
  while IFS= read -r name; do
    case "$name" in STALLWATCH_*|_|SHLVL|PWD|OLDPWD) continue ;; esac
    [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
    value="${!name}"
    if [[ "${value//[$'\n\t\r']/}" =~ [[:cntrl:]] ]]; then
      echo "stallwatch-node: $name has control characters: not passed to the job" >&2
      continue
    fi
    printf '%s = %s\n' "$name" "$(toml "$value")"
  done < <(compgen -e)
}

cmd=""
for a in "$@"; do
  a="${a//\{shard\}/$node_id}"
  a="${a//\{shards\}/$nodes}"
  cmd+="${cmd:+, }$(toml "$a")"
done

config="$workdir/stallwatch.toml"
{
  echo "# written by $0 for Slurm job $SLURM_JOB_ID, node $node_id of $nodes ($host)"
  echo "[daemon]"
  echo "interval_s = 1.0"
  echo "exit_with_jobs = true"
  echo "state_dir = $(toml "$workdir/state")"
  if [ -n "$metrics" ]; then echo "metrics_listen = $(toml "$metrics")"; fi
  if [ -n "${STALLWATCH_TEXTFILE:-}" ]; then echo "metrics_textfile = $(toml "$STALLWATCH_TEXTFILE")"; fi
  echo
  echo "[[job]]"
  echo "name = $(toml "${SLURM_JOB_NAME:-job}-$node_id")"
  echo "command = [$cmd]"
  echo "cwd = $(toml "$PWD")"
  echo "log = $(toml "$workdir/job.log")"
  if [ -n "${STALLWATCH_OUTPUTS:-}" ]; then echo "outputs = $(toml "$STALLWATCH_OUTPUTS")"; fi
  echo 'restart = "on-failure"'
  echo "max_restarts = $max_restarts"
  # A death by signal while Slurm ends the allocation (scancel, time limit) is not a crash.
  echo "slurm_job_id = $(toml "$SLURM_JOB_ID")"
  echo
  echo "[job.env]"
  job_env
  if [ -n "${STALLWATCH_ALERT_WEBHOOK:-}" ]; then
    echo
    echo "[[alert]]"
    echo 'type = "webhook"'
    echo "url = $(toml "$STALLWATCH_ALERT_WEBHOOK")"
  fi
} > "$config.tmp"
chmod 600 "$config.tmp"
mv "$config.tmp" "$config"

if [ "$print_only" = 1 ]; then
  cat "$config"
  exit 0
fi

# `stallwatch run` in the foreground (exit_with_jobs, as `stallwatch run -- COMMAND` runs): it
# exits when this node's job has ended for good, with the job's status (0: finished), or 2 when
# it gave up on the job. In the background only so that this script's SIGTERM handler runs at once.
"$stallwatch" run --config "$config" &
daemon=$!
# scancel, the time limit or a preemption: Slurm signals every process of the step, this
# script, the daemon and the job alike. Say so; the daemon passes SIGTERM on to the job and
# restarts nothing.
on_term() {
  local state
  state="$(timeout 5 scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null \
    | grep -o 'JobState=[A-Z_]*' | head -n 1)" || true
  if [ -n "$state" ] && [ "$state" != JobState=RUNNING ]; then
    echo "stallwatch-node: $host: Slurm job $SLURM_JOB_ID was cancelled ($state: scancel, time" \
      "limit or preemption): stopping stallwatch; not a crash, nothing restarted" >&2
  else
    echo "stallwatch-node: $host: stopped by a signal: stopping stallwatch" >&2
  fi
  kill -TERM "$daemon" 2>/dev/null || true
  wait "$daemon" || true
  exit 143
}
trap on_term TERM INT

rc=0
wait "$daemon" || rc=$?
case "$rc" in
  0) echo "stallwatch-node: $host: the job finished" >&2 ;;
  *) echo "stallwatch-node: $host: the job did not finish (stallwatch exit $rc; see $workdir)" >&2
     rc=1 ;;
esac
exit "$rc"
