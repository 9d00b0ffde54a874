"""splitmix64's finaliser: the counter-based integer hash behind the data streams' draws.

The addition task hashes problems (train / held-out split) and row indices (operands, widths);
text corpora hash document indices (train / validation split); the Grain loader derives its
shuffle seed.  All of it is a pure function of integers, so a row never depends on the batch it
is drawn in.
"""

from __future__ import annotations

import numpy as np


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (a fast, well-spread integer hash)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
