"""lm: pretraining framework for expressive recurrent language models."""

__version__ = "0.1.0"
