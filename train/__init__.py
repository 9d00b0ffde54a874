"""falcon-jax trainer: ``falcon-train --preset addition-tiny`` (see docs/training.md)."""
