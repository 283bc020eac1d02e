"""Triton kernels for QEvict's low-bit tier, each with a PyTorch ``*_reference`` doing the same math.

- ``quant_attention``: attention of queries over the packed INT2/INT4 ledger, dequantized and re-rotated in
  registers, GQA-aware, split over keys; returns output and log-sum-exp so segments merge exactly.
- ``window_mass``: per-key attention mass of a step's queries from their log-sum-exp, for routing, without
  materialising attention rows.
- ``merge``: exact log-sum-exp merge of attention segments and the full-precision segment with its LSE.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set before triton is imported), which is how CI tests them.

- ``cpu_decode`` (with ``cpu/quant_decode.c``): the CPU's counterpart for decode steps, in C compiled on first use:
  logits of queries against the packed tier and probability-weighted dequantized values, with PyTorch references.
"""
