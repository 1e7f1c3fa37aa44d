#!/usr/bin/env bash
# The torchrun alternative: run this once on EVERY node (by hand, pdsh, or srun --ntasks-per-node=1).
#   launch/torchrun_node.sh NNODES NODE_RANK MASTER_ADDR PROCS_PER_NODE [mmpipe.train flags...]
# e.g. on node1: launch/torchrun_node.sh 2 0 node1 4 --stages 2 --steps 1000
#      on node2: launch/torchrun_node.sh 2 1 node1 4 --stages 2 --steps 1000
# torchrun sets RANK/LOCAL_RANK/WORLD_SIZE and OMP_NUM_THREADS=1; MASTER_PORT defaults to 29500.
set -euo pipefail
nnodes=${1:?usage: $0 NNODES NODE_RANK MASTER_ADDR PROCS_PER_NODE [flags...]}
node_rank=${2:?} master=${3:?} nproc=${4:?}
shift 4
exec torchrun --nnodes "$nnodes" --node_rank "$node_rank" --nproc_per_node "$nproc" \
  --master_addr "$master" --master_port "${MASTER_PORT:-29500}" -m mmpipe.train "$@"
