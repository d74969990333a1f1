#!/usr/bin/env bash
# One Slurm task = one worker of a prepared run: srun starts the tasks, this maps Slurm's
# variables onto the ones the worker entry reads, as torchrun would set them.
#
#   RUN_DIR=$(python -m src.prepare backend=torch cluster=... hydra.run.dir=/shared/run | tail -n1)
#   source "$RUN_DIR/launch.env"
#   srun --nodes="$NNODES" --ntasks-per-node="$NPROC_PER_NODE" launchers/srun.sh "$RUN_DIR"
#
# The rendezvous is on the job's first node, at MASTER_PORT if set, else a port derived
# from the job id (two jobs sharing a node do not collide). Each worker checks the written
# plan (whole, of this version, for SLURM_NTASKS workers) before it joins: one line, exit 2.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: srun ... launchers/srun.sh RUN_DIR" >&2
    exit 2
fi
run_dir=$1
if [[ -z ${SLURM_PROCID:-} || -z ${SLURM_NTASKS:-} || -z ${SLURM_LOCALID:-} ]]; then
    echo "error: SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID are not set: start this with srun" >&2
    exit 2
fi
if [[ ! -f $run_dir/launch.env ]]; then
    echo "error: $run_dir/launch.env not found: prepare the run with python -m src.prepare" >&2
    exit 2
fi
# shellcheck source=/dev/null
source "$run_dir/launch.env"
if [[ $SLURM_NTASKS -ne $WORLD ]]; then
    echo "error: the plan needs $WORLD workers but srun started $SLURM_NTASKS tasks" \
         "(use --nodes=$NNODES --ntasks-per-node=$NPROC_PER_NODE)" >&2
    exit 2
fi

export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
exec "${PYTHON:-python}" -m src.runtime.worker "$run_dir"
