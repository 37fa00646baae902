"""Prompts of mixed lengths shared by the native engine tests."""

from __future__ import annotations

import pytest

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea. Use vivid imagery, mention the tide, the salt and the gulls, and keep it calm.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n",
    (
        "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who "
        "repaired every clock in the valley. One winter morning a stranger knocked at his door carrying a clock "
        "that had no hands. The clockmaker"
    ),
]


@pytest.fixture(scope="session")
def prompt_ids():
    from transformers import AutoTokenizer

    from dynamo_pd.model_store import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in ids}) == len(ids), "prompts should have mixed lengths"
    return ids



@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One intra-op thread: on a 2-core machine shared with other test processes, OpenMP threads
    spinning against each other make every matmul several times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
