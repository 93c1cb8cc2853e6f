"""Weight formats: how a checkpoint's quantized tensors are stored, detected and run.

- ``quant_config.py``: which scheme a checkpoint declares (AWQ/GPTQ groups, compressed-tensors).
- ``quant_blocks.py``: ``QuantizedBlocks``, a stored tensor kept at its width until the numerics are
  chosen; ``gguf_quant.py`` (GGUF blocks, Q8_0 made on packing, the K-quants' quantizers),
  ``group_quant.py`` (AWQ/GPTQ), ``compressed_tensors.py``, ``rows16.py`` (16-bit rows) subclass it.
- ``weight_formats.py``: a projection's weight as a kernel reads it (float32 / bfloat16 packed,
  int8 blocks, kept blocks, grouped experts), with its matmul and decode-graph descriptor.

Below the layers that use them (``layers/linear.py``, ``layers/moe.py``) and above the kernels.
"""
