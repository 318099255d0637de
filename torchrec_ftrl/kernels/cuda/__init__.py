"""The Triton kernels: the ops' ``CUDA`` implementation. :mod:`.forward`, :mod:`.backward` and
:mod:`.cache` (the kernels), :mod:`.launch` (direct launches of compiled kernels), :mod:`.pow`,
:mod:`.rule_gen` (generated from :mod:`torchrec_ftrl.rule_spec`), :mod:`.backend` (the ops'
implementations) and :mod:`.impls` (their registration, which imports Triton at the first call)."""
