# --- Metal kernels: emulator on Linux, GPU where Metal exists (tests/metal_fixtures.py, issue 3) ---
# Provides the `metal` marker behaviour and the fixtures `metal_kernel_factory` and `metal_backend`,
# plus the "emulator-verified" summary. Keep this import; add other fixtures/hooks below it (if you
# need pytest_collection_modifyitems or pytest_terminal_summary here, call metal_fixtures' versions).
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from metal_fixtures import *  # noqa: E402,F401,F403
