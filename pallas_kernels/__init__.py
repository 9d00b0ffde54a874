"""Pallas kernels for the chunk form of the Falcon rules (installed as ``falcon_jax.kernels``).

One folder per op — ``decayed_attention`` (Falcon-1A, 3A, decayed linear attention), ``decayed_delta_rule``
(Falcon-1, DeltaNet), ``windowed_delta_rule`` (Falcon-3), ``per_column`` (Falcon-2, 2A) — each with ``api.py``
(the public function and its ``custom_vjp``), ``reference.py`` (plain JAX, the definition), its launch
parameters and tuned table, and one file or folder per lowering (``triton``, ``mosaic_gpu``, ``mosaic_tpu``).
``implementation.py`` is the one vocabulary that picks a lowering; ``common.py`` the helpers the ops share.
``flash_attention.py`` adapts JAX's Pallas GPU flash attention to the softmax layers' packed rows.
"""
