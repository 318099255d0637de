"""The compiled C++ kernel: the ops' ``CPU`` implementation. ``csrc/`` (the source and the generated
rule header), :mod:`.build` (flags, ISA variants, library names; read by ``setup.py``) and
:mod:`.backend` (loads the variant for this CPU, or builds it at first use)."""
