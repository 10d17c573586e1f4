# Sourced (not run): puts the NVRTC and ptxas of scripts/setup-cuda-tools.sh on LD_LIBRARY_PATH
# and ANNEAL_PTXAS when they are installed. Safe to source when they are not.
_anneal_tools="${ANNEAL_CUDA_TOOLS:-$HOME/.cache/anneal-cuda-tools}"
_anneal_cu13=$(ls -d "$_anneal_tools"/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -1)
if [ -n "$_anneal_cu13" ] && [ -e "$_anneal_cu13/lib/libnvrtc.so.13" ]; then
  export LD_LIBRARY_PATH="$_anneal_cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -x "$_anneal_cu13/bin/ptxas" ] && export ANNEAL_PTXAS="$_anneal_cu13/bin/ptxas"
fi
unset _anneal_tools _anneal_cu13
