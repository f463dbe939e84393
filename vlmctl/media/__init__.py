"""Decoding of request media that is more than a still image (videos), and reading local media files
safely (local_files), below every caller.

`chat`, `serve` and the family modules import it downward; it imports only `errors`.
"""
