"""Pallas kernels for the chunk form of the Falcon rules (GPU through Triton, TPU through Mosaic).

One folder per op, each with ``api.py`` (the public function, its
``custom_vjp`` and the ``implementation=`` choice), ``reference.py`` (plain
JAX, the definition) and one file per lowering.
"""
