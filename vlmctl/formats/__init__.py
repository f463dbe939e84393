"""On-disk contracts, one module each: what a directory or file holds and how it is read.

This floor imports only `vlmctl.errors` and `vlmctl.checkpoint`; stage bodies, the runtime and the
CLI all read and write these formats through it.
"""
