"""The Triton lowering of ``decayed_delta_rule``'s passes, one file per thing they compute: the triangular
inverse, the forward walks, the state-gradient walk and the chunk gradients."""
