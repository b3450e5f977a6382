"""What the ops share, no op of its own: the impl registry (registry.py) and the compiled CPU kernels, one C++
extension with its build (cpu/)."""
