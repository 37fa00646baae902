"""Deployment manifests: `python -m dynamo_pd.deploy k8s ...` prints a Kubernetes deployment (k8s.py).

    python -m dynamo_pd.deploy k8s --prefill 2 --decode 4 --engine vllm --model Qwen/Qwen3-8B > dynamo-pd.yaml
    kubectl apply -f dynamo-pd.yaml
"""
