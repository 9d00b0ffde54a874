"""The Pallas Mosaic GPU (Hopper: wgmma + TMA) lowering of ``decayed_delta_rule``'s passes where it is faster
than Triton: the walks on thread-block clusters and the reverse walk's per-chunk preparation."""
