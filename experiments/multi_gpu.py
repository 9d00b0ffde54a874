"""Multi-GPU training of the lm-130m model in one command, from the repository root: throughput and
scaling of data, FSDP and context-parallel meshes, the loss against one GPU, a checkpoint restored on one GPU.
The runs and the runner are :mod:`falcon_jax.train.multi_gpu`; ``--help`` for the options.

    python experiments/multi_gpu.py --out $OUT --budget 540
    python experiments/multi_gpu.py --list --gpus 2          # the runs and their commands
    python experiments/multi_gpu.py --out /tmp/mg --smoke    # tiny model, 2 simulated CPU devices
"""

import os

from falcon_jax.train.multi_gpu import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    raise SystemExit(main(root=ROOT))
