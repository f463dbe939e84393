"""Decoding of request media that is more than a still image (videos), images made RGB as transformers
makes them (images), and reading local media files safely (local_files), below every caller.

`chat`, `serve` and the family modules import it downward; it imports only `errors`.
"""
