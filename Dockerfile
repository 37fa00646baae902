# The image `python -m dynamo_pd.deploy k8s` deploys: the package, its etcd and NATS clients, torch.
#
#   docker build -t dynamo-pd .                       # CPU torch: the native and mocker engines
#   docker build -t dynamo-pd:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#       --build-arg EXTRAS=etcd,nats,nixl,vllm .      # CUDA torch, NIXL and vLLM for NVIDIA GPUs
#
# EXTRAS names pyproject.toml's extras (sglang and TensorRT-LLM install as their projects say; see the README).
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=etcd,nats

# gcc: the KV indexer's and the native engine's C kernels (setup.py); without it they run in Python and torch
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/dynamo-pd
COPY pyproject.toml setup.py README.md ./
COPY dynamo_pd ./dynamo_pd
COPY router ./router
COPY kv_transfer ./kv_transfer
# torch first, from the index the build asks for, so the package's own install keeps it
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" \
    && pip install --no-cache-dir ".[$EXTRAS]"

# The model cache (the manifests mount a volume here); 1000: the pods' fsGroup can write it
RUN useradd --create-home --uid 1000 dynamo && mkdir -p /cache && chown dynamo /cache
ENV PYTHONUNBUFFERED=1 DYNAMO_PD_CACHE=/cache HF_HOME=/cache/huggingface
USER 1000
EXPOSE 8000 9090
# No shell in between: Kubernetes' SIGTERM reaches python itself, and a worker drains on it
CMD ["python", "-m", "dynamo_pd.frontend", "--host", "0.0.0.0"]
