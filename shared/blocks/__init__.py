"""The neural-network building blocks, one idea per module; every service builds its models from these.

Import each block from its own module (``from genserve.shared.blocks.rope import RoPE``): this package imports nothing,
so a service loads only the blocks it uses. Attention, norm, RoPE, linear and convolution compute is dispatched by
``genserve.shared.blocks.backend`` (reference math, torch, the Triton kernels on CUDA, the C kernels on the CPU).
"""
