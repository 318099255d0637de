"""``python -m torchrec_ftrl.job [FLAGS]`` (what the torchx component launches under torchrun)."""

from .extra import require_job_extra

require_job_extra()

from .train import main  # noqa: E402  (after the check: it imports the [job] extra's packages)

main()
