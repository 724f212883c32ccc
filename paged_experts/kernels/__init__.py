"""Compute kernels: grouped expert matmuls and backend choice (`fused`), decode-sized Triton MoE
kernels (`moe_triton`), Triton decode attention (`attn_triton`) and the page-in kernel
(`copy_kernel`) that reads pinned host memory."""
