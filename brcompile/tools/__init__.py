"""Inspecting what the backend did (docs/ARCHITECTURE.md §9): ``explain`` (a report built from the
backend's records) and ``dump`` (graphs before/after, as Python source and Graphviz)."""
