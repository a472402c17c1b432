"""Parrot: the Python frontend of Parrot serve.

This package is the light client side (httpx + pydantic only): it never imports the server, torch or
transformers. `parrot.protocol` holds the wire schema shared with the server.
"""

__version__ = "0.1.0"
