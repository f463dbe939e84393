"""vlmctl: turn a Hugging Face vision-language checkpoint into something that serves."""

__version__ = "0.1.0"
