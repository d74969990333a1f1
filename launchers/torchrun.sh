#!/usr/bin/env bash
# Start this node's workers of a prepared run under torchrun; run it on every node.
#
#   RUN_DIR=$(python -m src.prepare backend=torch cluster=... hydra.run.dir=/shared/run | tail -n1)
#   launchers/torchrun.sh "$RUN_DIR" HOST:PORT [torchrun options]
#
# HOST:PORT is a free port on any one of the run's nodes, the same on all of them: torchrun's
# c10d rendezvous there assigns the node ranks. The node count and workers per node come from
# RUN_DIR/launch.env (written by prepare, from the plan), so they cannot disagree with the
# plan. RUN_DIR must be readable from every node (a shared file system); rank 0 writes the
# summary into it.
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: launchers/torchrun.sh RUN_DIR HOST:PORT [torchrun options]" >&2
    exit 2
fi
run_dir=$1
endpoint=$2
shift 2
if [[ ! -f $run_dir/launch.env ]]; then
    echo "error: $run_dir/launch.env not found: prepare the run with python -m src.prepare" >&2
    exit 2
fi
# shellcheck source=/dev/null
source "$run_dir/launch.env"
# The written plan, whole, of this version and for these workers, or one line and exit 2
# before torchrun starts anything.
"${PYTHON:-python}" -m src.plan_io "$run_dir" --world-size "$((NNODES * NPROC_PER_NODE))" > /dev/null

# The run directory's name identifies the rendezvous: two runs on one endpoint never mix.
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="$(basename "$run_dir")" \
    "$@" -m src.runtime.worker "$run_dir"
