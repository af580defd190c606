"""The config's constants: the document separator, the token files' id limit, the held-out plays."""

from __future__ import annotations

import re

END_OF_TEXT = "<|endoftext|>"  # separates documents; the special token that ends a sample
UINT16_VOCAB_LIMIT = 65536  # token files are uint16: ids must fit in 0..65535
DEFAULT_RUN = "default"  # the main config's run, beside the named runs of `runs:`
DEFAULT_VALID_PLAYS = ["twelfth-night", "hamlet", "richard-ii", "the-tempest"]
# An entry of corpus.train_urls / valid_urls: the URL, then its sha256 as pip writes it.
URL_WITH_SHA256 = re.compile(r"(?P<url>\S+)#sha256=(?P<sha256>[0-9a-fA-F]{64})")
