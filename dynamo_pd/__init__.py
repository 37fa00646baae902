"""dynamo-pd: disaggregated prefill/decode LLM serving."""


def __getattr__(name: str):
    # Lazy, so `import dynamo_pd` stays light (no torch) for the frontend and router processes.
    if name == "LLM":
        from dynamo_pd.llm import LLM

        return LLM
    raise AttributeError(f"module 'dynamo_pd' has no attribute {name!r}")
