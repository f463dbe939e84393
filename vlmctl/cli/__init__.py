"""Typer commands. Each module parses arguments, calls the library, and prints."""
