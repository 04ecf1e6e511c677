"""Parameter and result shapes of every RPC method, one module per capability.

These Structs are the single home of the method schemas: execd decodes call
params into them, the harnessd client encodes them, and PROTOCOL.md documents
them.
"""
