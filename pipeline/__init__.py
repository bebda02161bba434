"""Phoenix: distil a speculative-decoding draft model and measure it in a speculative server."""

import os

__version__ = "0.1.0"

# Where the user pointed torch's compile cache, read before anything imports torch: importing
# torch's inductor sets this variable to its default (/tmp/torchinductor_<user>), so a later
# look could not tell the user's choice from torch's (`models.compile_engine`).
INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
