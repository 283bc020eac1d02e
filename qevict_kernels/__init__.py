"""Kernels for QEvict's low-bit tier, each with a PyTorch reference doing the same math. A leaf: they take tensors
and never import the engine (``packed.PackedWindows`` declares what they read of a tier).

- ``lowbit_attention``: one split-K Triton pass of a step's queries over the packed INT2/INT4 tier (dequantized and
  re-rotated in registers, GQA-aware), writing each window's log-sum-exp beside the output; ``merge`` joins the
  splits with the full-precision part by log-sum-exp and turns the window log-sum-exps into routing mass.
- ``merge``: exact log-sum-exp merge of attention segments, and the full-precision segment with its log-sum-exp.
- ``cpu_decode`` (with ``cpu/quant_decode.c``): the CPU's counterpart for decode steps, in C compiled on first use.

On a CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (set before triton is imported), as the tests do.
"""
