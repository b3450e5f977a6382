"""How the rewritten graph's special ops execute (installed as ``brcompile.backends``)."""
