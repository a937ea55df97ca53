"""Where the repository and the tests' shared helpers are, for tests in any folder below ``tests/``."""
from __future__ import annotations

import os

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
