"""The embedded runtime: engine loading, vision runners, the torch decoder, KV cache, sampling, scheduling."""
