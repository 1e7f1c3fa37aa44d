#!/usr/bin/env bash
# Start mmpipe's per-rank entry on every host of a DeepSpeed hostfile.
#   launch/deepspeed_hostfile.sh HOSTFILE MASTER_ADDR [mmpipe.train flags...]
# e.g. launch/deepspeed_hostfile.sh launch/hostfile.example node1 --stages 2 --steps 1000
# World size = sum of slots; data-parallel degree = world size / --stages.
set -euo pipefail
hostfile=${1:?usage: $0 HOSTFILE MASTER_ADDR [flags...]}
master=${2:?usage: $0 HOSTFILE MASTER_ADDR [flags...]}
shift 2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per rank on CPU; the launcher does not set it
exec deepspeed --hostfile "$hostfile" --master_addr "$master" --module mmpipe.train "$@"
