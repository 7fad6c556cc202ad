"""Where a step's time goes: in-process microbenchmarks of the CPU kernels, the attention paths, the
compute thread, the projections' dtype, the op dispatch count and the fused engine step."""
