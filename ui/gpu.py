"""``GPU``: ``spaces.GPU`` on a ZeroGPU Space, a no-op decorator everywhere else (no ``spaces`` package needed)."""

try:  # pragma: no cover - only on Hugging Face Spaces
    import spaces

    GPU = spaces.GPU
except ImportError:
    def GPU(fn=None, **_kwargs):
        return fn if callable(fn) else (lambda f: f)
