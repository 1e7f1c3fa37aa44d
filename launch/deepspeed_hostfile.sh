#!/usr/bin/env bash
# Start mmpipe's per-rank entry on every host of a DeepSpeed hostfile (DeepSpeed's pdsh runner).
#   launch/deepspeed_hostfile.sh HOSTFILE MASTER_ADDR [deepspeed flags...] -- [mmpipe.train flags...]
# e.g. launch/deepspeed_hostfile.sh launch/hostfile.example node1 --exclude node2 -- --stages 2 --steps 1000
# deepspeed flags: --include/--exclude HOST[:SLOTS], --master_port PORT, --ssh_port PORT.
# World size = the active slots; data-parallel degree = world size / --stages.
# `mmpipe train --hostfile FILE` does the same after checking the file and every host's ssh first.
set -euo pipefail
hostfile=${1:?usage: $0 HOSTFILE MASTER_ADDR [deepspeed flags...] -- [flags...]}
master=${2:?usage: $0 HOSTFILE MASTER_ADDR [deepspeed flags...] -- [flags...]}
shift 2
ds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do ds+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
# DeepSpeed ssh-checks the first host whenever it is given a hostfile, yet runs a single active host's
# ranks locally, without ssh (docs/multinode.md): the file and --include/--exclude are read here with
# mmpipe's checks (one line per problem), and one active host gets --no_ssh_check
filters=()
for ((i = 0; i < ${#ds[@]}; i++)); do
  case ${ds[i]} in
    --include|--exclude) filters+=("${ds[i]}" "${ds[i + 1]:-}") ;;
    --include=*|--exclude=*) filters+=("${ds[i]%%=*}" "${ds[i]#*=}") ;;
  esac
done
n_hosts="$(python - "$hostfile" "${filters[@]}" <<'PY'
import sys
from mmpipe.cluster.hostfile import active, parse
from mmpipe.config import ConfigError
flags = dict(zip(sys.argv[2::2], sys.argv[3::2]))
try:
    hosts = parse(sys.argv[1])  # DeepSpeed's filter rules (imports DeepSpeed) only when there is a filter
    print(len(active(hosts, flags.get("--include", ""), flags.get("--exclude", "")) if flags else hosts))
except ConfigError as e:
    sys.exit("\n".join(f"deepspeed_hostfile.sh: {line}" for line in str(e).splitlines()))
PY
)" || exit 2
n_hosts=${n_hosts##*$'\n'}  # the last line: importing DeepSpeed may print its accelerator notice first
[ "$n_hosts" = 1 ] && ds+=(--no_ssh_check)
# pdsh starts remote ranks with a bare ssh environment and exports only PYTHON* itself: hand the
# rest over in a DeepSpeed environment file (one KEY=VALUE a line, read by the launcher)
env_file=$(mktemp "${TMPDIR:-/tmp}/mmpipe_ds_env.XXXXXX")
trap 'rm -f "$env_file"' EXIT
[ -f "$HOME/.deepspeed_env" ] && cat "$HOME/.deepspeed_env" >> "$env_file"
echo "PATH=$PATH" >> "$env_file"
echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" >> "$env_file"  # one thread per rank on CPU; the launcher sets none
env | grep -E '^(NCCL_|GLOO_SOCKET_IFNAME|TORCH_NCCL_|TORCH_DISTRIBUTED_DEBUG)' >> "$env_file" || true
export DS_ENV_FILE=$env_file OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
deepspeed --hostfile "$hostfile" --master_addr "$master" "${ds[@]}" --module mmpipe.train "$@"
