"""``python -m torchrec_ftrl.job [FLAGS]`` (what the torchx component launches under torchrun)."""

from .train import main

main()
