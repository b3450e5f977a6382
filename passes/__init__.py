"""Target-independent FX analysis and rewrites (installed as ``brcompile.passes``)."""
