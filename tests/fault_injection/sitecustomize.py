"""Loaded at start-up by every Python process whose PYTHONPATH holds this folder (tests only):
applies tests/_faults.py's patches when TINYLM_FAULT or TINYLM_PARAM_DTYPE is set."""

import os
import sys

if os.environ.get("TINYLM_FAULT") or os.environ.get("TINYLM_PARAM_DTYPE"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _faults

    _faults.install()
