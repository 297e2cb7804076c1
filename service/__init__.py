"""hsx: a hidden-state extraction service built on vLLM."""

__version__ = "0.1.0"
