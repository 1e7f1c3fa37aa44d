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
