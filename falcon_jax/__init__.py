"""falcon-jax: the Falcon family of fast-weight attention rules for JAX.

Rules (``falcon_jax.rules``), their three forms (``falcon_jax.forms``:
recurrent, parallel, chunk) and the public functions below.
"""

from falcon_jax.baselines import decayed_linear_attention, deltanet, gated_deltanet
from falcon_jax.falcon import falcon, falcon_step
from falcon_jax.rules import VARIANTS
from falcon_jax.sharding import kernel_sharding
from falcon_jax.state import FalconState, init_state

__all__ = [
    "FalconState",
    "VARIANTS",
    "decayed_linear_attention",
    "deltanet",
    "falcon",
    "falcon_step",
    "gated_deltanet",
    "init_state",
    "kernel_sharding",
]
__version__ = "0.1.0"
