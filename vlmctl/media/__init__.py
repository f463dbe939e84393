"""Decoding of request media that is more than a still image (videos), below every caller.

`chat`, `serve` and the family modules import it downward; it imports only `errors`.
"""
