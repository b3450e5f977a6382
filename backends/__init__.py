"""How the rewritten graph's special ops execute (installed as ``brcompile.backends``).

One folder per op (docs/ARCHITECTURE.md §2): ``attention/``, ``scan/``, ``logprob/``, ``read_packed/``, each
holding the op (``op.py``), its oracle, its torch / CPU paths and its Triton kernels; ``common/`` holds what the
ops share and no op of its own: the impl registry and the compiled CPU kernels."""
