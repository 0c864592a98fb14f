#!/usr/bin/env bash
# Submit a distribuuuu training job to Slurm: one task per GPU, the same
# number of tasks on every node. Arguments go to tools/train_net.py.
#
#   sbatch tools/slurm_train.sh --cfg config/resnet50.yaml OUT_DIR ./exp/r50
#   sbatch --nodes=8 --partition=gpu tools/slurm_train.sh --cfg config/resnet50.yaml \
#       TRAIN.BATCH_SIZE 128 OPTIM.BASE_LR 6.4 OUT_DIR ./exp/r50
#
# Options on sbatch's command line win over the #SBATCH lines below: --nodes,
# --ntasks-per-node together with --gres=gpu:N (GPUs per node), --partition,
# --time, --cpus-per-task. On nodes without GPUs pass --gres=none. PYTHON
# names the interpreter (default: python on PATH, e.g. an activated venv).
# Submit from the repository root: the job runs in the submission directory.
#
#SBATCH --job-name=distribuuuu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=8
#SBATCH --time=3-00:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
# 120 s before the time limit (or on preemption with a grace time), Slurm sends
# SIGUSR1 to the tasks: every rank finishes its step, a checkpoint is saved and
# the job stops; add DIST.REQUEUE True to the arguments and rank 0 also
# requeues the job, which then resumes from that checkpoint by itself.
#SBATCH --signal=USR1@120
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
echo "job ${SLURM_JOB_ID:-?}: ${SLURM_NNODES:-1} node(s) ${SLURM_JOB_NODELIST:-?}," \
  "${SLURM_NTASKS:-1} task(s)"
# Since Slurm 22.05 srun no longer inherits --cpus-per-task from sbatch (each
# task would get 1 CPU): hand it on through the variable srun reads.
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
  export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK}"
fi
# --kill-on-bad-exit: when one task fails, Slurm stops the others at once.
srun --kill-on-bad-exit=1 "${PYTHON:-python}" -u tools/train_net.py "$@"
