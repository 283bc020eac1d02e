"""The paper's baselines on the engine's footing: eviction policies (``policies/``, one file each, run by
``eviction.py``) and the quantization baselines KIVI, KVQuant and ZipCache. Each is a transformers ``Cache`` that
reports its bytes as QEvict does; ``qevict_core.registry`` names them."""
