"""Phoenix: distil a speculative-decoding draft model and measure it in a speculative server."""

__version__ = "0.1.0"
