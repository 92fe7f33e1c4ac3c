"""Communication: what travels between clients and server, and in how many bytes
(:mod:`fedloom.comm.compressors`: the compression operators)."""
