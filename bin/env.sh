# The project's environment (sourced, not executed): `source bin/env.sh` in your shell, as bin/test and
# bin/reproduce do.  After it, `python`, `pip`, `torchrun`, `deepspeed`, `jupyter`, `pytest`, `ruff` and `tox`
# are the ones in .venv (its bin/ goes first on PATH; `bash bin/bootstrap` creates .venv), and the repository
# root is on PYTHONPATH, so `python -m autosp.train`, `python -m experiments.reproduce`, ... run from anywhere.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case ":$PATH:" in
  *":$root/.venv/bin:"*) ;;
  *) export PATH="$root/.venv/bin:$PATH" ;;
esac
case ":${PYTHONPATH:-}:" in
  *":$root:"*) ;;
  *) export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
# DeepSpeed: the CPU accelerator unless a CUDA GPU is visible (or DS_ACCELERATOR is already set), and a
# project-local cache for its JIT-built ops (the default cache is shared machine-wide).
if [ -z "${DS_ACCELERATOR:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  export DS_ACCELERATOR=cpu
fi
export TORCH_EXTENSIONS_DIR="$root/.torch_extensions"
# Nothing may be downloaded at run time.
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
if [ ! -x "$root/.venv/bin/python" ]; then
  echo "bin/env.sh: $root/.venv does not exist yet: run bash bin/bootstrap" >&2
elif [[ $- == *i* ]]; then  # an interactive shell: say what changed
  echo "bin/env.sh: $root/.venv/bin is first on PATH (python, torchrun, deepspeed, jupyter, pytest)" >&2
fi
