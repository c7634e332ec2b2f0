"""Builds this package's compiled code ahead of its first use, for an engine's setup: every CUDA
module compiled by NVRTC (or loaded from CuPy's disk cache). The public face of _build's
precompile; cuDNN graphs are built through attention.attention_workspace_bytes. Never allocates
device memory and never synchronises."""

from dataflow.kernels.cuda._build import cache_dir, kernel_sources, precompile

__all__ = ["cache_dir", "kernel_sources", "precompile"]
