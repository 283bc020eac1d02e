"""``GPU``: ``spaces.GPU`` where the ``spaces`` package is installed (a no-op unless the Space runs on ZeroGPU),
a no-op decorator everywhere else. ``ZERO_GPU``: this process is a ZeroGPU Space's."""

import os

ZERO_GPU = os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")

try:
    import spaces

    GPU = spaces.GPU
except ImportError:
    if ZERO_GPU:
        raise  # a ZeroGPU Space without `spaces` would run the model where no GPU is attached

    def GPU(fn=None, **_kwargs):
        return fn if callable(fn) else (lambda f: f)
