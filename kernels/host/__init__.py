"""CPU kernels for work the engine does on pinned host memory (numba, parallel): AdamW over home
copies. Each matches its dataflow.kernels.reference function bit for bit (same fp32 operation order, no
fast-math contraction)."""
