# Environment shared by bin/test and bin/reproduce (sourced, not executed).
# DeepSpeed on CPU: the CPU accelerator and a project-local cache for its
# JIT-built ops (the default cache is shared machine-wide).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="$root/.torch_extensions"
# Nothing may be downloaded at run time.
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
