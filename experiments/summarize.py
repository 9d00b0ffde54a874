"""Tables and plots for docs/results.md from a suite's packed results: the JSON into
experiments/results/, the plots into docs/img/.  The logic is :mod:`falcon_jax.train.summarize`.

    python experiments/summarize.py addition addition.tar.gz --tag h200
"""

import os

from falcon_jax.train.summarize import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    raise SystemExit(main(out_dir=os.path.join(ROOT, "experiments", "results"),
                          img_dir=os.path.join(ROOT, "docs", "img")))
