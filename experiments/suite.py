"""Run a paper-experiment suite from the repository root: runs in runs/exp/<suite>/,
the LM corpus from data/python-docs.jsonl (experiments/prepare_python_docs.py).  The suites and
the runner are :mod:`falcon_jax.train.suite`; ``--help`` for the options.

    python experiments/suite.py addition --lanes 6 --deadline-min 8 --pack $OUT/addition.tar.gz
    python experiments/suite.py addition --list          # the runs and their flags
"""

import os

from falcon_jax.train.suite import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    raise SystemExit(main(root=ROOT))
