"""The float64 NumPy references the tests compare against; they ship in the package as
:mod:`falcon_jax.reference` (so users can run the same checks, see :mod:`falcon_jax.testing`)."""
from falcon_jax.reference import (PER_COLUMN, RESIDUAL, VARIANTS, WINDOWED,  # noqa: F401 - re-exported
                                  effective_window, reference_decayed_linear_attention, reference_deltanet,
                                  reference_falcon, reference_gated_deltanet)
